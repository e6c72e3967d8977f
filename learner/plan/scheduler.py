"""Online scheduling: estimate the capacity model's figures as the run goes, and act on them.

The same class drives the real learner (learner/orchestrate/handlers.py, wall-clock time) and the swarm simulator
(learner/plan/simulator.py, simulated time): every method takes `now` instead of reading a clock.

    estimates   T_train, the step period and T_bcast: moving medians of the last 9 steps (one slow step
                must not switch workers off); per worker mu_i (rollouts/s) and L_i (lease seconds): moving
                averages with a warm-up (the mean of the first samples, then exponential)
    activation  the cheapest cover of the capacity model (learner/plan/capacity.py), with hysteresis:
                - a new worker is planned on the rate it declared, or else is on probation (active) until
                  `warmup` leases have measured it
                - active workers' prices count (1 - incumbent_discount) in the solver, so noise in the
                  estimates does not swap one worker for a similar one
                - a worker is deactivated only if the workers left still cover (1 + 2 margin) D, and no
                  worker changes state twice within `dwell_steps` steps
                - a worker the model finds too slow for the bound supplies nothing fresh in the model, but
                  is switched off only when others cover the demand (if they do not, the learner waits,
                  versions slow down, and the worker becomes fresh enough)
    faults      a worker unseen for `silence_s` is dropped (its leases go to others); one whose last
                groups mostly arrived too stale is deactivated; lease deadlines follow the worker's own
                lease time; a slower worker gets fewer prompt groups per lease
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from learner.plan.capacity import LearnerFigures, WorkerProfile, choose_active, demand, fresh_rate, ineligibility

log = logging.getLogger(__name__)


class MovingAverage:
    """x_hat = mean(x_1..x_n) for the first `warmup` samples, then x_hat <- (1 - alpha) x_hat + alpha x."""

    def __init__(self, alpha: float = 0.2, warmup: int = 3) -> None:
        self.alpha, self.warmup = alpha, warmup
        self.count = 0
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.count += 1
        if self.value is None:
            self.value = x
        elif self.count <= self.warmup:
            self.value += (x - self.value) / self.count
        else:
            self.value += self.alpha * (x - self.value)

    @property
    def warm(self) -> bool:
        return self.count >= self.warmup


class MovingMedian:
    """The median of the last `window` samples: one slow step (a checkpoint, a busy machine) moves it little."""

    def __init__(self, window: int = 9, warmup: int = 3) -> None:
        self.window, self.warmup = window, warmup
        self.samples: list[float] = []
        self.count = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.samples = (self.samples + [x])[-self.window :]

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def low(self) -> float | None:
        """The smallest of the last `window` samples: for decisions that must hold on a quick step too."""
        return min(self.samples) if self.samples else None

    @property
    def warm(self) -> bool:
        return self.count >= self.warmup


@dataclass
class WorkerState:
    name: str
    price: float = 0.0
    active: bool = True  # new workers start on probation: active until measured
    last_seen: float = 0.0
    rollouts_per_s: MovingAverage = field(default_factory=MovingAverage)
    lease_s: MovingAverage = field(default_factory=MovingAverage)
    changed_at: int = -(10**9)  # step of its last activation change
    reason: str = "joined: on probation until measured (or planned on its declared rate)"
    declared: tuple[float, float] | None = None  # (rollouts/s, lease seconds) the worker declared
    recent_fresh: list[bool] = field(default_factory=list)  # arrived within the bound, newest last
    overdue: list[float] = field(default_factory=list)  # seconds of expired leases, counted once it shows up alive


@dataclass
class Decision:
    step: int
    worker: str
    active: bool
    reason: str


@dataclass
class SchedulerConfig:
    rollouts_per_step: int  # R, rollouts generated per step (with dynamic sampling the learner raises it)
    publish_every: int  # kappa
    staleness: int  # S
    margin: float = 0.1
    warmup: int = 3  # leases (and steps) before an estimate is trusted
    dwell_steps: int = 5  # a worker keeps its state at least this many steps
    incumbent_discount: float = 0.1
    silence_s: float = 30.0  # drop a worker not heard from for this long
    stale_window: int = 8  # judge staleness on a worker's last this many groups
    stale_limit: float = 0.5  # deactivate when more than this share of them arrived too stale
    max_groups_per_lease: int = 1
    lease_timeout_s: float = 120.0  # the deadline before a worker is measured, and the longest one
    min_deadline_s: float = 10.0
    expected_step_s: float | None = None  # T_train to plan on before it is measured (None: plan only then)


class Scheduler:
    """Which workers generate, how much each gets, and until when: see the module docstring."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.workers: dict[str, WorkerState] = {}
        self.train_s = MovingMedian(warmup=cfg.warmup)
        self.step_s = MovingMedian(warmup=cfg.warmup)  # wall seconds per step, waiting included
        self.bcast_s = MovingMedian(warmup=cfg.warmup)
        self.step = 0
        self.decisions: list[Decision] = []

    # -- observations ---------------------------------------------------------------------------------

    def seen(self, worker: str, now: float, price: float | None = None) -> WorkerState:
        state = self.workers.get(worker)
        if state is None:
            state = self.workers[worker] = WorkerState(worker)
            self._log(Decision(self.step, worker, True, state.reason))  # joining starts no dwell time
        state.last_seen = now
        if price is not None:
            state.price = price
        for seconds in state.overdue:  # alive after its leases expired: they delivered nothing in that time
            state.lease_s.add(seconds)
            state.rollouts_per_s.add(0.0)
        state.overdue.clear()
        return state

    def declare(self, worker: str, rollouts_per_s: float, lease_s: float) -> None:
        """What a worker says it can do (its hardware's benchmark): planned on until measured."""
        state = self.workers.get(worker)
        if state is not None and rollouts_per_s > 0 and lease_s > 0:
            state.declared = (rollouts_per_s, lease_s)

    def lease_done(self, worker: str, now: float, seconds: float, rollouts: int) -> None:
        state = self.seen(worker, now)
        state.lease_s.add(seconds)
        state.rollouts_per_s.add(rollouts / max(seconds, 1e-6))

    def lease_expired(self, worker: str, seconds: float) -> None:
        """A lease the worker did not return in time (`seconds` after it was issued). If the worker is seen
        alive afterwards, the lease counts as a measurement: that long, nothing delivered. Without it a
        worker that declares a huge rate and never returns a lease would be planned on its declaration for
        ever, and could switch honest workers off. A worker that went silent (preempted, killed) is not
        marked down for it: it is dropped as silent instead."""
        state = self.workers.get(worker)
        if state is not None:
            state.overdue.append(seconds)

    def group_arrived(self, worker: str, fresh: bool) -> None:
        """Whether a group this worker delivered could still be trained on (within S) when it arrived."""
        state = self.workers.get(worker)
        if state is not None:
            state.recent_fresh = (state.recent_fresh + [fresh])[-self.cfg.stale_window :]

    def step_done(self, step: int, train_s: float, step_s: float, trained: bool) -> None:
        self.step = step
        if trained:  # a step whose groups all had equal rewards trains nothing: not a measurement of T
            self.train_s.add(train_s)
            self.step_s.add(step_s)

    def broadcast_done(self, seconds: float) -> None:
        self.bcast_s.add(seconds)

    # -- decisions ------------------------------------------------------------------------------------

    def figures(self) -> LearnerFigures | None:
        """The capacity model's learner-side figures: measured, else the expected step time, else None."""
        c = self.cfg
        if self.train_s.warm:
            train_s = self.train_s.value
        elif c.expected_step_s is not None:
            train_s = c.expected_step_s
        else:
            return None
        return LearnerFigures(
            c.rollouts_per_step,
            train_s,
            c.publish_every,
            c.staleness,
            self.bcast_s.value or 0.0,
            c.margin,
            step_s=self.step_s.value if self.step_s.warm else None,
        )

    def profile(self, state: WorkerState) -> WorkerProfile | None:
        """The worker as the model sees it: measured, else declared, else unknown (on probation)."""
        if state.lease_s.warm:
            return WorkerProfile(state.name, state.rollouts_per_s.value, state.lease_s.value, state.price)
        if state.declared is not None:
            return WorkerProfile(state.name, *state.declared, state.price)
        return None

    def drop_silent(self, now: float) -> list[str]:
        """Forget workers not heard from for silence_s; returns them (their leases must be re-issued)."""
        gone = [w for w, s in self.workers.items() if now - s.last_seen > self.cfg.silence_s]
        for name in gone:
            self._log(Decision(self.step, name, False, f"silent for more than {self.cfg.silence_s:g}s: dropped"))
            del self.workers[name]
        return gone

    def replan(self) -> list[Decision]:
        """Re-solve the provisioning rule with the current estimates; apply it with hysteresis."""
        made = len(self.decisions)
        figs = self.figures()
        if figs is None:
            return []
        c = self.cfg
        measured: dict[str, WorkerProfile] = {}
        for state in self.workers.values():
            profile = self.profile(state)
            if profile is None:
                continue  # on probation: active until measured
            if self._mostly_stale(state):  # evidence beats the model
                if state.active:
                    self._decide(state, False, f"most of its last {len(state.recent_fresh)} groups arrived too stale")
                    state.recent_fresh = []  # judged afresh by the model once its dwell time is over
                continue
            measured[state.name] = profile
        # a worker the model finds ineligible supplies nothing fresh, but is only switched off if others cover
        rates = {n: fresh_rate(p, figs) if ineligibility(p, figs) is None else 0.0 for n, p in measured.items()}
        useful = [n for n in measured if rates[n] > 0]
        prices = {n: measured[n].price_per_hour * (1 - c.incumbent_discount * self.workers[n].active) for n in useful}
        target = choose_active({n: rates[n] for n in useful}, prices, demand(figs))
        settled = {n for n in measured if self.step - self.workers[n].changed_at >= c.dwell_steps}
        for n in sorted(target & settled):
            if not self.workers[n].active:
                self._decide(self.workers[n], True, f"needed: active supply below {1 + c.margin:.2f} x demand")
        keep = (1 + 2 * c.margin) * figs.rollouts_per_step / figs.train_step_s  # what must remain after
        supply = sum(rates[n] for n in measured if self.workers[n].active)
        for n in sorted(settled - target, key=lambda n: (rates[n] > 0, -measured[n].price_per_hour, n)):
            state = self.workers[n]
            if state.active and supply - rates[n] >= keep:
                supply -= rates[n]
                why = ineligibility(measured[n], figs) or f"cheaper workers cover {1 + 2 * c.margin:.2f} x demand"
                self._decide(state, False, f"not needed: {why}")
        return self.decisions[made:]

    def _mostly_stale(self, state: WorkerState) -> bool:
        recent = state.recent_fresh
        return len(recent) >= self.cfg.stale_window and recent.count(False) > self.cfg.stale_limit * len(recent)

    def _decide(self, state: WorkerState, active: bool, reason: str) -> None:
        state.active, state.reason, state.changed_at = active, reason, self.step
        self._log(Decision(self.step, state.name, active, reason))

    def _log(self, decision: Decision) -> None:
        self.decisions.append(decision)
        verb = "activate" if decision.active else "deactivate"
        log.info("step %d: %s %s: %s", decision.step, verb, decision.worker[-8:], decision.reason)

    # -- what a lease looks like ----------------------------------------------------------------------

    def may_lease(self, worker: str) -> bool:
        state = self.workers.get(worker)
        return state is not None and state.active

    def lease_groups(self, worker: str) -> int:
        """Prompt groups for this worker's next lease: fewer for a worker slower than the median."""
        c = self.cfg
        state = self.workers.get(worker)
        rates = sorted(s.rollouts_per_s.value for s in self.workers.values() if s.rollouts_per_s.warm)
        if state is None or not state.rollouts_per_s.warm or not rates:
            return c.max_groups_per_lease
        median = rates[len(rates) // 2]
        share = math.floor(c.max_groups_per_lease * state.rollouts_per_s.value / median)
        return max(1, min(c.max_groups_per_lease, share))

    def returns_in_time(self, worker: str, age_s: float) -> bool:
        """Whether a lease this worker starts now, with a version published age_s seconds ago, comes back
        within the staleness bound: age_s + L_i <= S T (docs/capacity-model.md). True until L_i and the
        step period are measured (no evidence to refuse on) and for S = 0 (the learner waits for it)."""
        state = self.workers.get(worker)
        figs = self.figures()
        if state is None or not state.lease_s.warm or not self.train_s.warm or figs is None or figs.staleness < 1:
            return True
        return age_s + state.lease_s.value <= figs.staleness * figs.period

    def worth_waiting(self, worker: str, newer_age_s: float, step_age_s: float, leases: int) -> bool:
        """Whether this worker, holding an older version while a newer one published newer_age_s ago reaches
        the swarm (held about B after publication), could wait for the newer one and still return `leases`
        leases before the learner needs the next batch (the step under way began step_age_s ago):

            (1 + margin) (max(0, B - newer_age) + leases * L_i) <= T_quick - step_age

        with T_quick the quickest of the recent steps' train times and B, L_i their medians. Then waiting
        costs the learner nothing and makes the rollouts a version fresher (T_quick and the margin cover
        the spread of step and lease times). False until L_i, T_train and B are measured (no evidence to
        make a worker wait on)."""
        state = self.workers.get(worker)
        if state is None or not state.lease_s.warm or not self.train_s.warm or not self.bcast_s.warm:
            return False
        wait_s = max(0.0, self.bcast_s.value - newer_age_s)
        return (1 + self.cfg.margin) * (wait_s + leases * state.lease_s.value) <= self.train_s.low - step_age_s

    def active_workers(self) -> int:
        return sum(s.active for s in self.workers.values())

    def lease_due(self, worker: str) -> float | None:
        """Seconds the next batch counts on a lease of this worker: 2 L_i + 1 once one of its leases came back
        (None before: until its deadline). Past it the learner leases those groups' share to others meanwhile."""
        state = self.workers.get(worker)
        if state is None or state.lease_s.value is None:
            return None
        return 2 * state.lease_s.value + 1.0

    def lease_deadline(self, worker: str) -> float:
        """Seconds this worker gets for a lease: three times its usual lease time, within bounds."""
        c = self.cfg
        state = self.workers.get(worker)
        if state is None or not state.lease_s.warm:
            return c.lease_timeout_s
        return min(c.lease_timeout_s, max(c.min_deadline_s, 3 * state.lease_s.value))
