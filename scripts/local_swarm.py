"""Run a learner and N workers as separate processes on 127.0.0.1 until the learner finishes.

    .venv/bin/python scripts/local_swarm.py --workers 2 --worker-threads 1 -- --config configs/demo.toml --run-dir R

Everything after `--` goes to `echo-rl learner start`. The learner's output stays on this terminal;
each worker logs to RUN_DIR/worker-K.log. Workers get SIGTERM when the learner exits. The processes are
echo_rl.swarm.LocalSwarm's (what `echo_rl.local_swarm` starts from Python).
"""

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from echo_rl.swarm import ECHO, LocalSwarm


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
    parser.add_argument(
        "--quant", default="", help="workers' weight formats, cycled: f16,q8_0 (1: F16, 2: q8_0); 4-bit ones need a "
        "learner correcting for them (--objective decoupled --minibatches 2) or naming them in --quant-formats"
    )
    parser.add_argument("learner_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    learner_args = [a for a in args.learner_args if a != "--"]
    run_dir = Path(learner_args[learner_args.index("--run-dir") + 1]) if "--run-dir" in learner_args else None
    if run_dir is None:
        sys.exit("local_swarm.py: pass --run-dir RUN_DIR to the learner (after --)")
    swarm = LocalSwarm(
        learner_args, run_dir, args.workers, args.worker_threads, args.engine, tuple(args.worker_arg),
        weights=tuple(q for q in args.quant.split(",") if q),
    )  # the learner's output stays on this terminal
    try:
        swarm.start()
        if args.status_every > 0:
            threading.Thread(target=show_status, args=(swarm.learner, run_dir, args.status_every), daemon=True).start()
        return swarm.learner.wait()
    except RuntimeError as exc:  # the learner exited (its own error is on the terminal) or never listened
        print(f"local_swarm.py: {exc}", file=sys.stderr)
        return swarm.learner.returncode if swarm.learner and swarm.learner.returncode else 1
    except KeyboardInterrupt:
        swarm.learner.send_signal(signal.SIGINT)
        return swarm.learner.wait()
    finally:
        swarm.close()


if __name__ == "__main__":
    sys.exit(main())
