"""Sampling by swarm workers for `echo-rl serve --swarm-listen ADDR`: asample requests become leases.

    the base model   version 0, a full snapshot of the first served model, seeded to the workers that join
                     (`echo-rl worker join --learner $(cat SWARM_DIR/learner.addr) --engine transformers`)
    a sampler        published as the next version the first time a request samples it, its adapters alone
                     (a LoRA version on version 0), while fewer than ADAPTER_SLOTS versions have requests
                     waiting and the oldest of them stays among the KEPT newest versions
    asample          queued, leased, answered (learner.serve.sample_queue): every group is replayed
                     (learner.orchestrate.verify: logprobs, draws and off-draw share, at the request's
                     temperature and top_p) and must end where its stop tokens or budget end it; the samples
                     answer the request with the replay's logprobs; a forger is flagged
    here instead     the local sampler draws greedy, seeded (repeated bit for bit) and prompt-logprob requests,
                     `stop=[]`, the base model's own samplers, every request while no worker is live, and
                     any request whose lease went wrong or that no worker leased in time

A request's draws are keyed by its draw id (learner.serve.draw_ids: a lease's groups are the draw ids, from
completion 0 up), so a request draws the same samples here as on a worker, up to float noise (and to what the
replay lets a worker steer: docs/security.md). With workers, the local sampler holds the first model's weights
and adapters rounded to 16 bits as they do (learner.serve.sampler, `as_workers`).

Workers hold the adapters of up to ADAPTER_SLOTS versions (SpecReply.adapter_slots; the heartbeat names the
versions with requests waiting, which they fetch) and switch to a lease's version before drawing it, so several
tenants' samplers are drawn by the workers at once; a sampler beyond those slots is drawn here. Stop strings
are cut here after the replay (workers stop at stop tokens only). The adapters' scale is 1
(learner.serve.trained_model): the spec's LoRA rank and alpha are 1. A sampler may adapt the (tied) output
layer, which llama.cpp's LoRA cannot take: the spec sends llama.cpp workers away, and the replay model is
untied (the head's adapter applies to the head alone).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tinker import types

from learner.orchestrate.publisher import Publisher
from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify import RolloutVerifier
from learner.serve.sample_queue import LEASE_SEQUENCES, LEASE_TOKENS, SILENCE_S, SampleBoard, SwarmJob, SwarmLease
from learner.serve.sampler import (
    MAX_NEW_TOKENS,
    MAX_SAMPLES,
    Drawn,
    SamplerWeights,
    cut_at_stop,
    request_params,
    workers_adapters,
)
from learner.serve.scorer import untied_replay
from learner.swarm_config import SwarmConfig
from learner.train.devices import give_back_freed_memory
from learner.train.models import load_policy, model_spec
from learner.train.wire_weights import wire_tensors
from p2p.auth import AUTH, SwarmAuth
from p2p.broadcast import ChunkStore, Seeder
from p2p.host import BadRequest, Host, HostConfig, Misbehaviour
from p2p.identity import load_identity
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    LOGPROB_FLOOR,
    ROLLOUT,
    SPEC,
    STATUS,
    Completion,
    GenerationRequest,
    Heartbeat,
    HeartbeatReply,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    MessageError,
    RolloutReply,
    RolloutSubmission,
    SpecReply,
    SpecRequest,
)
from p2p.wire import FrameLimits, rollout_frame_limits

log = logging.getLogger(__name__)

HEAD_ADAPTER_REASON = "echo-rl serve's samplers may adapt the output layer, which llama.cpp workers cannot"
ROLLOUTS_AT_ONCE = 2  # submissions replayed at once (the rest wait, their leases no longer timed)
ADAPTER_SLOTS = 4  # sampler versions with requests out at once (each worker holds their adapters)
KEPT = 2 * ADAPTER_SLOTS  # the newest versions kept (chunks, replay): a working version must stay among them
MIN_TEMPERATURE = 0.5  # colder requests are drawn here: the replay's tolerances were measured at 0.8 and
# 16-bit rounding's effect on logprobs and draws grows as 1/T


class SwarmSampler:
    """The swarm side of `echo-rl serve` for one base model (module docstring). Thread-safe: asample submits
    from a thread of the event loop's executor, the host's handler threads lease and verify, a timer thread
    lapses leases and sends late requests here."""

    def __init__(
        self, base_model: str, cache_dir: str, listen: str, swarm_dir: str, device: str = "cpu",
        secret: bytes | None = None, alone: bool = False,
    ) -> None:  # fmt: skip
        """`alone`: workers draw each request in engine waves of its own (LeaseGrant.alone; `--sample-seed`)."""
        self.base_model, self.alone = base_model, alone
        policy = load_policy(base_model, cache_dir)
        model = policy.model
        self.tokenizer = policy.tokenizer
        self.vocab = int(model.config.vocab_size)
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        spec = model_spec(policy)
        recipe = json.dumps({"unsupported": HEAD_ADAPTER_REASON})
        self.spec = replace(spec, lora_rank=1, lora_alpha=1.0, gguf_recipe=recipe)
        self.stop_default = frozenset(spec.eos_ids)
        base = wire_tensors(model, "f16")
        make_model, replayed = untied_replay(model, base)  # (the head's adapter applies to the head alone)
        del policy, model
        defaults = SwarmConfig()
        self.verifier = RolloutVerifier(
            make_model, 1.0, 1.0, first=1 << 62, fraction=1.0,
            tolerance=defaults.verify_tolerance, draw_tolerance=defaults.verify_draw_tolerance, lora_scale=1.0,
            keep=KEPT, device=device, off_draw_tolerance=defaults.verify_off_draw,
        )  # fmt: skip
        folder = Path(swarm_dir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "learner.addr").unlink(missing_ok=True)  # (written once every handler is in place)
        self.host = Host(load_identity(folder / "learner.key"), HostConfig(listen=[listen]))
        self.host.start()
        try:
            auth = SwarmAuth(self.host.peer_id, secret)
            self.host.gate = auth.allows
            self.host.handle(AUTH, auth.on_auth, guarded=False)
            self.seeder = Seeder(self.host, ChunkStore(spill_dir=folder / "chunks"), silence=SILENCE_S)
            self.run_id = secrets.token_hex(8)
            self.publisher = Publisher(self.seeder, run_id=self.run_id, full_every=1 << 30, dtype="f16", lora=True,
                                       adapter_keep=KEPT)  # fmt: skip
            self.publisher.publish(0, base)
            self.verifier.remember(0, replayed, None)
        except BaseException:
            self.host.stop()
            raise
        self.published: dict[int, SamplerWeights] = {}  # version -> its sampler, the KEPT newest
        self.board = SampleBoard()
        self._publishing = threading.Lock()  # one submit at a time decides and publishes (never the board's lock)
        self._closed = threading.Event()
        self.spec_reply = SpecReply(self.run_id, self.spec, 1, adapter_slots=ADAPTER_SLOTS).to_wire()
        self.host.handle(SPEC, self._on_spec)
        self.host.handle(HEARTBEAT, self._on_heartbeat)
        self.host.handle(LEASE, self._on_lease)
        self.host.handle(STATUS, lambda peer, msg: self.status(), guarded=False)  # read-only, open to any peer
        self.host.handle(ROLLOUT, self._on_rollout, limits=rollout_limits())
        self._replays = threading.BoundedSemaphore(ROLLOUTS_AT_ONCE)
        self._timer = threading.Thread(target=self._sweep_loop, name="serve-swarm", daemon=True)
        self._timer.start()
        addr = folder / "learner.addr"
        addr.with_suffix(".tmp").write_text(self.host.addrs[0] + "\n")
        addr.with_suffix(".tmp").replace(addr)
        log.info("serve: workers join %s (sampling %s)", self.host.addrs[0], base_model)

    # -- the requests' side (asample, on a thread of its own) ----------------------------------------

    def submit(
        self, weights: SamplerWeights, req: types.SampleRequest, draw: int, answer: Callable[[Drawn], None],
        here: Callable[[], None],
    ) -> bool:  # fmt: skip
        """Queue `req` (draw id `draw`: the samples it would draw here) for the workers; False where it is drawn
        here (by the caller): a request workers do not draw (module docstring), no live worker, or another
        sampler's requests out. Raises RequestError for a request no sampler could draw. Publishing a sampler
        takes a moment: call it off the event loop."""
        p = req.sampling_params
        if weights.base_model != self.base_model or not weights.adapters or weights.full:  # (the base itself:
            return False  # version 0, which workers past it do not fetch again; every weight: no LoRA version)
        if p.temperature < MIN_TEMPERATURE or req.prompt_logprobs or p.stop == [] or p.seed is not None:
            return False
        if req.num_samples * (p.max_tokens or MAX_NEW_TOKENS) > LEASE_TOKENS:  # more than a lease may hold
            return False
        prompt = req.prompt.to_ints()
        params, stop_strings = request_params(req, prompt, self.context, self.vocab, self.tokenizer)
        params = replace(params, stop_when=None)  # (stop strings are cut here)
        with self._publishing:
            if not self.board.live(self.verifier.flagged):
                return False
            working = self.board.working()
            version = next((v for v, w in self.published.items() if w is weights), None)
            if version is not None and version > self.board.version - KEPT:  # (its chunks and replay still kept)
                if version not in working and len(working) >= ADAPTER_SLOTS:
                    return False  # the workers' slots are taken
                self.board.add(SwarmJob(req, prompt, draw, version, params, stop_strings, answer, here))
                return True
            version = self.board.version + 1
            if len(working) >= ADAPTER_SLOTS or (working and min(working) <= version - KEPT):
                return False  # the workers' slots are taken, or the oldest would be dropped under its requests
            adapters = workers_adapters(weights.adapters)
            if adapters is None:
                return False  # (beyond f16's range: only the float32 sampler here can draw it)
            self.publisher.publish(version, adapters)
            self.verifier.remember(version, adapters, 0)
            self.published = {v: w for v, w in self.published.items() if v > version - KEPT} | {version: weights}
            self.board.publish(version, SwarmJob(req, prompt, draw, version, params, stop_strings, answer, here))
        return True

    # -- the workers' side (the host's handler threads) ----------------------------------------------

    def _on_spec(self, peer: str, msg: dict) -> dict:
        if reason := SpecRequest.from_wire(msg).mismatch():
            raise BadRequest(reason)
        self.board.seen(peer)
        return self.spec_reply

    def _on_heartbeat(self, peer: str, msg: dict) -> dict:
        beat = Heartbeat.from_wire(msg)
        if beat.hardware.get("weights", "f16") != "f16":  # serve replays every sample on torch: 16-bit weights
            raise BadRequest("quantized weights: `echo-rl serve` verifies 16-bit workers only (--quant f16)")
        self.board.seen(peer, beat.version, beat.hardware.get("max_batch"), beat.tokens_per_s, beat.hardware)
        return HeartbeatReply(self.board.version, tuple(sorted(self.board.working()))).to_wire()

    def _on_lease(self, peer: str, msg: dict) -> dict:
        request = LeaseRequest.from_wire(msg)
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        lease = self.board.lease(peer, request.version, request.max_groups, request.held)
        if lease is None:
            return LeaseReply(wait=0.3, newest=self.board.version).to_wire()
        requests = [
            GenerationRequest(lease.jobs[j].prompt, lease.group_size, group=draw, completion=first)
            for j, (draw, first) in zip(lease.groups, lease.keys(), strict=True)
        ]
        params = lease.jobs[0].params  # (seed DRAW_SEED: the draw ids key each request's draws)
        seconds = max(lease.deadline - time.monotonic(), 1.0)
        grant = LeaseGrant(lease.lease_id, requests, params, lease.version, seconds, self.alone)
        return LeaseReply(grant).to_wire()

    def _on_rollout(self, peer: str, msg: dict) -> dict:
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        self.board.seen(peer)
        lease = self.board.take(peer, msg.get("lease"))  # (now being verified: its time no longer runs)
        verified, tokens = False, 0
        try:
            with self._replays:
                samples = self._verify(peer, lease, msg)
            tokens = sum(len(c.tokens) for group in samples for c in group)
            for j, job in enumerate(lease.jobs):
                drawn = [c for g, owner in enumerate(lease.groups) if owner == j for c in samples[g]]
                drawn = drawn[: job.req.num_samples]
                if job.stop_strings:
                    drawn = [cut_at_stop(c, job.stop_strings, self.tokenizer) for c in drawn]
                job.resolve(Drawn(drawn, None))
            verified = True
        except (BadRequest, Misbehaviour, MessageError):  # refused: the worker is banned, its requests drawn here
            self.board.done(lease, verified=False)
            raise
        except Exception:  # our failure (a replay out of memory, a bug): drawn here, nobody banned
            log.exception("serve: a lease of %s could not be verified; its requests are drawn here", peer[-8:])
            self.board.done(lease, verified=False, ban=False)
            raise
        finally:
            if verified:
                self.board.done(lease, verified=True, tokens=tokens)
            give_back_freed_memory()  # (the replay's logits, on a handler thread's own heap)
        return RolloutReply(len(lease.groups)).to_wire()

    def _verify(self, peer: str, lease: SwarmLease, msg: dict) -> list[list[Completion]]:
        """The lease's samples with the replay's logprobs, every group replayed; raises BadRequest or
        Misbehaviour (a forger is flagged)."""
        params = lease.jobs[0].params
        sizes = [lease.group_size] * len(lease.groups)
        submission = RolloutSubmission.from_wire(msg, sizes, params.max_new_tokens, self.vocab)
        if submission.version != lease.version:
            raise Misbehaviour(f"the lease is for v{lease.version}, not v{submission.version}")
        keys = lease.keys()
        if [g.group for g in submission.groups] != [draw for draw, _ in keys]:
            raise Misbehaviour("the lease's groups, in order, are required")
        stops = self.stop_default | (params.stop_ids or frozenset())
        groups = []
        for g, group in enumerate(submission.groups):
            prompt = lease.jobs[lease.groups[g]].prompt
            for c in group.completions:  # an honest worker stops at the first stop token, else at the budget
                ended = c.tokens[-1] in stops or len(c.tokens) == params.max_new_tokens
                if not ended or any(t in stops for t in c.tokens[:-1]) or c.spans:
                    self.verifier.flag(peer, "a sample does not end where the lease's stop tokens or budget end it")
                    raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
            rollouts = [Rollout(prompt, c.tokens, c.logprobs, 0.0, 0.0, lease.version) for c in group.completions]
            draw, first = keys[g]
            replay = self.verifier.check(
                peer, lease.version, params.seed, draw, rollouts, (params.temperature, params.top_p), first
            )
            if peer in self.verifier.flagged:
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
            if replay is None:
                raise RuntimeError(f"v{lease.version} is no longer kept: the samples cannot be verified")
            if not all(LOGPROB_FLOOR <= x <= 0.0 for x in replay.logprobs):  # (NaN fails too)
                self.verifier.flag(peer, "a sampled token lies outside the nucleus, or below the logprob floor")
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
            logprobs = iter(replay.logprobs)  # the replay's: the worker's only had to be within tolerance
            groups.append([Completion(c.tokens, [next(logprobs) for _ in c.tokens],
                                      "stop" if c.tokens[-1] in stops else "length") for c in group.completions])
        self.verifier.accepted(peer, len(groups))
        return groups

    # -- leases that lapse, requests drawn here ------------------------------------------------------

    def _sweep_loop(self) -> None:
        while not self._closed.wait(0.5):
            try:
                for peer in self.board.sweep():
                    log.info("serve: a lease of %s lapsed; its requests are drawn here", peer[-8:])
            except Exception:  # noqa: BLE001 - a bug of ours: logged, and the sweeps go on
                log.exception("serve: the swarm's sweep failed")

    def summary(self) -> dict:
        """For logs and tests: the workers, the queue, the leases out, the requests answered each way."""
        return self.board.summary() | {"flagged": dict(self.verifier.flagged)}

    def status(self) -> dict:
        """The status document `echo-rl status --learner ADDR` asks for (docs/status.md, serve's swarm)."""
        return {
            "schema": 1, "kind": "serve", "run_id": self.run_id, "peer_id": self.host.peer_id,
            "addrs": self.host.addrs, "base_model": self.base_model, "adapter_slots": ADAPTER_SLOTS,
            "draws_alone": self.alone, **self.board.summary(), "verification": self.verifier.summary(),
            "penalties": dict(self.host.guard.counts), "banned": self.host.guard.banned_peers(),
            "peers": self.board.peers(self.verifier.flagged),
        }  # fmt: skip

    def close(self) -> None:
        self._closed.set()
        summary = self.board.summary()
        log.info("serve: workers drew %d sample requests, %d were drawn here", summary["answered"],
                 summary["sampled_here"])  # fmt: skip
        self.seeder.close()
        self.host.stop()
        self.board.drain()


def rollout_limits() -> FrameLimits:
    """What one submission may hold (p2p.wire.rollout_frame_limits): twice LEASE_TOKENS tokens (the first request
    is leased whole, its groups rounded up to the worker's batch) and twice the samples of LEASE_SEQUENCES
    requests."""
    samples = MAX_SAMPLES * LEASE_SEQUENCES
    return rollout_frame_limits(2 * LEASE_TOKENS, 2 * samples, max(MAX_NEW_TOKENS, samples))
