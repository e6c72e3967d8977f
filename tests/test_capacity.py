"""The capacity model (learner/plan/capacity.py) on hand-computed cases, its solver vs brute force, `echo-rl plan`."""

import dataclasses
import itertools
import json
import random

import pytest

from learner.plan.capacity import (
    LearnerFigures,
    WorkerProfile,
    cheapest_cover,
    demand,
    fresh_rate,
    ineligibility,
    plan,
    useful_window,
)
from tests.conftest import ROOT, run_cli

FIGS = LearnerFigures(rollouts_per_step=256, train_step_s=20, publish_every=1, staleness=2, bcast_s=4)


def test_hand_computed_figures():
    fast = WorkerProfile("fast", rollouts_per_s=6, lease_s=3, price_per_hour=0.04)
    # overlapping: u = min(kappa*T, S*T - L - B) = min(20, 40 - 3 - 4) = 20 s: the whole window is useful
    assert useful_window(fast, FIGS) == 20 and fresh_rate(fast, FIGS) == pytest.approx(6)
    # sequential: u = min(kappa*T, S*T - L) - B = min(20, 37) - 4 = 16 s of each 20 s version window
    sequential = dataclasses.replace(fast, overlap=False)
    assert useful_window(sequential, FIGS) == 16
    assert fresh_rate(sequential, FIGS) == pytest.approx(6 * 16 / 20)
    # a lease of 40 s can never come back within S*T - B = 36 s, whichever the worker
    for overlap in (True, False):
        assert "36s" in ineligibility(WorkerProfile("slow", 0.4, 40, 0, overlap), FIGS)
        assert ineligibility(WorkerProfile("edge", 1, 35.9, 0, overlap), FIGS) is None
    # kappa = 2, T = 10, S = 3, B = 5, L = 12: overlapping u = min(20, 30 - 12 - 5) = 13 of 20 s;
    # sequential u = min(20, 30 - 12) - 5 = 13 too (the staleness bound binds, not the broadcast)
    figs = LearnerFigures(rollouts_per_step=64, train_step_s=10, publish_every=2, staleness=3, bcast_s=5)
    for overlap in (True, False):
        assert fresh_rate(WorkerProfile("w", 2, 12, 0, overlap), figs) == pytest.approx(2 * 13 / 20)
    # a broadcast as long as the time between versions: a sequential worker never generates; an
    # overlapping one installs a version every W = max(kappa*T, B) = 15 s and uses min(15, 30 - 1 - 15) = 14
    figs = LearnerFigures(rollouts_per_step=64, train_step_s=10, publish_every=1, staleness=3, bcast_s=15)
    assert "T_bcast" in ineligibility(WorkerProfile("w", 2, 1, 0, overlap=False), figs)
    assert ineligibility(WorkerProfile("w", 2, 1, 0), figs) is None
    assert fresh_rate(WorkerProfile("w", 2, 1, 0), figs) == pytest.approx(2 * 14 / 15)
    assert demand(FIGS) == pytest.approx(1.1 * 256 / 20)


def test_hand_computed_plan():
    workers = [
        WorkerProfile("a", 6, 3, 0.04, overlap=False),  # 4.8 fresh rollouts/s
        WorkerProfile("b", 3.5, 5, 0.03, overlap=False),  # 2.8
        WorkerProfile("laptop", 0.4, 40, 0.0, overlap=False),  # ineligible
        WorkerProfile("c", 12, 2, 0.75, overlap=False),  # 9.6
        WorkerProfile("d", 40, 1, 2.49, overlap=False),  # 32
    ]
    p = plan(workers, FIGS)
    # demand 14.08: {a, c} = 14.4 for $0.79/h beats {a, b, c} ($0.82), {d} ($2.49), {b, c} (12.4, short)
    assert p.active == ["a", "c"]
    assert set(p.inactive) == {"b", "d"} and set(p.ineligible) == {"laptop"}
    assert p.supply == pytest.approx(14.4)
    assert p.utilisation == 1.0
    assert p.cost_per_hour == pytest.approx(0.79)
    assert p.cost_per_step == pytest.approx(0.79 * 20 / 3600)
    assert p.cost_per_1k_rollouts == pytest.approx(1000 * 0.79 * 20 / 3600 / 256)
    # too few workers: all eligible ones run, the learner waits, and a step costs more
    p = plan(workers[:2], FIGS)
    assert p.active == ["a", "b"] and p.notes
    assert p.utilisation == pytest.approx((4.8 + 2.8) * 20 / 256)
    assert p.cost_per_step == pytest.approx(0.07 * (20 / p.utilisation) / 3600)
    # the same workers fetching while they generate lose nothing to B: {b, c} = 3.5 + 12 covers for $0.78/h
    p = plan([dataclasses.replace(w, overlap=True) for w in workers], FIGS)
    assert p.active == ["b", "c"] and p.supply == pytest.approx(15.5) and p.cost_per_hour == pytest.approx(0.78)


def window_oracle(w: WorkerProfile, f: LearnerFigures) -> float:
    """Fresh rollouts/s from the definition, not the formula: list the start ages a (seconds since the
    version was published) at which the worker starts leases with one version, and keep those with
    a + L <= S T. Overlapping: it installs a version at age B and keeps it until the next one arrives,
    every max(kappa T, B) seconds. Sequential: it generates from age B until the next version is out at
    kappa T (then it stops to fetch), so it never generates when B >= kappa T."""
    t = f.period
    start, end = f.bcast_s, (f.bcast_s + max(f.publish_every * t, f.bcast_s)) if w.overlap else f.publish_every * t
    window = end - start if w.overlap else f.publish_every * t
    ages = [start + (end - start) * (k + 0.5) / 20000 for k in range(20000)] if end > start else []
    fresh = sum(a + w.lease_s <= f.staleness * t for a in ages) / 20000 * max(end - start, 0)
    return w.rollouts_per_s * fresh / window


@pytest.mark.parametrize("seed", range(30))
def test_plan_is_the_brute_force_optimum_under_the_overlap_rule(seed):
    """Random small swarms (overlapping and sequential workers, some free, some ineligible): the plan's
    cost is the cheapest of all subsets covering the demand, with fresh rates from the window oracle."""
    rng = random.Random(seed)
    figs = LearnerFigures(
        rollouts_per_step=rng.choice([32, 64, 256]), train_step_s=rng.uniform(5, 30), publish_every=rng.choice([1, 2]),
        staleness=rng.choice([1, 2, 3]), bcast_s=rng.uniform(0.5, 25),
    )  # fmt: skip
    workers = [
        WorkerProfile(
            f"w{i}",
            rng.uniform(0.2, 20),
            rng.uniform(0.5, 40),
            rng.choice([0.0, rng.uniform(0.01, 3.0)]),
            overlap=rng.random() < 0.7,
        )  # fmt: skip
        for i in range(rng.randint(1, 9))
    ]
    rates = [window_oracle(w, figs) for w in workers]
    for w, rate in zip(workers, rates, strict=True):  # the formula agrees with the definition
        assert fresh_rate(w, figs) * (ineligibility(w, figs) is None) == pytest.approx(rate, rel=2e-3, abs=1e-3)
    p = plan(workers, figs)
    need = demand(figs)
    useful = [i for i, r in enumerate(rates) if r > 1e-9]
    optimum = brute_force([workers[i].price_per_hour for i in useful], [rates[i] for i in useful], need)
    if optimum is None:  # nothing covers: every eligible worker runs
        assert sorted(p.active) == sorted(workers[i].name for i in useful)
    else:
        assert p.supply >= need - 1e-9
        assert p.cost_per_hour == pytest.approx(optimum, abs=1e-9)


def test_free_workers_always_run():
    workers = [WorkerProfile("free", 6, 3, 0.0), WorkerProfile("paid", 40, 1, 1.0)]
    p = plan(workers, FIGS)
    assert p.active == ["free", "paid"]  # free alone is too little; paid fills the rest
    p = plan([WorkerProfile("free", 60, 3, 0.0), WorkerProfile("paid", 40, 1, 1.0)], FIGS)
    assert p.active == ["free"] and p.cost_per_hour == 0


def brute_force(costs, rates, need):
    best = None
    for k in range(len(costs) + 1):
        for subset in itertools.combinations(range(len(costs)), k):
            if sum(rates[i] for i in subset) >= need:
                cost = sum(costs[i] for i in subset)
                best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_solver_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 11)
    costs = [round(rng.choice([rng.uniform(0.01, 0.2), rng.uniform(0.5, 3.0)]), 3) for _ in range(n)]
    rates = [round(rng.uniform(0.2, 20), 2) for _ in range(n)]
    need = rng.uniform(0.1, 1.1) * sum(rates)
    chosen = cheapest_cover(costs, rates, need)
    optimum = brute_force(costs, rates, need)
    if optimum is None:  # nothing covers: everything runs
        assert chosen == list(range(n))
    else:
        assert sum(rates[i] for i in chosen) >= need
        assert sum(costs[i] for i in chosen) == pytest.approx(optimum)


def test_greedy_for_large_swarms_covers_and_is_near_the_bound():
    rng = random.Random(7)
    n = 1000
    costs = [rng.choice([rng.uniform(0.02, 0.15), rng.uniform(0.6, 2.5)]) for _ in range(n)]
    rates = [c * rng.uniform(3, 8) if c < 0.5 else c * rng.uniform(10, 20) for c in costs]
    need = 0.3 * sum(rates)
    chosen = cheapest_cover(costs, rates, need)
    assert sum(rates[i] for i in chosen) >= need
    # the fractional (LP) relaxation is a lower bound on any cover's cost
    bound, left = 0.0, need
    for i in sorted(range(n), key=lambda i: costs[i] / rates[i]):
        take = min(1.0, left / rates[i])
        bound += take * costs[i]
        left -= take * rates[i]
        if left <= 0:
            break
    assert sum(costs[i] for i in chosen) <= 1.01 * bound


def test_plan_command(tmp_path):
    args = ["plan", "--rollouts-per-step", "256", "--train-step-s", "20", "--staleness", "2", "--bcast-s", "4"]
    res = run_cli(*args, "--workers", str(ROOT / "examples" / "workers.toml"), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    # every worker overlaps fetching and generating (the daemon's default): 3.5 + 12 rollouts/s for $0.78/h
    assert doc["active"] == ["home-2070", "cloud-a10"] and "laptop-cpu" in doc["ineligible"]
    sequential = tmp_path / "sequential.toml"
    sequential.write_text(
        (ROOT / "examples" / "workers.toml").read_text().replace("price_per_hour", "overlap = false\nprice_per_hour")
    )
    doc = json.loads(run_cli(*args, "--workers", str(sequential), "--json").stdout)
    assert doc["active"] == ["home-3060", "cloud-a10"]  # each loses B = 4 s of a 20 s window
    res = run_cli(*args, "--workers", str(ROOT / "examples" / "workers.toml"))
    assert res.returncode == 0 and "predicted learner utilisation 100.0%" in res.stdout


@pytest.mark.parametrize(
    "toml, message",
    [
        ("", "needs [[workers]] tables"),
        ("[[workers]]\nname = 'a'\nrollouts_per_s = 1\nlease_s = 2\n", "worker 1 needs price_per_hour"),
        ("[[workers]]\nname = 'a'\nrollouts_per_s = -1\nlease_s = 2\nprice_per_hour = 0\n", "must be a finite"),
        ("[[workers]\n", "is not valid TOML"),
        (
            "[[workers]]\nname = 'a'\nrollouts_per_s = 1\nlease_s = 2\nprice_per_hour = 0\noverlap = 'yes'\n",
            "overlap must be true or false",
        ),
        (
            "[[workers]]\nname = 'a'\nrollouts_per_s = 1\nlease_s = 2\nprice_per_hour = 0\n" * 2,
            "two workers are named 'a'",
        ),
    ],
)
def test_plan_bad_input(tmp_path, toml, message):
    path = tmp_path / "w.toml"
    path.write_text(toml)
    args = ["plan", "--rollouts-per-step", "8", "--train-step-s", "2", "--bcast-s", "1", "--workers", str(path)]
    res = run_cli(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr
