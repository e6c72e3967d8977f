"""Print the mean reward of the first and last N steps of a run (RUN_DIR/metrics.jsonl)."""

import json
import sys
from pathlib import Path

run_dir = Path(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
if len(rows) < 2 * n:
    sys.exit(f"{run_dir}: {len(rows)} steps recorded, need at least {2 * n} to compare")
first = sum(r["reward_mean"] for r in rows[:n]) / n
last = sum(r["reward_mean"] for r in rows[-n:]) / n
print(f"{len(rows)} steps in {rows[-1]['wall_s'] / 60:.1f} min")
print(f"mean reward, first {n} steps: {first:.3f}")
print(f"mean reward, last {n} steps:  {last:.3f}  ({last - first:+.3f})")
print("per step: " + " ".join(f"{r['reward_mean']:.2f}" for r in rows))
