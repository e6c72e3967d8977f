"""Co-located vs sequential pull vs async push-pull on the same task, measured one after the other.

    .venv/bin/python scripts/bench_modes.py --steps 30 --out runs/modes

Each mode trains the same model on the same config (configs/demo.toml plus --steps) from the same
initial weights; the swarm modes run a learner and 2 workers on this machine (scripts/local_swarm.py).
Prints per mode: learner utilisation (training time / wall time), mean reward per step, reward of the
last 10 steps, wall minutes and reward per wall-clock minute (mean reward gained per minute).
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from echo_cli.report import load_metrics, summarize

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/modes")
    parser.add_argument("--modes", default="colocated,pull,async")
    parser.add_argument("--seed", type=int, default=0, help="run seed: prompts, sampling")
    parser.add_argument(
        "--extra", nargs="*", action="extend", default=[], help="more learner flags (repeatable): --extra=--lr=2e-4"
    )
    parser.add_argument(
        "--worker-extra", nargs="*", action="extend", default=[], help="more worker flags: --worker-extra=--no-overlap"
    )
    parser.add_argument("--summarize-only", action="store_true", help="only summarize the runs already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        run_dir = out / mode
        if not args.summarize_only:
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run
        common = ["--config", "configs/demo.toml", "--steps", str(args.steps), "--run-dir", str(run_dir)]
        common += ["--seed", str(args.seed), *args.extra]
        if mode == "colocated":
            cmd = [PY, "-m", "echo_cli", "learner", "start", "--colocated", *common]
        else:
            cmd = [PY, "scripts/local_swarm.py", "--workers", "2", "--worker-threads", "1"]
            cmd += [f"--worker-arg={a}" for a in args.worker_extra] + ["--", *common]
            cmd += ["--sync-mode", mode]
        if not args.summarize_only:
            print(f"== {mode}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)
        results[mode] = summarize(load_metrics(ROOT / run_dir))
        print(json.dumps({mode: results[mode]}), flush=True)
    by_version = {mode: reward_by_version(load_metrics(ROOT / out / mode)) for mode in results}
    common = set.intersection(*(set(r) for r in by_version.values()))
    for mode, rewards in by_version.items():
        results[mode]["reward_of_versions"] = round(sum(rewards[v] for v in common) / len(common), 3)
    print(f"mean reward of the rollouts each policy version generated, versions {min(common)}-{max(common)}:")
    print(json.dumps({mode: r["reward_of_versions"] for mode, r in results.items()}))
    print(json.dumps(results, indent=1))


def reward_by_version(rows: list[dict]) -> dict[int, float]:
    """Policy version -> mean reward of the rollouts it generated: how good each version is, whatever the lag."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        # co-located records before reward_by_version: step t trains on rollouts of version t - 1
        for v, (mean, n) in r.get("reward_by_version", {str(r["step"] - 1): [r["reward_mean"], 1]}).items():
            acc = sums.setdefault(int(v), [0.0, 0])
            acc[0] += mean * n
            acc[1] += n
    return {v: total / n for v, (total, n) in sums.items()}


if __name__ == "__main__":
    main()
