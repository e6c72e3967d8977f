"""Cost per 1,000 rollouts and learner utilisation: every worker active vs cost-aware activation.

    .venv/bin/python scripts/bench_cost.py --profile examples/swarm-mix.toml --workers 10,100,1000 --steps 200

For each swarm size the learner is scaled to the swarm: its prompts per step are set so that the
learner consumes `--load` of what all workers together nominally generate (a swarm provisioned with
some slack, as one would run it). Both modes simulate the same swarm with the same seeds
(`echo-rl simulate` with and without --all-active); figures are means over the seeds.
"""

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from echo_cli.plan import load_profile
from learner.plan.simulator import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="examples/swarm-mix.toml")
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.5, help="learner demand / nominal swarm supply")
    args = parser.parse_args()
    learner, classes = load_profile(Path(args.profile))
    total_share = sum(c.share for c in classes)
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        supply = n * sum(c.share * c.rollouts_per_s for c in classes) / total_share  # rollouts/s, nominal
        prompts = max(1, round(args.load * supply * learner.train_step_s / learner.group_size))
        scaled = dataclasses.replace(learner, prompts_per_step=prompts)
        result = {}
        for mode, autoscale in (("all active", False), ("cost-aware", True)):
            runs = [simulate(scaled, classes, n, args.steps, seed, autoscale) for seed in range(args.seeds)]
            result[mode] = {
                "utilisation": statistics.mean(r.utilisation for r in runs),
                "cost_per_1k_rollouts": statistics.mean(r.cost_per_1k_rollouts for r in runs),
                "active_workers_mean": statistics.mean(r.active_workers_mean for r in runs),
                "stale_dropped_groups": sum(r.stale_dropped_groups for r in runs),
                "preemptions": sum(r.preemptions for r in runs),
            }
        saving = 1 - result["cost-aware"]["cost_per_1k_rollouts"] / result["all active"]["cost_per_1k_rollouts"]
        rows.append({"workers": n, "prompts_per_step": prompts, **result, "saving": saving})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| workers | rollouts/step | mode | learner utilisation | $ per 1,000 rollouts | active workers (mean) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for mode in ("all active", "cost-aware"):
            r = row[mode]
            print(
                f"| {row['workers']} | {row['prompts_per_step'] * learner.group_size} | {mode} | "
                f"{r['utilisation']:.1%} | {r['cost_per_1k_rollouts']:.4f} | {r['active_workers_mean']:.1f} |"
            )
        print(f"| | | saving | | {row['saving']:.1%} | |")


if __name__ == "__main__":
    main()
