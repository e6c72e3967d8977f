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
    parser.add_argument("--extra", nargs="*", default=[], help="more learner flags, e.g. --extra=--objective=decoupled")
    args = parser.parse_args()
    out = Path(args.out)
    results = {}
    for mode in args.modes.split(","):
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        common = ["--config", "configs/demo.toml", "--steps", str(args.steps), "--run-dir", str(run_dir)]
        common += ["--seed", str(args.seed), *args.extra]
        if mode == "colocated":
            cmd = [PY, "-m", "echo_cli", "learner", "start", "--colocated", *common]
        else:
            cmd = [PY, "scripts/local_swarm.py", "--workers", "2", "--worker-threads", "1", "--", *common]
            cmd += ["--sync-mode", mode]
        print(f"== {mode}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        results[mode] = summarize(load_metrics(ROOT / run_dir))
        print(json.dumps({mode: results[mode]}), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
