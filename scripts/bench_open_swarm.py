"""Training speed with and without a lease hoarder (issue: one identity must not stall training).

    .venv/bin/python scripts/bench_open_swarm.py [--steps 40] [--hoarders 1] [--rounds 2] [--json]

Runs the same tiny-model swarm (a learner and one honest llama.cpp worker, real processes on loopback) side by
side in one invocation, alternately alone and with `--hoarders` identities that ask for a lease every 0.1 s
and return none (tests/chaos/adversary.hoard_leases), `--rounds` times each. Prints the learner's steps per
second over the last `--steps` - 5 steps of each run (the first five warm up) and the ratio of the means.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p.host import Host  # noqa: E402
from tests.chaos.adversary import hoard_leases  # noqa: E402
from tests.swarm import Swarm  # noqa: E402


def steps_per_s(steps: int, hoarders: int) -> float:
    """One run: the learner's steps/s over steps 6..steps, with `hoarders` hoarding identities."""
    swarm = Swarm(Path(tempfile.mkdtemp(prefix="echo-open-swarm-")))
    hosts, stop, taken = [], threading.Event(), []
    try:
        learner = swarm.learner("--steps", str(steps), "--lease-timeout", "600", "--no-autoscale")
        for _ in range(hoarders):
            host = Host().start()
            hosts.append(host)
            threading.Thread(target=hoard_leases, args=(host, swarm.addr, stop, taken), daemon=True).start()
        while hoarders and not taken:  # the hoarders hold leases before the honest worker joins
            time.sleep(0.2)
        swarm.worker("w1", "--max-groups", "1")
        deadline = time.monotonic() + 900
        while learner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        metrics = swarm.metrics()
        if len(metrics) < steps:
            raise SystemExit(f"the run stopped at step {len(metrics)} of {steps}:\n{swarm.log('learner')[-2000:]}")
        first, last = metrics[4], metrics[steps - 1]
        return (steps - 5) / (last["wall_s"] - first["wall_s"])
    finally:
        stop.set()
        for host in hosts:
            host.stop()
        swarm.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run (>= 10)")
    parser.add_argument("--hoarders", type=int, default=1, help="hoarding identities in the second run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternated")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if args.steps < 10 or args.hoarders < 1 or args.rounds < 1:
        raise SystemExit("--steps must be >= 10, --hoarders >= 1 and --rounds >= 1")
    runs: dict[int, list[float]] = {0: [], args.hoarders: []}
    for _ in range(args.rounds):
        for hoarders in runs:
            runs[hoarders].append(steps_per_s(args.steps, hoarders))
    alone, hoarded = (sum(r) / len(r) for r in runs.values())
    result = {"steps": args.steps, "hoarders": args.hoarders, "rounds": args.rounds,
              "steps_per_s_alone": [round(x, 3) for x in runs[0]],
              "steps_per_s_with_hoarders": [round(x, 3) for x in runs[args.hoarders]],
              "ratio": round(hoarded / alone, 3)}  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        print(f"alone: {alone:.3f} steps/s; with {args.hoarders} hoarder(s): {hoarded:.3f} steps/s; "
              f"ratio {hoarded / alone:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
