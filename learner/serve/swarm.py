"""Sampling by swarm workers for `echo-rl serve --swarm-listen ADDR`: asample requests become leases.

    the base model   version 0, a full snapshot of the first served model, seeded to the workers that join
                     (`echo-rl worker join --learner $(cat SWARM_DIR/learner.addr) --engine transformers`)
    a sampler        published as the next version the first time a request samples it, its adapters alone
                     (a LoRA version on version 0: a few MB), unless workers are still busy with the newest
                     sampler's requests; then its requests are sampled here
    asample          queued; a worker holding the version leases the queued requests of equal params (one
                     group per request, split into groups of at most its batch), generates, pushes; every
                     group is replayed (learner.orchestrate.verify: logprobs and draws, at the request's
                     temperature and top_p) before its samples answer the request; a forger is flagged
                     and its requests go back to the queue
    here instead     the local sampler draws: greedy, seeded (reproducible whoever joins) and prompt-logprob
                     requests, `stop=[]`, the base model's own samplers, every request while no worker is
                     heard from, one no worker leased within WAIT_S, one whose lease lapsed (a killed worker)

Workers hold one version at a time, so two tenants sampling at once take turns: while one sampler's requests
are out, another's are sampled here. Stop strings are cut here after the replay (workers stop at stop tokens
only). The adapters' scale is 1 (learner.serve.trained_model): the spec's LoRA rank and alpha are 1. A sampler
may adapt the (tied) output layer, which llama.cpp's LoRA cannot take: the spec sends llama.cpp workers away,
and the replay model is untied (the head's adapter applies to the head alone).
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tinker import types
from transformers import AutoModelForCausalLM

from learner.config import SwarmConfig
from learner.orchestrate.publisher import Publisher
from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify import RolloutVerifier
from learner.serve.sampler import Drawn, SamplerWeights, cut_at_stop, request_params
from learner.train.models import load_policy, model_spec
from learner.train.wire_weights import wire_name, wire_tensors
from p2p.auth import AUTH, SwarmAuth
from p2p.broadcast import ChunkStore, Seeder
from p2p.host import BadRequest, Host, HostConfig, Misbehaviour
from p2p.identity import load_identity
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    ROLLOUT,
    SPEC,
    Completion,
    GenerationRequest,
    Heartbeat,
    HeartbeatReply,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    RolloutReply,
    RolloutSubmission,
    SamplingParams,
    SpecReply,
    SpecRequest,
)

log = logging.getLogger(__name__)

WAIT_S = 60.0  # a request no worker has leased this long is sampled here
LEASE_BASE_S = 30.0  # a lease's time: this, and its tokens at SLOWEST_TOKENS_S (its worker's silence ends it sooner)
SLOWEST_TOKENS_S = 20.0  # tokens per second (a lease's sequences together) of the slowest worker served
SILENCE_S = 30.0  # a worker not heard from this long is gone: its leases go back to the queue
LAPSE_BAN_S = 600.0  # a worker whose lease lapsed gets no lease this long (it held requests that others drew)
LEASE_SEQUENCES = 4  # a lease holds at most this many of the worker's batches (several workers share a batch)
HEAD_ADAPTER_REASON = "echo-rl serve's samplers may adapt the output layer, which llama.cpp workers cannot"


@dataclass(eq=False)
class SwarmJob:
    """One asample request on its way through the swarm."""

    req: types.SampleRequest
    prompt: list[int]
    version: int
    params: SamplingParams  # stop ids included; seed 0 (the lease's seed is drawn when it is made)
    stop_strings: list[str]
    answer: Callable[[Drawn], None]  # the request's result, verified
    here: Callable[[], None]  # sample it on this machine instead
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class SwarmLease:
    lease_id: int
    worker: str
    version: int
    jobs: list[SwarmJob]
    group_size: int
    groups: list[int]  # per group, the index of its job in `jobs`
    seed: int
    deadline: float  # time.monotonic()


@dataclass
class SwarmWorker:
    version: int = -1
    max_batch: int = 1  # its word (the heartbeat's): a worker that overstates it fails its leases, and is banned
    seen: float = field(default_factory=time.monotonic)
    delivered: int = 0  # leases it answered: until one, its leases hold one request
    banned_until: float = 0.0  # a lease of its lapsed: none until then


class SwarmSampler:
    """The swarm side of `echo-rl serve` for one base model (module docstring). Thread-safe: the event loop
    submits, the host's handler threads lease and verify, a timer thread sends late requests here."""

    def __init__(
        self, base_model: str, cache_dir: str, listen: str, swarm_dir: str, device: str = "cpu",
        secret: bytes | None = None,
    ) -> None:  # fmt: skip
        self.base_model = base_model
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
        replayed = dict(base)  # the replay model is untied: its head starts as the embedding
        if getattr(model.config, "tie_word_embeddings", False):
            embedding = model.get_input_embeddings().weight
            name = next(wire_name(n) for n, p in model.named_parameters() if p is embedding)
            replayed["lm_head.weight"] = base[name]
        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = False
        del policy, model
        defaults = SwarmConfig()
        self.verifier = RolloutVerifier(
            lambda: AutoModelForCausalLM.from_config(config), 1.0, 1.0, first=1 << 62, fraction=1.0,
            tolerance=defaults.verify_tolerance, draw_tolerance=defaults.verify_draw_tolerance, lora_scale=1.0,
            keep=2, device=device, off_draw_tolerance=defaults.verify_off_draw,
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
            self.publisher = Publisher(self.seeder, run_id=self.run_id, full_every=1 << 30, dtype="f16", lora=True)
            self.publisher.publish(0, base)
            self.verifier.remember(0, replayed, None)
        except BaseException:
            self.host.stop()
            raise
        self.newest: tuple[SamplerWeights, int] | None = None  # the sampler published last, and its version
        self.version = 0
        self.queue: list[SwarmJob] = []
        self.leases: dict[int, SwarmLease] = {}
        self.workers: dict[str, SwarmWorker] = {}
        self.answered = self.sampled_here = 0  # requests answered by workers, and sent here instead
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.spec_reply = SpecReply(self.run_id, self.spec, 1).to_wire()
        self.host.handle(SPEC, self._on_spec)
        self.host.handle(HEARTBEAT, self._on_heartbeat)
        self.host.handle(LEASE, self._on_lease)
        self.host.handle(ROLLOUT, self._on_rollout)
        self._timer = threading.Thread(target=self._sweep_loop, name="serve-swarm", daemon=True)
        self._timer.start()
        addr = folder / "learner.addr"
        addr.with_suffix(".tmp").write_text(self.host.addrs[0] + "\n")
        addr.with_suffix(".tmp").replace(addr)
        log.info("serve: workers join %s (sampling %s)", self.host.addrs[0], base_model)

    # -- the event loop's side -----------------------------------------------------------------------

    def submit(
        self, weights: SamplerWeights, req: types.SampleRequest, answer: Callable[[Drawn], None],
        here: Callable[[], None],
    ) -> bool:  # fmt: skip
        """Queue `req` for the workers; False where it is sampled here (the caller does): a request workers do
        not draw (greedy, prompt logprobs, no stop at all), no live worker, or another sampler's requests out.
        Raises RequestError for a request no sampler could draw."""
        p = req.sampling_params
        if weights.base_model != self.base_model or not weights.adapters:  # (the base itself: version 0, which
            return False  # workers past it do not fetch again)
        if p.temperature == 0 or req.prompt_logprobs or p.stop == [] or p.seed is not None:
            return False
        prompt = req.prompt.to_ints()
        params, stop_strings = request_params(req, prompt, self.context, self.vocab, self.tokenizer)
        params = replace(params, seed=0)  # (the lease's seed: requests of equal params go together)
        with self._lock:
            now = time.monotonic()
            if not self._live_locked(now):
                return False
            if self.newest is None or self.newest[0] is not weights:
                if self.queue or self.leases:  # workers are busy with the newest sampler's requests
                    return False
                adapters = {name: a.astype(np.float16) for name, a in weights.adapters.items()}
                if not all(np.isfinite(a).all() for a in adapters.values()):
                    return False  # (beyond f16's range: only the float32 sampler here can draw it)
                self.version += 1
                self.publisher.publish(self.version, adapters)
                self.verifier.remember(self.version, adapters, 0)
                self.newest = (weights, self.version)
            self.queue.append(SwarmJob(req, prompt, self.version, params, stop_strings, answer, here))
        return True

    def _live_locked(self, now: float) -> bool:
        """Whether a worker holding a version has been heard from lately (and is not flagged)."""
        flagged = self.verifier.flagged
        return any(now - w.seen <= SILENCE_S and w.version >= 0 and p not in flagged for p, w in self.workers.items())

    # -- the workers' side ---------------------------------------------------------------------------

    def _worker(self, peer: str) -> SwarmWorker:
        with self._lock:
            worker = self.workers.setdefault(peer, SwarmWorker())
            worker.seen = time.monotonic()
            return worker

    def _on_spec(self, peer: str, msg: dict) -> dict:
        if reason := SpecRequest.from_wire(msg).mismatch():
            raise BadRequest(reason)
        self._worker(peer)
        return self.spec_reply

    def _on_heartbeat(self, peer: str, msg: dict) -> dict:
        beat = Heartbeat.from_wire(msg)
        worker = self._worker(peer)
        batch = beat.hardware.get("max_batch")
        with self._lock:
            worker.version = min(beat.version, self.version)
            worker.max_batch = min(max(batch, 1), 256) if type(batch) is int else 1
        return HeartbeatReply(self.version).to_wire()

    def _on_lease(self, peer: str, msg: dict) -> dict:
        request = LeaseRequest.from_wire(msg)
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        worker = self._worker(peer)
        with self._lock:
            worker.version = min(request.version, self.version)
            lease = self._lease_locked(peer, worker, request.version, request.max_groups)
        if lease is None:
            return LeaseReply(wait=0.3, newest=self.version).to_wire()
        prompts = [lease.jobs[j].prompt for j in lease.groups]
        requests = [GenerationRequest(prompt, lease.group_size, group=g) for g, prompt in enumerate(prompts)]
        params = replace(lease.jobs[0].params, seed=lease.seed)
        seconds = max(lease.deadline - time.monotonic(), 1.0)
        return LeaseReply(LeaseGrant(lease.lease_id, requests, params, lease.version, seconds)).to_wire()

    def _lease_locked(self, peer: str, worker: SwarmWorker, version: int, max_groups: int) -> SwarmLease | None:
        """The queued requests a worker holding `version` takes: the oldest one's, and those with its params
        and sample count, up to LEASE_SEQUENCES batches; each request's samples in groups of at most its batch."""
        first = next((job for job in self.queue if job.version == version), None)
        if first is None or time.monotonic() < worker.banned_until:
            return None
        n = first.req.num_samples
        split = -(-n // worker.max_batch)  # groups per request, each of group_size samples (>= n in all)
        group_size = -(-n // split)
        jobs: list[SwarmJob] = []
        most = LEASE_SEQUENCES * worker.max_batch if worker.delivered else n  # a new worker: one request
        for job in self.queue:
            fits = (len(jobs) + 1) * split <= max_groups and (len(jobs) + 1) * n <= most
            if not fits and jobs:
                break
            if not jobs or (job.version == version and job.req.num_samples == n and job.params == first.params):
                jobs.append(job)
        taken = set(map(id, jobs))
        self.queue = [job for job in self.queue if id(job) not in taken]
        seed = secrets.randbits(62)
        groups = [j for j in range(len(jobs)) for _ in range(split)]
        seconds = LEASE_BASE_S + len(groups) * group_size * first.params.max_new_tokens / SLOWEST_TOKENS_S
        lease = SwarmLease(secrets.randbits(62), peer, version, jobs, group_size, groups, seed,
                           time.monotonic() + seconds)  # fmt: skip
        self.leases[lease.lease_id] = lease
        return lease

    def _on_rollout(self, peer: str, msg: dict) -> dict:
        self._worker(peer)
        with self._lock:
            lease_id = msg.get("lease") if isinstance(msg, dict) else None
            lease = self.leases.get(lease_id) if isinstance(lease_id, int) else None
            if lease is None:
                raise BadRequest("no such lease (it expired, and its requests were answered otherwise)")
            if lease.worker != peer:
                raise Misbehaviour("another worker's lease")
            del self.leases[lease.lease_id]
        try:
            samples = self._verify(peer, lease, msg)
        except BaseException:  # its requests go first in the queue (or here, once they have waited WAIT_S)
            with self._lock:
                self.queue[:0] = lease.jobs
            raise
        for j, job in enumerate(lease.jobs):
            drawn = [c for g, owner in enumerate(lease.groups) if owner == j for c in samples[g]][: job.req.num_samples]
            if job.stop_strings:
                drawn = [cut_at_stop(c, job.stop_strings, self.tokenizer) for c in drawn]
            job.answer(Drawn(drawn, None))
        with self._lock:
            self.answered += len(lease.jobs)
            if (worker := self.workers.get(peer)) is not None:
                worker.delivered += 1
        return RolloutReply(len(lease.groups)).to_wire()

    def _verify(self, peer: str, lease: SwarmLease, msg: dict) -> list[list[Completion]]:
        """The lease's completions, each group replayed; raises BadRequest or Misbehaviour (a forger is flagged)."""
        params = lease.jobs[0].params
        sizes = [lease.group_size] * len(lease.groups)
        submission = RolloutSubmission.from_wire(msg, sizes, params.max_new_tokens, self.vocab)
        if submission.version != lease.version:
            raise BadRequest(f"the lease is for v{lease.version}, not v{submission.version}")
        if [g.group for g in submission.groups] != list(range(len(lease.groups))):
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
            replay = self.verifier.check(
                peer, lease.version, lease.seed, g, rollouts, (params.temperature, params.top_p)
            )
            if peer in self.verifier.flagged:
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
            if replay is None:
                raise BadRequest(f"v{lease.version} is no longer kept: the samples cannot be verified")
            finish = ["stop" if c.tokens[-1] in stops else "length" for c in group.completions]
            groups.append([Completion(c.tokens, c.logprobs, f) for c, f in zip(group.completions, finish, strict=True)])
        self.verifier.accepted(peer, len(groups))
        return groups

    # -- leases that lapse, requests drawn here --------------------------------------------------------------

    def _sweep_loop(self) -> None:
        while not self._closed.wait(0.5):
            self.sweep()

    def sweep(self) -> None:
        """Leases past their time or of silent workers go back to the queue; requests waiting WAIT_S (or with
        no live worker, or on a version no worker will fetch again) are sampled here."""
        now = time.monotonic()
        here: list[SwarmJob] = []
        with self._lock:
            for lease_id, lease in list(self.leases.items()):
                worker = self.workers.get(lease.worker)
                if now > lease.deadline or worker is None or now - worker.seen > SILENCE_S:
                    del self.leases[lease_id]
                    if worker is not None:
                        worker.banned_until = now + LAPSE_BAN_S
                    self.queue[:0] = lease.jobs
                    log.info("serve: lease %d of %s lapsed; its %d requests go to others", lease_id,
                             lease.worker[-8:], len(lease.jobs))  # fmt: skip
            for peer in [p for p, w in self.workers.items() if now - w.seen > SILENCE_S]:
                del self.workers[peer]
            live = self._live_locked(now)
            keep = []
            for job in self.queue:
                late = now - job.queued_at > WAIT_S or not live or job.version != self.version
                (here if late else keep).append(job)
            self.queue = keep
            self.sampled_here += len(here)
        for job in here:
            job.here()

    def summary(self) -> dict:
        """For logs and tests: the workers, the queue, the leases out, the requests answered each way."""
        with self._lock:
            return {"version": self.version, "workers": len(self.workers), "queued": len(self.queue),
                    "leases": len(self.leases), "answered": self.answered, "sampled_here": self.sampled_here,
                    "flagged": dict(self.verifier.flagged)}  # fmt: skip

    def close(self) -> None:
        self._closed.set()
        log.info("serve: workers drew %d sample requests, %d were drawn here", self.answered, self.sampled_here)
        self.seeder.close()
        self.host.stop()
        with self._lock:
            here, self.queue = self.queue + [j for lease in self.leases.values() for j in lease.jobs], []
            self.leases.clear()
        for job in here:
            job.here()
