"""A discrete-event simulation of a swarm: the learner, the broadcast and heterogeneous workers.

It drives the real learner's Scheduler (learner/plan/scheduler.py), capacity model and lease admission
rule (learner/plan/admission.py) with simulated time, so what it predicts is what those decisions do.
Long because one event loop reads best whole: each event kind is one method of Simulation.

What is simulated, per event:

    learner    takes a batch of P groups within the staleness bound (oldest first, stale ones dropped;
               with dynamic sampling, signal_share < 1, only groups with signal count and it leases
               P / share groups per batch),
               trains for T_train (with jitter), publishes every kappa steps; after each step the
               scheduler gets the same observations as in a real run and re-plans
    broadcast  a version of M bytes reaches worker i encode_s + rtt_i + 1.2 * T_min + load_s after the
               step, T_min = max(M / u_s, M / d_i, N M / (u_s + sum_j u_j)) over the N connected
               workers (peer-assisted broadcast measured 1.20 x T_min in docs/benchmarks.md); as the
               real daemon does, a worker fetches (and stages) a new version while it generates and
               installs it between leases, one staged version at a time (overlap = false: it stops
               generating until it holds the newest version, the sequential worker)
    workers    lease up to the room the learner leaves (prefetch_batches batches), generate
               n * G / mu_i seconds (with jitter) plus a round trip, push; preemption at a per-worker
               Poisson rate, back after down_s (then a full snapshot to fetch); billed while active
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from learner.plan.admission import Admission, LeaseAdmission, within_staleness
from learner.plan.scheduler import Scheduler, SchedulerConfig
from p2p.config import ConfigError

BROADCAST_EFFICIENCY = 1.2  # measured: peer-assisted broadcast finished in 1.20 x T_min


@dataclass
class LearnerProfile:
    """The simulated learner; every default is the local SmolLM2 swarm of docs/benchmarks.md."""

    prompts_per_step: int = 4
    group_size: int = 8
    train_step_s: float = 13.0
    train_jitter: float = 0.3  # relative: each step takes T * uniform(1 - j, 1 + j)
    publish_every: int = 1
    staleness: int = 2
    prefetch_batches: int = 1
    groups_per_lease: int = 1
    version_mb: float = 26.0  # a version on the wire (deltas, mostly)
    full_mb: float = 191.0  # a full snapshot: what a worker that joins or returns fetches first
    encode_s: float = 1.0
    uplink_mbps: float = 1000.0
    margin: float = 0.1
    expected_step_s: float = 30.0  # the user's guess of T_train: workers are planned on it until T is measured
    wait_for_newer: bool = True  # admission's "newer" rule (false: leases always go out with the version held)
    signal_share: float = 1.0  # dynamic sampling when < 1: the share of groups whose rewards differ; the others
    # are set aside, and the learner leases P / share groups per batch (at most sampling_rounds batches' worth)
    sampling_rounds: int = 4


@dataclass
class WorkerClass:
    """One kind of worker; `share` of the simulated workers are of this kind."""

    name: str = "worker"
    share: float = 1.0
    rollouts_per_s: float = 6.0  # mu while generating
    jitter: float = 0.2
    price_per_hour: float = 0.0
    rtt_s: float = 0.05
    uplink_mbps: float = 100.0
    downlink_mbps: float = 1000.0
    load_s: float = 2.0  # turn a version into engine weights (GGUF write + load)
    preempt_per_hour: float = 0.0
    down_s: float = 600.0
    overlap: bool = True  # fetch the next version while generating (false: the sequential worker)


@dataclass
class SimWorker:
    name: str
    kind: WorkerClass
    connected: bool = True
    busy_until: float = 0.0
    held: int = -1  # the version its engine runs
    fetching: int = -1  # the version being fetched (-1: none)
    staged: int = -1  # fetched and staged, installed between leases (-1: none)
    lease: int | None = None
    generation: int = 0  # bumps on preemption, so events of a previous life are ignored
    billed: float = 0.0


@dataclass
class SimResult:
    steps: int
    workers: int
    sim_seconds: float
    utilisation: float
    cost: float
    cost_per_step: float
    cost_per_1k_rollouts: float
    staleness: dict[str, int]
    stale_dropped_groups: int
    leases_expired: int
    preemptions: int
    decisions: int
    active_workers_mean: float
    bcast_s_mean: float
    bcast_s_p95: float


def check_profile(learner: LearnerProfile, classes: list[WorkerClass]) -> None:
    """Every figure of a profile finite and >= 0, at least one worker class with a positive share."""
    for where, profile in [("learner", learner)] + [(f"workers[{k}]", c) for k, c in enumerate(classes, 1)]:
        for f in fields(profile):
            value = getattr(profile, f.name)
            if isinstance(value, int | float) and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{where}.{f.name} must be a finite number >= 0, got {value}")
    if not classes or sum(c.share for c in classes) <= 0:
        raise ConfigError("a profile needs [[workers]] tables whose shares add up to more than 0")


class Simulation:
    def __init__(
        self, learner: LearnerProfile, classes: list[WorkerClass], n_workers: int, seed: int, autoscale: bool = True
    ) -> None:
        self.p = learner
        self.rng = random.Random(seed)
        self.autoscale = autoscale
        self.scheduler = Scheduler(
            SchedulerConfig(
                rollouts_per_step=learner.prompts_per_step * learner.group_size,
                publish_every=learner.publish_every,
                staleness=learner.staleness,
                margin=learner.margin,
                max_groups_per_lease=learner.groups_per_lease,
                expected_step_s=learner.expected_step_s,
            )
        )
        self.admission = LeaseAdmission(
            self.scheduler, "async", learner.staleness, learner.prefetch_batches, autoscale, learner.wait_for_newer
        )
        total = sum(c.share for c in classes)
        counts = [round(n_workers * c.share / total) for c in classes]
        counts[-1] = n_workers - sum(counts[:-1])
        self.workers: dict[str, SimWorker] = {}
        for c, count in zip(classes, counts, strict=True):
            for k in range(count):
                name = f"{c.name}-{k:04d}"
                self.workers[name] = SimWorker(name, c)
        self.events: list[tuple[float, int, str, tuple]] = []
        self._seq = 0
        self.now = 0.0
        self.version = 0
        self.buffer: list[tuple[int, str]] = []  # (version, worker) per group
        self.leases: dict[int, tuple[str, int, int, float]] = {}  # id -> (worker, groups, version, issued at)
        self.next_lease = 0
        self.outstanding = 0  # groups in live leases
        self.training = False
        self.step = 0
        self.train_seconds = 0.0
        self.last_bill = 0.0
        self.cost = 0.0
        self.staleness: Counter[int] = Counter()
        self.stale_dropped = 0
        self.expired = 0
        self.preemptions = 0
        self.bcast: list[float] = []
        self.active_samples: list[int] = []
        self.last_step_end = 0.0
        self.step_started = 0.0  # when the step under way began (read while training)
        self.made_at = {0: 0.0}  # version -> when the step that made it ended
        self.signal_ema = 1.0  # the learner's running estimate of the share of groups with signal
        self.idle: list[str] = []  # workers asking for a lease (may hold stale entries: checked on use)
        self.out: list[tuple[float, int]] = []  # (time it leaves the learner, version), in order
        self.newest_out = -1
        self.published_at: dict[int, float] = {}  # version -> when it left the learner
        self.n_connected = len(self.workers)
        self.up_connected = sum(w.kind.uplink_mbps for w in self.workers.values())

    # -- event queue ----------------------------------------------------------------------------------

    def at(self, t: float, kind: str, *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, args))

    def run(self, steps: int) -> SimResult:
        self.steps = steps
        self.out.append((self.p.encode_s, 0))  # the initial weights, a full snapshot
        self.at(self.p.encode_s, "published")
        for w in self.workers.values():
            self._join(w)
            self._schedule_preemption(w)
        if self.autoscale:
            self.scheduler.replan()  # on the declared rates and the expected step time
        while self.events and self.step < steps:
            self.now, _, kind, args = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(*args)
        self._bill()
        return self._result()

    # -- learner --------------------------------------------------------------------------------------

    def _try_train(self) -> None:
        if self.training or self.step >= self.steps:  # after the last step no batch is taken (nor counted)
            return
        fresh = [g for g in self.buffer if within_staleness(self.version, g[0], self.p.staleness)]
        self.stale_dropped += len(self.buffer) - len(fresh)
        self.buffer = sorted(fresh)
        p = self.p.prompts_per_step
        if len(self.buffer) < p:
            return
        batch, self.buffer = self.buffer[:p], self.buffer[p:]
        self.staleness.update(self.version - x for x, _ in batch)
        self.training, self.step_started = True, self.now
        seconds = self.p.train_step_s * self.rng.uniform(1 - self.p.train_jitter, 1 + self.p.train_jitter)
        self.at(self.now + seconds, "trained", seconds)
        self._dispatch()

    def _on_trained(self, seconds: float) -> None:
        self.training = False
        self.train_seconds += seconds
        self.step += 1
        self.version += 1
        self.made_at[self.version] = self.now
        period = self.now - self.last_step_end
        self.last_step_end = self.now
        self._bill()
        if self.version % self.p.publish_every == 0:
            self.out.append((self.now + self.p.encode_s, self.version))
            self.at(self.now + self.p.encode_s, "published")
            first = min((self._fetch_s(w, self.p.version_mb) for w in self.workers.values() if w.connected), default=0)
            self.bcast.append(self.p.encode_s + first)
            self.scheduler.broadcast_done(self.p.encode_s + first)
        self.scheduler.cfg.rollouts_per_step = self._batch_groups() * self.p.group_size  # as the learner does
        self.scheduler.step_done(self.step, seconds, period, trained=True)
        for w in self.workers.values():
            if w.connected:  # connected workers heartbeat
                self.scheduler.seen(w.name, self.now)
        for name in self.scheduler.drop_silent(self.now):
            for lease_id in [i for i, lease in self.leases.items() if lease[0] == name]:
                self._expire(lease_id)
        if self.autoscale:
            self.scheduler.replan()
        self.active_samples.append(sum(self._billable(w) for w in self.workers.values()))
        self.idle = [w.name for w in self.workers.values() if self._can_lease(w)]  # (re)activated ones too
        self._try_train()
        self._dispatch()

    def _on_published(self) -> None:
        """A version left the learner: workers start fetching it (busy ones too: the fetch overlaps)."""
        self.newest_out = max(v for t, v in self.out if t <= self.now)
        self.published_at.setdefault(self.newest_out, self.now)
        for w in self.workers.values():
            if w.connected:
                self._fetch_next(w)

    def _room(self) -> int:
        return self.p.prefetch_batches * self._batch_groups() - len(self.buffer) - self.outstanding

    def _batch_groups(self) -> int:
        """Groups leased for one batch: P, or with dynamic sampling P / signal share as the learner does."""
        if self.p.signal_share >= 1:
            return self.p.prompts_per_step
        return math.ceil(self.p.prompts_per_step / max(self.signal_ema, 1 / self.p.sampling_rounds))

    def _admit(self, w: SimWorker) -> Admission:
        """The learner's rule (learner.plan.admission) on worker w's request for a lease."""
        age_s = self.now - self.published_at.get(w.held, self.now)
        return self.admission.admit(
            w.name, w.held, self.p.groups_per_lease, self.now, version=self.version, age_s=age_s,
            batch_groups=self._batch_groups(), buffered=len(self.buffer), leased=self.outstanding,
            newer_age_s=self.now - self.made_at[self.version] if self.version > w.held else None,
            step_age_s=self.now - self.step_started if self.training else None,
        )  # fmt: skip

    def _dispatch(self) -> None:
        """Hand leases to idle workers, in random order, while the learner has room."""
        while self.idle and self._room() > 0:
            k = self.rng.randrange(len(self.idle))
            self.idle[k], self.idle[-1] = self.idle[-1], self.idle[k]
            w = self.workers[self.idle.pop()]
            admitted = self._admit(w) if self._ready(w) else Admission()
            if not admitted.groups:
                continue
            n = admitted.groups
            self.next_lease += 1
            lease_id = self.next_lease
            self.leases[lease_id] = (w.name, n, w.held, self.now)
            self.outstanding += n
            w.lease = lease_id
            k = w.kind
            gen = n * self.p.group_size / k.rollouts_per_s * self.rng.uniform(1 - k.jitter, 1 + k.jitter)
            w.busy_until = self.now + k.rtt_s + gen
            self.at(w.busy_until, "delivered", w.name, w.generation, lease_id)
            self.at(admitted.expires_at, "deadline", lease_id)

    def _ready(self, w: SimWorker) -> bool:
        """Idle with a version to generate with (the sequential worker: with the newest published one)."""
        idle = w.connected and w.lease is None and w.busy_until <= self.now
        return idle and w.held >= (0 if w.kind.overlap else max(self.newest_out, 0))

    def _can_lease(self, w: SimWorker) -> bool:
        """Ready and admitted but for the learner's room (it waits among the idle until there is some)."""
        return self._ready(w) and self._admit(w).refused in ("", "full")

    # -- workers --------------------------------------------------------------------------------------

    def _fetch_s(self, w: SimWorker, mb: float) -> float:
        """Seconds for worker w to hold a version of `mb` MB from the moment it is encoded."""
        bits, up = mb * 8e6, self.p.uplink_mbps * 1e6
        swarm = self.n_connected * bits / (up + self.up_connected * 1e6)
        t_min = max(bits / up, bits / (w.kind.downlink_mbps * 1e6), swarm)
        return w.kind.rtt_s + BROADCAST_EFFICIENCY * t_min + w.kind.load_s

    def _fetch_next(self, w: SimWorker) -> None:
        """Start fetching the newest version if it is newer than what w runs or staged and no fetch or
        staged version is pending (the daemon's fetcher keeps one staged version at a time)."""
        newest = self.newest_out
        if w.fetching >= 0 or w.staged >= 0 or newest <= w.held:
            return
        w.fetching = newest
        mb = self.p.full_mb if w.held < 0 else self.p.version_mb
        self.at(self.now + self._fetch_s(w, mb), "fetched", w.name, w.generation, newest)

    def _on_fetched(self, name: str, generation: int, version: int) -> None:
        w = self.workers[name]
        if w.generation != generation or not w.connected:
            return
        w.fetching, w.staged = -1, version
        if w.lease is None:  # idle: installed at once
            self._wake(w)

    def _wake(self, w: SimWorker) -> None:
        """Between leases: install a staged version, start the next fetch, ask for a lease."""
        if w.staged >= 0:
            w.held, w.staged = max(w.held, w.staged), -1
        self._fetch_next(w)
        if self._can_lease(w):
            self.idle.append(w.name)
            self._dispatch()

    def _on_delivered(self, name: str, generation: int, lease_id: int) -> None:
        w = self.workers[name]
        if w.generation != generation:
            return
        w.lease = None
        lease = self.leases.pop(lease_id, None)
        if lease is not None:  # else it expired: the groups went to others, this submission is late
            _, n, version, issued = lease
            self.outstanding -= n
            self.scheduler.lease_done(name, self.now, self.now - issued, n * self.p.group_size)
            for _ in range(n):
                self.scheduler.group_arrived(name, fresh=within_staleness(self.version, version, self.p.staleness))
                signal = self.p.signal_share >= 1 or self.rng.random() < self.p.signal_share
                self.signal_ema += 0.1 * (signal - self.signal_ema)  # as the learner's ReplayBuffer estimates it
                if signal:  # else set aside: it trains nothing
                    self.buffer.append((version, name))
            self._try_train()
        self._wake(w)

    def _on_deadline(self, lease_id: int) -> None:
        if lease_id in self.leases:
            name, _, _, issued = self.leases[lease_id]
            self.scheduler.lease_expired(name, self.now - issued)  # as the learner does
            self._expire(lease_id)

    def _expire(self, lease_id: int) -> None:
        name, n, _, _ = self.leases.pop(lease_id)
        self.outstanding -= n
        self.expired += 1
        if name in self.workers and self.workers[name].lease == lease_id:
            self.workers[name].lease = None
        self._dispatch()

    def _join(self, w: SimWorker) -> None:
        """A worker joins (or returns) declaring its price and its hardware's nominal rate."""
        k = w.kind
        self.scheduler.seen(w.name, self.now, k.price_per_hour)
        lease_s = k.rtt_s + self.p.groups_per_lease * self.p.group_size / k.rollouts_per_s
        self.scheduler.declare(w.name, k.rollouts_per_s, lease_s)

    def _schedule_preemption(self, w: SimWorker) -> None:
        rate = w.kind.preempt_per_hour / 3600
        if rate > 0:
            self.at(self.now + self.rng.expovariate(rate), "preempted", w.name, w.generation)

    def _on_preempted(self, name: str, generation: int) -> None:
        w = self.workers[name]
        if w.generation != generation or not w.connected:
            return
        self._bill()
        self.preemptions += 1
        w.connected, w.lease, w.held, w.busy_until = False, None, -1, 0.0
        w.fetching, w.staged = -1, -1
        w.generation += 1
        self.n_connected -= 1
        self.up_connected -= w.kind.uplink_mbps
        self.at(self.now + w.kind.down_s, "returned", name, w.generation)

    def _on_returned(self, name: str, generation: int) -> None:
        w = self.workers[name]
        if w.generation != generation:
            return
        self._bill()
        w.connected = True
        self.n_connected += 1
        self.up_connected += w.kind.uplink_mbps
        self._join(w)
        self._schedule_preemption(w)
        self._wake(w)

    # -- money ----------------------------------------------------------------------------------------

    def _billable(self, w: SimWorker) -> bool:
        """Connected and allowed to generate: an inactive worker is paused, so it costs nothing."""
        return w.connected and (not self.autoscale or self.scheduler.may_lease(w.name))

    def _bill(self) -> None:
        dt = self.now - self.last_bill
        self.cost += sum(w.kind.price_per_hour for w in self.workers.values() if self._billable(w)) * dt / 3600
        self.last_bill = self.now

    def _result(self) -> SimResult:
        rollouts = self.step * self.p.prompts_per_step * self.p.group_size
        bcast = sorted(self.bcast)
        return SimResult(
            steps=self.step,
            workers=len(self.workers),
            sim_seconds=round(self.now, 1),
            utilisation=round(self.train_seconds / self.now, 4) if self.now else 0.0,
            cost=round(self.cost, 4),
            cost_per_step=round(self.cost / max(self.step, 1), 5),
            cost_per_1k_rollouts=round(1000 * self.cost / max(rollouts, 1), 5),
            staleness={str(k): v for k, v in sorted(self.staleness.items())},
            stale_dropped_groups=self.stale_dropped,
            leases_expired=self.expired,
            preemptions=self.preemptions,
            decisions=len(self.scheduler.decisions),
            active_workers_mean=round(sum(self.active_samples) / max(len(self.active_samples), 1), 1),
            bcast_s_mean=round(sum(bcast) / len(bcast), 2) if bcast else 0.0,
            bcast_s_p95=round(bcast[int(0.95 * (len(bcast) - 1))], 2) if bcast else 0.0,
        )


def simulate(
    learner: LearnerProfile, classes: list[WorkerClass], n_workers: int, steps: int, seed: int, autoscale: bool = True
) -> SimResult:
    return Simulation(learner, classes, n_workers, seed, autoscale).run(steps)
