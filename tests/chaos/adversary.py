"""A hostile worker: distinct attacks on a live learner, each with the outcome the learner owes us.

    python scripts/adversary.py --learner MULTIADDR [--secret-file F] [--json]

Each attack comes from a fresh identity (so that a ban earned by one does not hide the next) and is
judged by what the learner says back and by its open status document, read by an observer before and
after: penalties by reason, bans, flagged workers, verified groups. Attacks that need honestly sampled
text sync the learner's weights through the swarm like any worker and sample with the transformers
engine from the lease's draws (p2p.draws), then forge from there. After the attacks the adversary syncs
the newest published version and checks that every weight is finite.

Forgeries are caught only in the groups the learner chooses to verify (at random: half of a new
worker's groups, a few percent after); against a learner with a low verify fraction an attack is
repeated from the same identity until it is flagged, at most `tries` times, and reports how often.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import zstandard

from echo_cli.bench_verify import steered_completion
from learner.orchestrate.replay_torch import replay_sampling
from learner.orchestrate.rollouts import Rollout
from p2p.auth import authenticate
from p2p.broadcast import JOIN, BroadcastPeer, ChunkStore
from p2p.host import Host, PeerUnavailable, RemoteError
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    ROLLOUT,
    SPEC,
    STATUS,
    Completion,
    GenerationRequest,
    GroupSubmission,
    RolloutSubmission,
    SamplingParams,
    SpecReply,
    SpecRequest,
)
from p2p.versions import float_tensors
from p2p.wire import HEADER
from tests.chaos.hostile import hold_streams, send_raw
from worker.engines.hf import TransformersEngine


@dataclass
class Outcome:
    """What one attack did: what the learner owed us, what it did, and whether that was it."""

    name: str
    expected: str
    observed: str
    ok: bool
    details: dict = field(default_factory=dict)


def logprobs_set_to(value: float) -> Callable:
    """A forgery: honest tokens, every logprob replaced by `value`."""
    return lambda lease, groups: [
        [Completion(c.tokens, [value] * len(c.tokens), c.finish_reason) for c in g] for g in groups
    ]


def frame(body: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(len(body), flags) + body


class Adversary:
    """Runs the attacks against the learner at `learner_addr`."""

    def __init__(self, learner_addr: str, secret: bytes | None = None, tries: int = 12) -> None:
        self.addr = learner_addr
        self.learner = learner_addr.rsplit("/p2p/", 1)[-1]
        self.secret = secret
        self.tries = tries
        self.hosts: list[Host] = []
        self.observer = self.fresh()
        self.spec = SpecReply.from_wire(self.observer.request(self.learner, SPEC, SpecRequest().to_wire())).spec
        self.engine: TransformersEngine | None = None
        self.version = -1

    # -- helpers --------------------------------------------------------------------------------------

    def fresh(self) -> Host:
        """A new identity connected to the learner (authenticated when the swarm has a secret)."""
        host = Host().start()
        self.hosts.append(host)
        host.connect(self.addr)
        if self.secret is not None:
            authenticate(host, self.addr, self.secret)
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.stop()

    def status(self) -> dict:
        return self.read_status(self.observer, self.addr)

    @staticmethod
    def read_status(host: Host, learner_addr: str) -> dict:
        """The learner's open status document, read by `host` (connected to it)."""
        return host.request(learner_addr.rsplit("/p2p/", 1)[-1], STATUS, {}, timeout=30)

    def sync(self) -> None:
        """Hold the newest published weights in a transformers engine (an honest worker's sampler)."""
        self.engine = self.engine or TransformersEngine(threads=2)
        self.version, weights = newest_weights(self)
        self.engine.load_policy(self.spec, weights)

    def lease(self, host: Host) -> dict:
        """A lease for the version we hold (syncing again while the learner says we are too stale)."""
        for _ in range(100):
            reply = host.request(self.learner, LEASE, {"version": self.version, "max_groups": 1})
            if "lease" in reply:
                return reply["lease"]
            if reply.get("newest", self.version) != self.version:
                self.sync()
            time.sleep(0.2)
        raise AssertionError(f"the learner gave no lease: {reply}")

    def sample(self, lease: dict, seed_offset: int = 0) -> list[list[Completion]]:
        """The lease's completions as an honest worker samples them (seed_offset != 0: another seed's)."""
        p = lease["params"]
        params = SamplingParams(p["temperature"], p["top_p"], p["max_new_tokens"], p["seed"] + seed_offset)
        requests = [GenerationRequest(g["prompt_ids"], lease["group_size"], g["group"]) for g in lease["groups"]]
        return self.engine.generate(requests, params)

    def exact_logprobs(self, lease: dict, prompt: list[int], tokens: list[int]) -> list[float]:
        """log mu of any tokens under the weights we hold, as the learner's verifier computes it."""
        p = lease["params"]
        with torch.no_grad():
            lps, _ = replay_sampling(
                self.engine.model, [Rollout(prompt, tokens, [], 0.0)], p["temperature"], p["top_p"]
            )
        return lps[0].tolist()

    def submit(self, host: Host, lease: dict, groups: list[list[Completion]], **override) -> dict:
        wire = RolloutSubmission(
            lease["id"],
            self.version,
            [GroupSubmission(g["group"], cs) for g, cs in zip(lease["groups"], groups, strict=True)],
        ).to_wire()
        return host.request(self.learner, ROLLOUT, wire | override, timeout=60)

    @staticmethod
    def penalties_added(before: dict, after: dict) -> dict[str, int]:
        b, a = before.get("penalties", {}), after.get("penalties", {})
        return {k: a[k] - b.get(k, 0) for k in a if a[k] != b.get(k, 0)}

    # -- the attacks ----------------------------------------------------------------------------------

    def attacks(self) -> list[tuple[str, str, Callable[[], tuple[str, bool, dict]]]]:
        """(name, expected outcome, attack) for every attack; an attack returns (observed, ok, details)."""
        return [
            (
                "garbage frame",
                "stream reset, 'bad frame' penalty",
                lambda: self._raw(b"\x00\x00\x00\x10\x00" + os.urandom(16)),
            ),
            (
                "header claiming 100 MB",
                "stream reset unread, 'bad frame' penalty",
                lambda: self._raw(struct.pack(">IB", 100_000_000, 0)),
            ),
            (
                "zstd bomb: 50 MB of zeros in a few kB",
                "cut while decompressing, 'bad frame' penalty",
                lambda: self._raw(frame(zstandard.ZstdCompressor().compress(b"\0" * 50_000_000), 1)),
            ),
            (
                "decode-cost bomb on /echo/status/1: 60,000 empty arrays in 1 kB of zstd",
                "cut while decoding, 'bad frame' penalty; other peers' status stays answered",
                self._decode_bomb,
            ),
            (
                "nesting 3,000 deep",
                "refused while decoding, 'bad frame' penalty",
                lambda: self._raw(frame(b"\x81\xa1a" + b"\x91" * 3000 + b"\xc0")),
            ),
            ("a frame that is not a map", "'bad frame' penalty", lambda: self._raw(frame(msgpack.packb(7)))),
            (
                "a worker of the protocol before versioning asks for the spec",
                "refused: 'upgrade echo-rl on the worker', no penalty",
                lambda: self._spec_request({}, "upgrade echo-rl on the worker", penalised=False),
            ),
            (
                "a spec request whose protocol is a list",
                "refused, a penalty",
                lambda: self._spec_request({"protocol": [2]}, "'protocol' must be an integer", penalised=True),
            ),
            ("unknown frame flags", "'bad frame' penalty", lambda: self._raw(struct.pack(">IB", 4, 0x80) + b"abcd")),
            (
                "truncated frame, then our side closed",
                "'abandoned request' penalty (a tenth: an honest sender's timeout does it too)",
                lambda: self._raw(struct.pack(">IB", 100, 0) + b"x" * 10, close=True, reason="abandoned request"),
            ),
            (
                "40 request streams held open",
                "8 over the cap reset at once, the rest after the read timeout; 'slow request' penalties, a ban",
                self._hold_streams,
            ),
            (
                "lease for version 10**18",
                "refused as malformed, penalty; status unbroken",
                lambda: self._request(LEASE, {"version": 10**18, "max_groups": 1}),
            ),
            (
                "lease for version 2**31 - 1 (never published)",
                "refused, penalty; status shows no such version",
                lambda: self._request(LEASE, {"version": 2**31 - 1, "max_groups": 1}),
            ),
            (
                "heartbeat with an absurd version, inf price and 1e300 tokens/s",
                "refused, penalty; status unbroken",
                lambda: self._request(HEARTBEAT, {"version": 2**40, "price": float("inf"), "tokens_per_s": 1e300}),
            ),
            (
                "heartbeat declaring 1e-307 tokens/s (flushed to 0 by the learner's arithmetic)",
                "refused as malformed, penalty; no exception in the learner",
                lambda: self._request(HEARTBEAT, {"version": 0, "tokens_per_s": 1e-307}),
            ),
            (
                "heartbeat declaring NaN tokens/s and a denormal price",
                "refused as malformed, penalty",
                lambda: self._request(HEARTBEAT, {"version": 0, "tokens_per_s": float("nan"), "price": 5e-324}),
            ),
            (
                "hoarding: an identity asks for a lease again and again and returns none",
                "it holds one lease at a time, which the next batch does not count on",
                self._hoard,
            ),
            (
                "heartbeat with a 1 MB hardware string",
                "cut by the frame limit, 'bad frame' penalty",
                lambda: self._request(
                    HEARTBEAT, {"version": 0, "hardware": {"engine": "x" * 1_000_000}}, frame_error=True
                ),
            ),
            (
                "join with addresses that are not multiaddrs",
                "refused, penalty",
                lambda: self._request(JOIN, {"addrs": ["not an address"] * 3}),
            ),
            (
                "join announcing an address without /p2p/ (it made every later joiner exit)",
                "refused, penalty",
                lambda: self._request(JOIN, {"addrs": [self.fresh().addrs[0].split("/p2p/")[0]]}),
            ),
            (
                "join announcing 8 well-formed addresses nobody answers on",
                "accepted but never handed to a later joiner (the learner's dial-back fails)",
                self._unreachable_join,
            ),
            (
                "rollout of the wrong types",
                "refused as malformed, penalty",
                lambda: self._request(ROLLOUT, {"lease": "x", "version": 0, "groups": 1}),
            ),
            (
                "rollout with a logprob of -1000",
                "refused at intake (floor -50), penalty",
                lambda: self._forged(
                    logprobs_set_to(-1000.0),
                    "floats in",
                ),
            ),
            (
                "rollout with a NaN logprob",
                "refused at intake, penalty",
                lambda: self._forged(
                    logprobs_set_to(float("nan")),
                    "floats in",
                ),
            ),
            (
                "rollout with token ids outside the vocabulary",
                "refused at intake, penalty",
                lambda: self._forged(
                    lambda lease, groups: [
                        [Completion([10**9] * len(c.tokens), c.logprobs, c.finish_reason) for c in g] for g in groups
                    ],  # fmt: skip
                    "token ids",
                ),
            ),
            ("rollout for someone else's lease", "refused, penalty", self._theft),
            (
                "replay of an accepted submission",
                "the same again: the same answer; altered: refused as a duplicate, penalty; counts unchanged",
                self._replay,
            ),
            (
                "honest tokens, forged logprobs (-0.01 each)",
                "flagged when verified, its groups dropped",
                lambda: self._until_flagged(logprobs_set_to(-0.01)),
            ),
            (
                "honest tokens, logprobs at the floor (-49.9)",
                "flagged when verified; an unverified one trains with a clamped ratio",
                lambda: self._until_flagged(logprobs_set_to(-49.9)),
            ),
            (
                "unsampled random text with exact logprobs",
                "flagged when verified (draws miss their intervals)",
                lambda: self._until_flagged(self._unsampled),
            ),
            (
                "text sampled with another seed, exact logprobs",
                "flagged when verified (draws miss their intervals)",
                lambda: self._until_flagged(lambda lease, groups: self.sample(lease, seed_offset=1)),
            ),
            (
                "text steered within the draw tolerance, exact logprobs",
                "flagged when verified (too many tokens off their draws)",
                lambda: self._until_flagged(self.steered),
            ),
        ]

    def run(self, report: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
        self.sync()
        outcomes = []
        for name, expected, attack in self.attacks():
            before = self.status()
            try:
                observed, ok, details = attack()
            except Exception as exc:  # noqa: BLE001 - an attack that could not be carried out is a failure
                observed, ok, details = f"attack failed: {type(exc).__name__}: {exc}", False, {}
            after = self.status()  # the learner must still answer its status, whatever was sent
            details["penalties"] = self.penalties_added(before, after)
            outcome = Outcome(name, expected, observed, ok, details)
            outcomes.append(outcome)
            report(outcome)
        return outcomes

    def _spec_request(self, msg: dict, expected: str, penalised: bool) -> tuple[str, bool, dict]:
        host = self.fresh()
        before = sum(self.status()["penalties"].values())
        try:
            host.request(self.learner, SPEC, msg)
            answer = "answered"
        except RemoteError as exc:
            answer = str(exc)
        added = sum(self.status()["penalties"].values()) - before
        return f"{answer[:120]!r}, {added} penalties", expected in answer and (added > 0) == penalised, {}

    def _raw(self, data: bytes, close: bool = False, reason: str = "bad frame") -> tuple[str, bool, dict]:
        host = self.fresh()
        before = self.status()["penalties"].get(reason, 0)
        answer = send_raw(host, self.learner, ROLLOUT, data, close=close)
        added = self.status()["penalties"].get(reason, 0) - before
        return f"stream {answer}, {added} {reason!r} penalty", answer == "reset" and added >= 1, {}

    def _decode_bomb(self) -> tuple[str, bool, dict]:
        bomb = frame(zstandard.ZstdCompressor(level=19).compress(msgpack.packb({"x": [[]] * 60_000})), 1)
        hosts = [self.fresh() for _ in range(4)]
        answers: list[str] = []
        threads = [
            threading.Thread(
                target=lambda h=h: answers.extend(send_raw(h, self.learner, STATUS, bomb) for _ in range(8))
            )
            for h in hosts
        ]
        for t in threads:
            t.start()
        latencies = []
        while any(t.is_alive() for t in threads) and len(latencies) < 50:
            tick = time.perf_counter()
            self.status()
            latencies.append(time.perf_counter() - tick)
        for t in threads:
            t.join()
        details = {
            "bomb_bytes": len(bomb),
            "status_latency_max_s": round(max(latencies, default=0.0), 3),
            "status_latency_median_s": round(sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
        }
        ok = bool(answers) and all(a == "reset" for a in answers)
        return f"{len(answers)} bombs of {len(bomb)} B reset; status answered meanwhile {details}", ok, details

    def _hold_streams(self) -> tuple[str, bool, dict]:
        host = self.fresh()
        ends = hold_streams(host, self.learner, LEASE, 40, timeout=60)
        banned = host.peer_id in self.status()["banned"]
        return f"{ends.count('reset')} of 40 reset, banned: {banned}", ends == ["reset"] * 40 and banned, {}

    def _request(self, protocol: str, message: dict, frame_error: bool = False) -> tuple[str, bool, dict]:
        host = self.fresh()
        try:
            reply = host.request(self.learner, protocol, message, timeout=15)
            return f"answered {str(reply)[:80]}", False, {}
        except RemoteError as exc:
            refused = f"refused: {str(exc)[:100]}"
        except PeerUnavailable as exc:
            refused = f"stream reset ({str(exc)[:60]})"
            if not frame_error:
                return refused, False, {}
        status = self.status()  # unbroken, and no peer shows a version beyond the newest published
        shown = [p["version"] for p in status["peers"]]
        sane = all(v <= status["version_published"] for v in shown)
        return f"{refused}; status shows versions {sorted(set(shown))}", sane, {}

    def _unreachable_join(self) -> tuple[str, bool, dict]:
        host, later = self.fresh(), self.fresh()
        closed = []
        for _ in range(8):  # loopback ports nothing listens on: each dial-back is refused
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                closed.append(s.getsockname()[1])
        addrs = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{host.peer_id}" for port in closed]
        host.request(self.learner, JOIN, {"addrs": addrs}, timeout=15)
        listed = later.request(self.learner, JOIN, {"addrs": later.addrs}, timeout=15).get("peers", {})
        return f"handed to a later joiner: {host.peer_id in listed}", host.peer_id not in listed, {}

    def _forged(self, forge: Callable, refusal: str) -> tuple[str, bool, dict]:
        host = self.fresh()
        lease = self.lease(host)
        try:
            reply = self.submit(host, lease, forge(lease, self.sample(lease)))
            return f"accepted: {reply}", False, {}
        except RemoteError as exc:
            return f"refused: {str(exc)[:100]}", refusal in str(exc), {}

    def _theft(self) -> tuple[str, bool, dict]:
        owner, thief = self.fresh(), self.fresh()
        lease = self.lease(owner)
        groups = self.sample(lease)
        try:
            self.submit(thief, lease, groups)
            return "the thief's submission was accepted", False, {}
        except RemoteError as exc:
            refused = str(exc)
        accepted = self.submit(owner, lease, groups).get("accepted")
        return (
            f"thief refused ({refused[:60]}); owner's accepted: {accepted}",
            "another worker" in refused and accepted == 1,
            {},
        )

    def _replay(self) -> tuple[str, bool, dict]:
        """The same submission again is what a worker that lost our reply sends: it gets the same answer and
        nothing is counted twice. Anything else for a lease already closed is a replay: refused, a penalty."""
        host = self.fresh()
        lease = self.lease(host)
        groups = self.sample(lease)
        first = self.submit(host, lease, groups)

        def counts() -> tuple[int, int]:
            row = {p["peer_id"]: p for p in self.status()["peers"]}.get(host.peer_id, {})
            return row.get("verified", 0), row.get("groups_accepted", 0)

        before = counts()
        again = [self.submit(host, lease, groups) for _ in range(3)]
        altered = [[dataclasses.replace(c, logprobs=[lp - 0.01 for lp in c.logprobs]) for c in g] for g in groups]
        try:
            self.submit(host, lease, altered)
            refused = ""
        except RemoteError as exc:
            refused = str(exc)
        after = counts()
        ok = all(a == first for a in again) and "duplicate" in refused and after == before
        seen = f"3 resends answered {first}, an altered one refused ({refused[:40]}); counts {before} -> {after}"
        return seen, ok, {}

    def _unsampled(self, lease: dict, groups: list[list[Completion]]) -> list[list[Completion]]:
        rng = random.Random(lease["id"])
        out = []
        for g, honest in zip(lease["groups"], groups, strict=True):
            forged = []
            for c in honest:
                tokens = [rng.randrange(3, min(self.spec.vocab_size, 1000)) for _ in range(len(c.tokens))]
                forged.append(Completion(tokens, self.exact_logprobs(lease, g["prompt_ids"], tokens), "length"))
            out.append(forged)
        return out

    def steered(self, lease: dict, groups: list[list[Completion]]) -> list[list[Completion]]:
        """Every completion rewritten token by token: the least likely token within the learner's draw
        tolerance of each draw (echo_cli.bench_verify.steered_completion), with exact logprobs."""
        p = lease["params"]
        band = 0.9 * self.status()["verification"]["draw_tolerance"]
        out = []
        for g, honest in zip(lease["groups"], groups, strict=True):
            forged = []
            for j, c in enumerate(honest):
                tokens = steered_completion(
                    self.engine.model, g["prompt_ids"], len(c.tokens), p["seed"], g["group"], j, p["temperature"],
                    p["top_p"], band, set(self.spec.eos_ids),
                )  # fmt: skip
                forged.append(Completion(tokens, self.exact_logprobs(lease, g["prompt_ids"], tokens), "length"))
            out.append(forged)
        return out

    def shifted(self, lease: dict, groups: list[list[Completion]]) -> list[list[Completion]]:
        """Honest tokens, every exact logprob lowered by 0.1 nats (a forger nudging the importance ratio)."""
        return [[Completion(c.tokens, [max(lp - 0.1, -49.0) for lp in c.logprobs], c.finish_reason) for c in g]
                for g in groups]  # fmt: skip

    def plausible(self, lease: dict, groups: list[list[Completion]]) -> list[list[Completion]]:
        """Random tokens with plausible logprobs (the honest completion's, token for token)."""
        rng = random.Random(lease["id"])
        return [
            [Completion([rng.randrange(3, self.spec.vocab_size) for _ in c.tokens], c.logprobs, "length") for c in g]
            for g in groups
        ]

    def _hoard(self) -> tuple[str, bool, dict]:
        host = self.fresh()
        leases = [self.lease(host) for _ in range(5)]
        mine = next((p for p in self.status()["peers"] if p["peer_id"] == host.peer_id), {})
        declined = self.status()["leases"]["declined"]
        refused = []
        try:  # the given-up leases are someone else's now
            self.submit(host, leases[0], self.sample(leases[0]))
        except RemoteError as exc:
            refused.append(str(exc))
        ok = mine.get("open_leases") == 1 and mine.get("reliable") is False and bool(refused)
        return (
            f"5 leases taken: {mine.get('open_leases')} held; the first one refused: {refused[:1]}",
            ok,
            {"declined": declined},
        )

    def sybil(self, forges: list[Callable], groups: int, concurrency: int = 4) -> list[str]:
        """Forged groups, each from a fresh identity (one lease of one group each; forgery k % len(forges) for the
        k-th), `concurrency` identities at once, keeping up with the learner's versions: what the learner
        answered each ("accepted: ..." or its refusal)."""
        lock = threading.Lock()

        def one(k: int) -> str:
            host = Host().start()
            try:
                host.connect(self.addr)
                if self.secret is not None:
                    authenticate(host, self.addr, self.secret)
                with lock:  # one engine: sync, lease and sample under the lock, submit concurrently
                    if self.status()["version_published"] > self.version:
                        self.sync()
                    lease = self.lease(host)
                    groups = forges[k % len(forges)](lease, self.sample(lease))
                try:
                    return f"accepted: {self.submit(host, lease, groups)}"
                except RemoteError as exc:
                    return str(exc)
            finally:
                host.stop()

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, range(groups)))

    def _until_flagged(self, forge: Callable) -> tuple[str, bool, dict]:
        """Submit forgeries from one identity until the learner flags it (at most `tries` leases)."""
        host = self.fresh()
        for attempt in range(1, self.tries + 1):
            lease = self.lease(host)
            try:
                self.submit(host, lease, forge(lease, self.sample(lease)))
            except RemoteError as exc:
                flagged = self.status()["verification"]["flagged"].get(host.peer_id)
                return (
                    f"flagged at submission {attempt}: {flagged}",
                    flagged is not None and "flagged" in str(exc),
                    {"submissions": attempt},
                )
        return f"not flagged after {self.tries} submissions (none selected for checking?)", False, {}


def newest_weights(adversary: Adversary) -> tuple[int, dict[str, np.ndarray]]:
    """The newest published version, fetched and checked as a worker does: (version, float32 weights)."""
    peer = BroadcastPeer(adversary.fresh(), ChunkStore(memory_budget=1 << 30), adversary.addr, use_peers=False)
    manifest, raw = peer.sync(None, timeout=300)
    return manifest.version, float_tensors(manifest, raw)


def weights_finite(adversary: Adversary) -> tuple[int, bool]:
    """Whether every weight of the newest published version is finite: (version, finite)."""
    version, weights = newest_weights(adversary)
    return version, all(np.isfinite(a).all() for a in weights.values())


def hoard_leases(host: Host, learner_addr: str, stop: threading.Event, taken: list[int], every_s: float = 0.1) -> None:
    """Ask for leases (16 groups at a time) every `every_s` seconds and return none, until `stop` is set (at most
    3,000 requests): ids of the leases granted go to `taken`."""
    host.connect(learner_addr)
    learner = learner_addr.rsplit("/p2p/", 1)[-1]
    for _ in range(3000):
        if stop.is_set():
            return
        try:
            reply = host.request(learner, LEASE, {"version": 0, "max_groups": 16}, timeout=10)
            if "lease" in reply:
                taken.append(reply["lease"]["id"])
        except (RemoteError, PeerUnavailable):
            pass
        stop.wait(every_s)
