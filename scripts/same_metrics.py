"""Record the seed-determined metrics of a tiny co-located run and a tiny swarm run, or compare two records.

    .venv/bin/python scripts/same_metrics.py record OUT.json [--steps 4] [--seed 0]
    .venv/bin/python scripts/same_metrics.py compare BEFORE.json AFTER.json

A refactor that claims "behaviour unchanged" records before and after and compares: every training
figure (reward, loss, KL, clip fraction, gradient norm, token counts, group counts) must be equal step
for step. Timings, utilisation and worker rates are left out: they depend on the machine, not the code.
The swarm run is one learner and one llama.cpp worker in pull mode, whose rollouts depend only on the
prompts and the sampling draws, not on timing. The draws are keyed by lease id, which the learner takes
from the OS so that workers cannot predict it; here the learner runs with `secrets.randbits` replaced by
a generator seeded with --seed, so that both records see the same lease ids.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ECHO = [sys.executable, "-m", "echo_cli"]
FIELDS = (
    "step", "reward_mean", "accuracy", "loss", "kl", "kl_ref", "clip_frac", "grad_norm", "tokens",
    "trained_tokens", "skipped_updates", "completion_len_mean", "groups", "equal_reward_groups",
)  # fmt: skip
TINY = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "16"]


def training_figures(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: row.get(k) for k in FIELDS} for row in rows]


def swarm_run(run_dir: Path, learner_args: list[str], seed: int) -> None:
    """A learner (lease ids from a seeded generator) and one worker, until the learner finishes."""
    seeded = f"import random, secrets; secrets.randbits = random.Random({seed}).getrandbits; import echo_cli.__main__"
    learner = subprocess.Popen(
        [sys.executable, "-c", seeded, "learner", "start", *learner_args, "--run-dir", str(run_dir)]
    )
    addr_file, deadline = run_dir / "learner.addr", time.monotonic() + 300
    while not (addr_file.exists() and addr_file.read_text().strip()):
        if learner.poll() is not None or time.monotonic() > deadline:
            learner.kill()
            sys.exit("same_metrics: the learner did not start")
        time.sleep(0.2)
    worker = subprocess.Popen([
        *ECHO, "worker", "join", "--learner", addr_file.read_text().strip(), "--threads", "1",
        "--identity", str(run_dir / "worker.key"), "--work-dir", str(run_dir / "worker"),
    ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        if learner.wait(600) != 0:
            sys.exit("same_metrics: the learner failed")
    finally:
        worker.terminate()
        worker.wait(30)


def record(out: Path, steps: int, seed: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"  # a reward half of the random tiny model's samples earn: it trains
        data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 0}) + "\n" for i in range(8)))
        task = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii"]
        common = [*TINY, *task, "--steps", str(steps), "--seed", str(seed), "--checkpoint-every", "1000"]
        colocated, swarm = Path(tmp) / "colocated", Path(tmp) / "swarm"
        subprocess.run([*ECHO, "learner", "start", "--colocated", *common, "--run-dir", str(colocated)], check=True)
        swarm_run(swarm, [*common, "--sync-mode", "pull"], seed)
        figures = {"colocated": training_figures(colocated), "swarm": training_figures(swarm)}
    out.write_text(json.dumps(figures, indent=1))
    print(f"same_metrics: wrote {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differences = 0
    for run in ("colocated", "swarm"):
        if len(a[run]) != len(b[run]):
            print(f"{run}: {len(a[run])} steps before, {len(b[run])} after")
            differences += 1
        for row_a, row_b in zip(a[run], b[run], strict=False):
            for key in FIELDS:
                if row_a.get(key) != row_b.get(key):
                    print(f"{run} step {row_a['step']}: {key} {row_a.get(key)} -> {row_b.get(key)}")
                    differences += 1
        print(f"{run}: {len(a[run])} steps x {len(FIELDS)} figures compared")
    print("same metrics" if differences == 0 else f"{differences} differences")
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--steps", type=int, default=6)
    rec.add_argument("--seed", type=int, default=0)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.steps, args.seed)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
