"""Run a learner and N workers as separate processes on 127.0.0.1 until the learner finishes.

    .venv/bin/python scripts/local_swarm.py --workers 2 --worker-threads 1 -- --config configs/demo.toml --run-dir R

Everything after `--` goes to `echo-rl learner start`. The learner's output stays on this terminal;
each worker logs to RUN_DIR/worker-K.log. Workers get SIGTERM when the learner exits.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ECHO = [sys.executable, "-m", "echo_cli"]


def show_status(learner: subprocess.Popen, run_dir: Path, every: float) -> None:
    """Print the swarm's status table every `every` seconds while the learner runs.

    Not on a terminal: there the learner's live view shows the swarm, and our prints would tear it.
    """
    if sys.stderr.isatty():
        print(f"local_swarm: `echo-rl status --run-dir {run_dir}` in another terminal shows the swarm's status")
        return
    while learner.poll() is None:
        time.sleep(every)
        if learner.poll() is None:
            subprocess.run(ECHO + ["status", "--run-dir", str(run_dir)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--engine", default="llamacpp")
    parser.add_argument("--status-every", type=float, default=0, help="print `echo-rl status` every N seconds")
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="one more `worker join` flag, e.g. --worker-arg=--no-overlap"
    )
    parser.add_argument("learner_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    learner_args = [a for a in args.learner_args if a != "--"]
    run_dir = Path(learner_args[learner_args.index("--run-dir") + 1]) if "--run-dir" in learner_args else None
    if run_dir is None:
        sys.exit("local_swarm.py: pass --run-dir RUN_DIR to the learner (after --)")
    addr_file = run_dir / "learner.addr"
    addr_file.unlink(missing_ok=True)

    learner = subprocess.Popen(ECHO + ["learner", "start", *learner_args])
    workers = []
    try:
        deadline = time.monotonic() + 600
        while not (addr_file.exists() and addr_file.read_text().strip()):
            if learner.poll() is not None:
                return learner.returncode
            if time.monotonic() > deadline:
                sys.exit("local_swarm.py: the learner did not start listening within 10 minutes")
            time.sleep(0.5)
        addr = addr_file.read_text().strip()
        for k in range(1, args.workers + 1):
            log = open(run_dir / f"worker-{k}.log", "w")  # noqa: SIM115 - lives as long as the worker
            cmd = ECHO + ["worker", "join", "--learner", addr, "--threads", str(args.worker_threads)]
            cmd += ["--engine", args.engine, "--identity", str(run_dir / f"worker-{k}.key")]
            cmd += ["--work-dir", str(run_dir / f"worker-{k}"), *args.worker_arg]
            workers.append(subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, "COLUMNS": "120"}))
        if args.status_every > 0:
            threading.Thread(target=show_status, args=(learner, run_dir, args.status_every), daemon=True).start()
        return learner.wait()
    except KeyboardInterrupt:
        learner.send_signal(signal.SIGINT)
        return learner.wait()
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()


if __name__ == "__main__":
    sys.exit(main())
