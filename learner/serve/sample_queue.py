"""The requests `echo-rl serve` waits on swarm workers for: queued, leased, being verified, and the workers'
standing (learner.serve.swarm serves the protocols around it).

    add(job)             a request on a published sampler version, queued
    lease(worker, ...)   the oldest queued request of a version the worker runs or holds the adapters of (it switches
                         to it; its own version's if queued within SWITCH_S of that), and those of equal params,
                         up to LEASE_SEQUENCES of its batches and LEASE_TOKENS tokens, fewer for a slow worker
                         (the first request whole; a worker not yet proven: that request alone), timed for the
                         worker's measured rate (lease_time); one lease per worker, out or being verified
                         (asked again while one is out: the reply was lost, the same lease again, unless the
                         worker no longer holds its version: then its requests queue again)
    take(worker, id)     the worker's answer arrived: its lease is being verified (its version stays working())
    done(lease, ...)     verified: the worker is proven; refused: the worker is banned (and proven no more) and
                         the requests are drawn here; our own failure: drawn here, nobody banned
    sweep()              lapsed leases (past their time, or their worker silent): banned, drawn here; requests
                         no worker leased within WAIT_S: drawn here

A request gets one worker: whatever goes wrong with its lease (a lapse, a refusal, a forgery), it is drawn on
the server next, so that nobody can hold a request through lease after lease. Each request is answered once
(SwarmJob.resolve and draw_here are exclusive). Thread-safe: one lock, never held while calling out.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tinker import types

from learner.serve.sampler import Drawn
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import SamplingParams

WAIT_S = 60.0  # a request no worker has leased this long is drawn here
LEASE_BASE_S = 30.0  # a lease's time: this, and its tokens at the worker's lease_rate() (lease_time)
SLOWEST_TOKENS_S = 20.0  # the rate (a lease's sequences together) leases are timed for, at most
STRETCH = 4.0  # a slow worker's lease gets at most this many times the time it gets at SLOWEST_TOKENS_S
MAX_LEASE_S = 600.0  # what one lease may hold its requests (a request larger than this covers: drawn here)
LEASE_TOKENS = int((MAX_LEASE_S - LEASE_BASE_S) * SLOWEST_TOKENS_S)  # sequences x max_new_tokens of one lease
SILENCE_S = 30.0  # a worker not heard from this long is gone: its lease lapses
ASKED_S = 5.0  # a worker counts as live while it asks for leases this often (or holds one)
LAPSE_BAN_S = 600.0  # a worker whose lease lapsed or was refused gets no lease this long
LEASE_SEQUENCES = 4  # a lease holds at most this many of the worker's batches (several workers share a batch)
SWITCH_S = 2.0  # a worker keeps its version's requests before older ones of another version queued this much earlier


@dataclass(eq=False)
class SwarmJob:
    """One asample request on its way through the swarm; answered once, by a worker or here."""

    req: types.SampleRequest
    prompt: list[int]
    draw: int  # its draw id (learner.serve.draw_ids): the group id of its groups in a lease
    version: int
    params: SamplingParams  # stop ids included, no stop_when (the server cuts stop strings); seed DRAW_SEED
    stop_strings: list[str]
    answer: Callable[[Drawn], None]  # the request's result, verified
    here: Callable[[], None]  # draw it on this machine instead
    queued_at: float = field(default_factory=time.monotonic)
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, drawn: Drawn) -> None:
        if self._claim():
            self.answer(drawn)

    def draw_here(self) -> None:
        if self._claim():
            self.here()

    def _claim(self) -> bool:
        with self._lock:
            done, self._done = self._done, True
            return not done

    def goes_with(self, other: SwarmJob) -> bool:
        """Whether `other` may share this request's lease: the same version, sample count and params."""
        return (self.version, self.req.num_samples, self.params, self.stop_strings) == (
            other.version, other.req.num_samples, other.params, other.stop_strings)  # fmt: skip


@dataclass
class SwarmLease:
    lease_id: int
    worker: str
    version: int
    jobs: list[SwarmJob]
    group_size: int
    groups: list[int]  # per group, the index of its job in `jobs`
    deadline: float  # time.monotonic()
    leased_at: float = field(default_factory=time.monotonic)
    answered_at: float = 0.0  # when its answer arrived (take)

    def keys(self) -> list[tuple[int, int]]:
        """Per group, its draw keys: (its job's draw id, the index of its first completion among the job's)."""
        seen: dict[int, int] = {}
        out = []
        for j in self.groups:
            out.append((self.jobs[j].draw, seen.get(j, 0) * self.group_size))
            seen[j] = seen.get(j, 0) + 1
        return out


@dataclass
class SwarmWorker:
    version: int = -1  # the version it runs, by its word (at most the newest)
    max_batch: int = 1  # by its word: a larger lease only costs it time (it lapses and is banned)
    seen: float = field(default_factory=time.monotonic)  # any message
    asked: float = 0.0  # its last lease request
    delivered: int = 0  # leases it answered: until one, its leases hold one request
    declared_rate: float = 0.0  # tokens/s by its word (its heartbeat; 0: unmeasured)
    tokens: int = 0  # sampled tokens of its verified answers
    busy_s: float = 0.0  # seconds from each of those leases to its answer
    answered: int = 0  # requests it answered, verified
    hardware: dict = field(default_factory=dict)  # by its word (p2p.messages.Heartbeat: bounded strings)


def lease_rate(worker: SwarmWorker) -> float:
    """The tokens a second a worker's leases are timed and sized for: half the rate its verified answers came at
    (sampled tokens, measured here from each lease to its answer), at most SLOWEST_TOKENS_S (a fast worker's
    lease is timed as any other); SLOWEST_TOKENS_S before its first (what it declares is not used: a worker
    could declare itself slow to hold requests longer)."""
    if worker.busy_s <= 0:
        return SLOWEST_TOKENS_S
    return min(SLOWEST_TOKENS_S, worker.tokens / worker.busy_s / 2)


def lease_time(tokens: int, rate: float) -> float:
    """Seconds a lease of `tokens` (sequences x max_new_tokens) is given at `rate` tokens/s: LEASE_BASE_S and the
    tokens at that rate, at most STRETCH times what they get at SLOWEST_TOKENS_S and at most MAX_LEASE_S. A
    worker slowing on purpose thus holds a request at most STRETCH times as long as before, and gets one
    request a lease (its first always goes whole; further ones only within its rate's share of LEASE_TOKENS),
    so it keeps being measured."""
    usual = LEASE_BASE_S + tokens / SLOWEST_TOKENS_S
    return min(LEASE_BASE_S + tokens / max(rate, 1e-3), STRETCH * usual, MAX_LEASE_S)


class SampleBoard:
    """The swarm side's requests and leases (module docstring)."""

    def __init__(self) -> None:
        self.version = 0  # the newest sampler version
        self.queue: list[SwarmJob] = []
        self.leases: dict[int, SwarmLease] = {}  # out with a worker
        self.verifying: dict[int, SwarmLease] = {}  # answered, being replayed
        self.workers: dict[str, SwarmWorker] = {}
        self.banned: dict[str, float] = {}  # peer -> until (outlives the worker's record)
        self.answered = self.drawn_here = 0  # requests answered by workers, and drawn here
        self._lock = threading.Lock()

    def seen(self, peer: str, version: int | None = None, max_batch: object = None, tokens_per_s: float = 0.0,
             hardware: dict | None = None) -> None:  # fmt: skip
        """A message from `peer`; a heartbeat brings its version, batch, rate and hardware (checked by
        p2p.messages.Heartbeat; a version never published is a lie)."""
        with self._lock:
            if version is not None and version > self.version + 1:  # (+1: announced before it is the newest here)
                raise Misbehaviour(f"v{version} was never published (the newest is v{self.version})")
            worker = self.workers.setdefault(peer, SwarmWorker())
            worker.seen = time.monotonic()
            if version is not None:
                worker.version = version
            if type(max_batch) is int:
                worker.max_batch = min(max(max_batch, 1), 256)
            if tokens_per_s > 0:
                worker.declared_rate = tokens_per_s
            if hardware is not None:
                worker.hardware = hardware

    def live(self, flagged: dict[str, str]) -> bool:
        """Whether a worker may draw a request soon: it asks for leases (or holds one, out or being verified: it
        asks again once its answer is taken), runs a version (it fetches the others), and is neither banned nor
        flagged."""
        now = time.monotonic()
        with self._lock:
            holding = {lease.worker for lease in [*self.leases.values(), *self.verifying.values()]}
            return any(
                (now - w.asked <= ASKED_S or peer in holding) and w.version >= 0 and peer not in flagged
                and self.banned.get(peer, 0.0) < now
                for peer, w in self.workers.items()
            )  # fmt: skip

    def working(self) -> set[int]:
        """The versions whose requests are queued, leased or being verified."""
        with self._lock:
            return self._working()

    def _working(self) -> set[int]:  # (the caller holds the lock)
        leased = [*self.leases.values(), *self.verifying.values()]
        return {job.version for job in self.queue} | {lease.version for lease in leased}

    def publish(self, version: int, job: SwarmJob) -> None:
        """`version` is the newest sampler version now, and `job` its first request."""
        with self._lock:
            self.version = version
            self.queue.append(job)

    def add(self, job: SwarmJob) -> None:
        with self._lock:
            self.queue.append(job)

    def lease(self, peer: str, version: int, max_groups: int, held: tuple[int, ...] = ()) -> SwarmLease | None:
        """The lease a worker running `version` (and holding the adapters of `held`) gets now, if any (module
        docstring)."""
        now = time.monotonic()
        with self._lock:
            if max((version, *held)) > self.version + 1:
                raise Misbehaviour(f"v{max((version, *held))} was never published (the newest is v{self.version})")
            worker = self.workers.setdefault(peer, SwarmWorker())
            worker.seen = worker.asked = now
            worker.version = version
            out = next((lease for lease in self.leases.values() if lease.worker == peer), None)
            if out is not None and out.version in (version, *held):  # it asks again: our reply was lost (a worker
                return out  # asks only when it holds none)
            if out is not None:  # lost, and its version since dropped by the worker: the requests queue again
                del self.leases[out.lease_id]
                self.queue = out.jobs + self.queue
            if self.banned.get(peer, 0.0) >= now or any(lease.worker == peer for lease in self.verifying.values()):
                return None
            first = next((job for job in self.queue if job.version in (version, *held)), None)  # the oldest it can
            own = next((job for job in self.queue if job.version == version), None)  # (no switch)
            if first is None:
                return None
            if own is not None and own.queued_at - first.queued_at <= SWITCH_S:
                first = own
            n = first.req.num_samples
            split = -(-n // worker.max_batch)  # groups per request, each of group_size samples (>= n in all)
            group_size = -(-n // split)
            tokens = split * group_size * first.params.max_new_tokens  # what one request costs the lease
            rate = lease_rate(worker)
            budget = LEASE_TOKENS * rate / SLOWEST_TOKENS_S  # what further requests may bring the lease to
            most = LEASE_SEQUENCES * worker.max_batch if worker.delivered else n  # a new worker: one request
            jobs = [first]
            for job in self.queue:
                count = len(jobs) + 1
                if count * n > most or count * split > max_groups or count * tokens > budget:
                    break
                if job is not first and first.goes_with(job):
                    jobs.append(job)
            taken = set(map(id, jobs))
            self.queue = [job for job in self.queue if id(job) not in taken]
            groups = [j for j in range(len(jobs)) for _ in range(split)]
            seconds = lease_time(len(jobs) * tokens, rate)
            lease = SwarmLease(secrets.randbits(62), peer, first.version, jobs, group_size, groups, now + seconds, now)
            self.leases[lease.lease_id] = lease
            return lease

    def take(self, peer: str, lease_id: object) -> SwarmLease:
        """The lease a worker answers, now being verified (no longer timed); BadRequest if it lapsed or is being
        verified, Misbehaviour if the worker holds no lease (a stray frame costs its sender) or another one."""
        with self._lock:
            lease = self.leases.get(lease_id) if isinstance(lease_id, int) else None
            if lease is None:
                if any(x.worker == peer for x in [*self.leases.values(), *self.verifying.values()]):
                    raise BadRequest("no such lease (it is being verified)")
                raise Misbehaviour("no lease of this worker is out (it lapsed, or was answered)")
            if lease.worker != peer:
                raise Misbehaviour("another worker's lease")
            self.verifying[lease.lease_id] = self.leases.pop(lease.lease_id)
            lease.answered_at = time.monotonic()
            return lease

    def done(self, lease: SwarmLease, verified: bool, ban: bool = True, tokens: int = 0) -> None:
        """The lease's answer was verified (its requests answered by the caller; `tokens` sampled in all), or
        not: its requests are drawn here (those not answered yet), and its worker banned unless the failure was
        ours (`ban`)."""
        with self._lock:
            self.verifying.pop(lease.lease_id, None)
            worker = self.workers.get(lease.worker)
            if verified:
                self.answered += len(lease.jobs)
                if worker is not None:
                    worker.delivered += 1
                    worker.answered += len(lease.jobs)
                    worker.tokens += tokens
                    worker.busy_s += max(lease.answered_at - lease.leased_at, 1e-3)
                return
            if ban:
                self.banned[lease.worker] = time.monotonic() + LAPSE_BAN_S
                if worker is not None:
                    worker.delivered = 0  # proven no more: its next lease holds one request
            self.drawn_here += len(lease.jobs)
        for job in lease.jobs:
            job.draw_here()

    def sweep(self) -> list[str]:
        """Lapse leases past their time or of silent workers (banned, their requests drawn here), draw here
        the requests no worker leased within WAIT_S, forget silent workers. The lapsed leases' workers."""
        now = time.monotonic()
        here: list[SwarmJob] = []
        lapsed = []
        with self._lock:
            for lease_id, lease in list(self.leases.items()):
                worker = self.workers.get(lease.worker)
                if now > lease.deadline or worker is None or now - worker.seen > SILENCE_S:
                    del self.leases[lease_id]
                    self.banned[lease.worker] = now + LAPSE_BAN_S
                    if worker is not None:
                        worker.delivered = 0
                    here += lease.jobs
                    lapsed.append(lease.worker)
            keep = []
            for job in self.queue:
                (here if now - job.queued_at > WAIT_S else keep).append(job)
            self.queue = keep
            for peer in [p for p, w in self.workers.items() if now - w.seen > SILENCE_S]:
                del self.workers[peer]
            self.banned = {peer: until for peer, until in self.banned.items() if until > now}
            self.drawn_here += len(here)
        for job in here:
            job.draw_here()
        return lapsed

    def drain(self) -> None:
        """Draw here every request still waiting on the swarm (the server is stopping)."""
        with self._lock:
            here = self.queue + [j for lease in [*self.leases.values(), *self.verifying.values()] for j in lease.jobs]
            self.queue, self.leases, self.verifying = [], {}, {}
        for job in here:
            job.draw_here()

    def peers(self, flagged: dict[str, str]) -> list[dict]:
        """Each worker's row of the status document (docs/status.md, serve's swarm)."""
        now = time.monotonic()
        with self._lock:
            out = {lease.worker: "generating" for lease in self.leases.values()}
            out |= {lease.worker: "verified now" for lease in self.verifying.values()}
            return [
                {"peer_id": peer, "version": w.version, "max_batch": w.max_batch, "lease": out.get(peer),
                 "answered": w.answered, "tokens_per_s": round(w.tokens / w.busy_s, 2) if w.busy_s > 0 else None,
                 "declared_tokens_per_s": w.declared_rate, "lease_rate": round(lease_rate(w), 2),
                 "banned_s": round(max(self.banned.get(peer, 0.0) - now, 0.0), 1), "flagged": flagged.get(peer),
                 "last_seen_s": round(now - w.seen, 1), "hardware": w.hardware}
                for peer, w in self.workers.items()
            ]  # fmt: skip

    def summary(self) -> dict:
        with self._lock:
            return {"version": self.version, "workers": len(self.workers), "queued": len(self.queue),
                    "versions": sorted(self._working()),
                    "leases": len(self.leases) + len(self.verifying), "answered": self.answered,
                    "sampled_here": self.drawn_here}  # fmt: skip
