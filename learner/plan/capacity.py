"""The capacity model: which workers keep the learner busy with fresh enough rollouts, at least cost.

Derivation, assumptions and a worked example: docs/capacity-model.md. Symbols as in docs/design.md §4:
R rollouts per step, T = T_train seconds per step, kappa steps between versions, S the staleness bound,
B = T_bcast seconds from the end of a step until a worker holds the version it published, and per
worker mu_i rollouts/s, L_i seconds per lease, c_i dollars per hour.

    (T here is the step period: T_train, or longer if the learner also waits for rollouts)
    overlapping worker (fetches the next version while it generates; the default daemon):
        window     W = max(kappa * T, B)                 seconds between the versions it installs
        useful     u_i = min(W, max(0, S * T - L_i - B)) seconds of each window whose leases return within S
    sequential worker (stops generating to fetch, --no-overlap):
        window     W = kappa * T
        useful     u_i = max(0, min(kappa * T, S * T - L_i) - B)
    eligible       u_i > 0, i.e. L_i < S * T - B        (otherwise no lease can come back within S)
    fresh supply   f_i = mu_i * u_i / W                  rollouts/s that arrive within the bound
    demand         D = (1 + margin) * R / T
    utilisation    U = min(1, sum_active f_i * T / R)
    activate       the cheapest set of eligible workers with sum f_i >= D (a covering knapsack)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EXACT_UP_TO = 22  # workers: branch and bound below this, greedy with a fix-up pass above


@dataclass(frozen=True)
class WorkerProfile:
    """What the model needs to know about one worker."""

    name: str
    rollouts_per_s: float  # mu_i
    lease_s: float  # L_i
    price_per_hour: float  # c_i
    overlap: bool = True  # fetches versions while it generates (else it stops generating to fetch)


@dataclass(frozen=True)
class LearnerFigures:
    """What the model needs to know about the learner and the swarm as a whole."""

    rollouts_per_step: float  # R
    train_step_s: float  # T
    publish_every: int  # kappa
    staleness: int  # S
    bcast_s: float  # B
    margin: float = 0.1  # provision this much above the demand, for noise in the estimates
    step_s: float | None = None  # seconds between batches if the learner waits too (default: T, it never waits)

    @property
    def period(self) -> float:
        """Seconds per version step: staleness is counted in versions, and versions move at this pace."""
        return max(self.train_step_s, self.step_s or 0.0)


@dataclass
class Plan:
    """Which workers to run, and what the model predicts for that choice."""

    active: list[str]
    inactive: dict[str, str]  # eligible but not needed -> why
    ineligible: dict[str, str]  # name -> the reason it can never deliver within the bound
    fresh_rollouts_per_s: dict[str, float]  # f_i of every eligible worker
    demand: float  # D, rollouts/s
    supply: float  # sum of f_i over the active workers
    utilisation: float
    cost_per_hour: float
    cost_per_step: float  # worker dollars per optimizer step (steps take T / U when the learner waits)
    cost_per_1k_rollouts: float
    notes: list[str] = field(default_factory=list)


def version_window(w: WorkerProfile, f: LearnerFigures) -> float:
    """W: seconds between the versions the worker installs (an overlapping worker that needs longer than
    kappa T to fetch one installs one every B seconds, skipping the versions published meanwhile)."""
    window = f.publish_every * f.period
    return max(window, f.bcast_s) if w.overlap else window


def useful_window(w: WorkerProfile, f: LearnerFigures) -> float:
    """u_i: seconds of each version window in which a lease started with that version returns within S."""
    t = f.period
    if w.overlap:
        return min(version_window(w, f), max(0.0, f.staleness * t - w.lease_s - f.bcast_s))
    return max(0.0, min(f.publish_every * t, f.staleness * t - w.lease_s) - f.bcast_s)


def fresh_rate(w: WorkerProfile, f: LearnerFigures) -> float:
    """f_i: the worker's rollouts per second that arrive within the staleness bound."""
    return w.rollouts_per_s * useful_window(w, f) / version_window(w, f)


def ineligibility(w: WorkerProfile, f: LearnerFigures) -> str | None:
    """Why a worker can never deliver within the bound, or None if it can."""
    if w.rollouts_per_s <= 0:
        return "produces no rollouts"
    limit = f.staleness * f.period - f.bcast_s
    if not w.overlap and f.bcast_s >= f.publish_every * f.period:
        return f"T_bcast {f.bcast_s:.3g}s >= kappa*T_train = {f.publish_every * f.period:.3g}s"
    if w.lease_s >= limit:
        return f"lease {w.lease_s:.3g}s >= S*T_train - T_bcast = {limit:.3g}s (too stale)"
    return None


def demand(f: LearnerFigures) -> float:
    """D: rollouts/s the learner consumes when it never waits, plus the margin."""
    return (1 + f.margin) * f.rollouts_per_step / f.train_step_s


def cheapest_cover(costs: list[float], rates: list[float], need: float) -> list[int]:
    """Indices of the cheapest subset whose rates sum to >= need (all of them if none does).

    Exact by branch and bound for small swarms; greedy by cost per rollout with a fix-up pass for large ones.
    """
    n = len(costs)
    if sum(rates) < need:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (costs[i] / rates[i], -rates[i]))
    if n <= EXACT_UP_TO:
        return _branch_and_bound(order, costs, rates, need)
    chosen: list[int] = []
    total = 0.0
    for i in order:
        if total >= need:
            break
        chosen.append(i)
        total += rates[i]
    # fix-up: drop what is not needed, most expensive first
    for i in sorted(chosen, key=lambda i: -costs[i]):
        if total - rates[i] >= need:
            chosen.remove(i)
            total -= rates[i]
    # fix-up: the last one added may be replaced by a cheaper single worker that still covers
    if chosen:
        last = chosen[-1]
        rest = total - rates[last]
        spare = [i for i in order if i not in chosen and rest + rates[i] >= need and costs[i] < costs[last]]
        if spare:
            chosen[-1] = min(spare, key=lambda i: costs[i])
    return sorted(chosen)


def _branch_and_bound(order: list[int], costs: list[float], rates: list[float], need: float) -> list[int]:
    best_cost, best = math.inf, list(order)
    suffix_rate = [0.0] * (len(order) + 1)  # rate still available from position k on
    for k in range(len(order) - 1, -1, -1):
        suffix_rate[k] = suffix_rate[k + 1] + rates[order[k]]

    def visit(k: int, chosen: list[int], cost: float, rate: float) -> None:
        nonlocal best_cost, best
        if rate >= need - 1e-12:
            if cost < best_cost - 1e-12 or (abs(cost - best_cost) <= 1e-12 and len(chosen) < len(best)):
                best_cost, best = cost, list(chosen)
            return
        if k == len(order) or rate + suffix_rate[k] < need - 1e-12:
            return
        # lower bound: the rest of the need filled at the best cost per rollout still available
        if cost + (need - rate) * (costs[order[k]] / rates[order[k]]) >= best_cost - 1e-12:
            return
        i = order[k]
        chosen.append(i)
        visit(k + 1, chosen, cost + costs[i], rate + rates[i])
        chosen.pop()
        visit(k + 1, chosen, cost, rate)

    visit(0, [], 0.0, 0.0)
    return sorted(best)


def choose_active(rates: dict[str, float], prices: dict[str, float], need: float) -> set[str]:
    """The provisioning rule: free workers always run; the cheapest cover of what they leave of `need`
    among the paid ones (all of them if none covers). `rates` are fresh rollouts/s, all > 0."""
    free = {n for n in rates if prices[n] <= 0}
    paid = [n for n in rates if prices[n] > 0]
    rest = need - sum(rates[n] for n in sorted(free))  # a fixed order: the same float sum every run
    if rest <= 0:
        return free
    return free | {paid[i] for i in cheapest_cover([prices[n] for n in paid], [rates[n] for n in paid], rest)}


def plan(workers: list[WorkerProfile], f: LearnerFigures) -> Plan:
    """Activate the cheapest eligible workers that meet the demand; predict utilisation and cost."""
    ineligible = {w.name: reason for w in workers if (reason := ineligibility(w, f)) is not None}
    eligible = [w for w in workers if w.name not in ineligible]
    rates = {w.name: fresh_rate(w, f) for w in eligible}
    need = demand(f)
    chosen = choose_active(rates, {w.name: w.price_per_hour for w in eligible}, need)
    active = [w for w in eligible if w.name in chosen]
    supply = sum(rates[w.name] for w in active)
    utilisation = min(1.0, supply * f.train_step_s / f.rollouts_per_step)
    cost_per_hour = sum(w.price_per_hour for w in active)
    step_s = f.train_step_s / utilisation if utilisation > 0 else math.inf
    cost_per_step = cost_per_hour * step_s / 3600
    names = {w.name for w in active}
    notes = []
    if supply < need:
        notes.append(f"all eligible workers together supply {supply:.3g} of the {need:.3g} rollouts/s needed")
    return Plan(
        active=[w.name for w in workers if w.name in names],
        inactive={w.name: "not needed" for w in eligible if w.name not in names},
        ineligible=ineligible,
        fresh_rollouts_per_s=rates,
        demand=need,
        supply=supply,
        utilisation=utilisation,
        cost_per_hour=cost_per_hour,
        cost_per_step=cost_per_step,
        cost_per_1k_rollouts=1000 * cost_per_step / f.rollouts_per_step,
        notes=notes,
    )
