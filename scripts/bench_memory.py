"""Learner step time and peak memory, per configuration, measured one after the other on this machine.

    .venv/bin/python scripts/bench_memory.py --steps 4 --out runs/memory
    .venv/bin/python scripts/bench_memory.py --only colocated-fp32,colocated-bf16 --extra=--device=cuda

Each configuration is a real run of configs/demo.toml (SmolLM2-135M) for --steps steps: co-located runs
generate, train and reload in one process; the swarm run has a learner and one worker on this machine.
Prints per configuration: the learner process's peak resident memory (the highest of the kernel's
figure from wait4 and every phase's peak in metrics.jsonl: a phase resets the kernel's high-water mark), the
median step and train seconds (the first step, which warms up, left out), and the newest step's memory
record (metrics.jsonl "memory_gib": each phase's peak, what the training state, verifier, chunk store
and publisher hold). Compare figures of one invocation only: they share the machine's state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ECHO = [sys.executable, "-m", "echo_cli"]
CONFIGS = {
    "colocated-fp32": ["--colocated"],
    "colocated-fp32-ckpt": ["--colocated", "--grad-checkpointing"],
    "colocated-bf16": ["--colocated", "--precision", "bf16"],
    "colocated-bf16-ckpt": ["--colocated", "--precision", "bf16", "--grad-checkpointing"],
    "swarm-fp32": [],
    "swarm-fp32-ckpt": ["--grad-checkpointing"],
}


def run_learner(name: str, args: list[str], run_dir: Path, steps: int, worker_args: list[str]) -> int:
    """Run one configuration to its end; returns the learner's peak resident set in KiB."""
    cmd = ECHO + ["learner", "start", "--config", "configs/demo.toml", "--run-dir", str(run_dir)]
    cmd += ["--steps", str(steps), "--checkpoint-every", "1000", *args]
    log = (run_dir.parent / f"{name}.log").open("w")
    learner = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    worker = None
    try:
        if "--colocated" not in args:
            addr_file, deadline = run_dir / "learner.addr", time.monotonic() + 300
            while not addr_file.exists():
                if learner.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"bench_memory: the learner of {name} did not start (see {log.name})")
                time.sleep(0.5)
            worker = subprocess.Popen(
                ECHO + ["worker", "join", "--learner", addr_file.read_text().strip(), "--work-dir",
                        str(run_dir.parent / f"{name}-worker"), "--identity", str(run_dir.parent / "worker.key"),
                        *worker_args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _, status, usage = os.wait4(learner.pid, 0)
        learner.returncode = os.waitstatus_to_exitcode(status)
        if learner.returncode != 0:
            sys.exit(f"bench_memory: {name} failed with exit code {learner.returncode} (see {log.name})")
        return usage.ru_maxrss
    finally:
        for proc in (learner, worker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/memory")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    parser.add_argument("--extra", nargs="*", default=[], help="more learner flags, e.g. --extra=--device=cuda")
    parser.add_argument("--worker", nargs="*", default=[], help="worker flags, e.g. --worker=--gpu-layers=0")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        if name not in CONFIGS:
            sys.exit(f"bench_memory: unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        peak_kib = run_learner(name, CONFIGS[name] + args.extra, run_dir, args.steps, args.worker)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        later = rows[1:] or rows
        # the kernel's figure covers the time since the last phase reset the high-water mark (and the
        # final checkpoint); each phase's own peak is in the metrics
        phase_peaks = [v for r in rows for k, v in r.get("memory_gib", {}).items() if k.startswith("peak_")]
        result = {
            "config": name,
            "flags": " ".join(CONFIGS[name] + args.extra),
            "peak_rss_gib": round(max([peak_kib / 2**20, *phase_peaks]), 2),
            "step_s": round(statistics.median(sum(r["seconds"].values()) for r in later), 2),
            "train_s": round(statistics.median(r["seconds"]["train"] for r in later), 2),
            "trained_tokens": round(statistics.median(r["trained_tokens"] for r in later)),
            "memory_gib": rows[-1].get("memory_gib"),  # absent in runs of echo-rl before it was recorded
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
