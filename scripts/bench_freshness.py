"""Admission's "newer" rule in the simulator: staleness and utilisation with and without it, side by side.

    python scripts/bench_freshness.py [--seeds 8] [--steps 60]

Each row: the default local-swarm profile (learner.plan.simulator.LearnerProfile) with n workers of one
class, the mean over seeds of the learner's utilisation and of the batches' mean staleness.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from learner.plan.simulator import LearnerProfile, WorkerClass, simulate


def row(profile: LearnerProfile, kind: WorkerClass, n: int, steps: int, seeds: int, autoscale: bool) -> tuple:
    utils, stale = [], []
    for seed in range(seeds):
        r = simulate(profile, [kind], n, steps, seed, autoscale=autoscale)
        utils.append(r.utilisation)
        stale.append(sum(int(k) * v for k, v in r.staleness.items()) / max(sum(r.staleness.values()), 1))
    return statistics.mean(utils), statistics.mean(stale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    cases = [(f"{n} workers, 6 rollouts/s, autoscale", WorkerClass(), n, True) for n in (3, 6, 20)]
    cases += [(f"{n} workers, 2 rollouts/s, all active", WorkerClass(rollouts_per_s=2.0), n, False) for n in (2, 4, 8)]
    print(f"{'swarm':38s} {'util (rule)':>12s} {'util (none)':>12s} {'stale (rule)':>13s} {'stale (none)':>13s}")
    for label, kind, n, autoscale in cases:
        on = row(LearnerProfile(), kind, n, args.steps, args.seeds, autoscale)
        off = row(replace(LearnerProfile(), wait_for_newer=False), kind, n, args.steps, args.seeds, autoscale)
        print(f"{label:38s} {on[0]:12.4f} {off[0]:12.4f} {on[1]:13.2f} {off[1]:13.2f}")


if __name__ == "__main__":
    main()
