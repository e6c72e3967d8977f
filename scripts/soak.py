"""Soak test: a learner and N llama.cpp workers on the tiny model for a long run with churn.

Every ~`--churn-every` seconds (uniform in [0.5, 1.5] x that) one worker is killed (SIGKILL, or SIGTERM
one time in three) and restarted with the same identity and store a few seconds later. Every 10 s the
learner's RSS and status are sampled. At the end the learner is killed and the accounting is checked
from both sides:

    acked   = groups the workers were told were accepted (their logs)
    used    = groups in some step's batch or set aside (metrics.jsonl), or dropped as stale
    pending = accepted groups still waiting in the journal when the learner stopped
    lost    = acked - used - pending                                     (must be empty)

    python scripts/soak.py --minutes 30 --workers 4 --out runs/soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from learner.orchestrate.journal import read_journal  # noqa: E402
from p2p.host import Host  # noqa: E402
from p2p.messages import STATUS  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--churn-every", type=float, default=60.0, help="mean seconds between worker kills")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = random.Random(args.seed)
    env = {**os.environ, "COLUMNS": "200"}
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, *cli: str) -> subprocess.Popen:
        log = open(out / f"{name}.log", "a")  # noqa: SIM115 - one per process, closed at exit
        return subprocess.Popen([sys.executable, "-m", "echo_cli", *cli], stdout=log, stderr=log, cwd=ROOT, env=env)

    learner = spawn(
        "learner", "learner", "start", "--model", "tiny", "--run-dir", str(out / "run"), "--steps", "1000000",
        "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--checkpoint-every", "50",
        "--lease-timeout", "20", "--worker-silence", "15",
    )  # fmt: skip
    addr_file = out / "run" / "learner.addr"
    deadline = time.monotonic() + 120
    while not addr_file.exists() or not addr_file.read_text().strip():
        assert learner.poll() is None and time.monotonic() < deadline, "learner did not start"
        time.sleep(0.2)
    addr = addr_file.read_text().strip()

    def start_worker(i: int) -> None:
        name = f"w{i}"
        procs[name] = spawn(
            name, "worker", "join", "--learner", addr, "--identity", str(out / f"{name}.key"),
            "--work-dir", str(out / name), "--max-groups", "1", "--threads", "1", "-v",
        )  # fmt: skip

    for i in range(args.workers):
        start_worker(i)
    samples, churn = [], []
    started = time.monotonic()
    end = started + args.minutes * 60
    next_kill = started + rng.uniform(0.5, 1.5) * args.churn_every
    restart_at: dict[int, float] = {}
    host = Host().start()
    try:
        next_sample = started
        while time.monotonic() < end:
            assert learner.poll() is None, "the learner exited"
            now = time.monotonic()
            if now >= next_kill:
                i = rng.randrange(args.workers)
                sig = signal.SIGTERM if rng.random() < 1 / 3 else signal.SIGKILL
                if procs[f"w{i}"].poll() is None and i not in restart_at:
                    procs[f"w{i}"].send_signal(sig)
                    restart_at[i] = now + rng.uniform(2, 10)
                    churn.append({"t_s": round(now - started, 1), "worker": i, "signal": sig.name})
                next_kill = now + rng.uniform(0.5, 1.5) * args.churn_every
            for i, at in list(restart_at.items()):
                if now >= at:
                    procs[f"w{i}"].wait(30)
                    start_worker(i)
                    del restart_at[i]
            if now >= next_sample:
                try:
                    status = host.request(addr, STATUS, {}, timeout=10)
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    status = {"error": str(exc)}
                samples.append({
                    "t_s": round(now - started, 1), "learner_rss_mb": round(rss_mb(learner.pid), 1),
                    "step": status.get("step"), "buffer": status.get("buffer"),
                    "workers_seen": len(status.get("peers", [])), "penalties": status.get("penalties"),
                })  # fmt: skip
                next_sample = now + 10
            time.sleep(0.2)
    finally:
        host.stop()
        learner.send_signal(signal.SIGKILL)
        learner.wait(30)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)

    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    acked: set[int] = set()
    for log in out.glob("w*.log"):
        for m in re.finditer(r"accepted: groups \[([0-9, ]*)\]", log.read_text()):
            acked.update(int(g) for g in m.group(1).split(",") if g.strip())
    used = {g for m in metrics for g in m["batch_groups"] + m["set_aside_groups"] + m["stale_groups"]}
    checkpoints = sorted((out / "run" / "checkpoints").glob("step-*"))
    last_checkpoint = int(checkpoints[-1].name.split("-")[1]) if checkpoints else 0
    pending = set(read_journal(out / "run", last_checkpoint).pending())
    lost = sorted(acked - used - pending)
    errors = {
        p.name: sum(1 for line in p.read_text().splitlines() if "Traceback" in line or " ERROR " in line)
        for p in sorted(out.glob("*.log"))
    }
    rss = [s["learner_rss_mb"] for s in samples]
    fifth = max(1, min(30, len(rss) // 6))  # samples in the first and last 5 minutes (10 s apart)
    summary = {
        "minutes": args.minutes, "workers": args.workers, "steps": metrics[-1]["step"],
        "kills": len(churn), "kills_sigkill": sum(c["signal"] == "SIGKILL" for c in churn),
        "groups_acked_by_learner": len(acked), "groups_used": len(used & acked),
        "groups_pending_at_end": len(pending & acked),
        "groups_stale": sum(len(m["stale_groups"]) for m in metrics), "lost": lost,
        "learner_rss_mb_first_5min": round(sum(rss[:fifth]) / fifth, 1),
        "learner_rss_mb_last_5min": round(sum(rss[-fifth:]) / fifth, 1), "learner_rss_mb_max": max(rss),
        "lease_counters": metrics[-1]["leases"], "errors_in_logs": errors,
        "penalties": samples[-1]["penalties"] if samples else None,
    }  # fmt: skip
    (out / "samples.json").write_text(json.dumps(samples, indent=1))
    (out / "churn.json").write_text(json.dumps(churn, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if lost:
        sys.exit(f"{len(lost)} accepted groups lost")


if __name__ == "__main__":
    main()
