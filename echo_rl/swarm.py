"""A local swarm in one call: a learner and N workers as processes on 127.0.0.1, for notebooks and scripts.

    with echo_rl.local_swarm(cfg, workers=2) as swarm:
        for record in swarm.records():      # each step's metrics.jsonl record as the learner writes it
            print(record["step"], record["reward_mean"])

The learner gets `cfg` as command-line flags (every field that differs from its default); workers log to
RUN_DIR/worker-K.log. Leaving the `with` block stops the workers and the learner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from learner.config import LearnerConfig

ECHO = [sys.executable, "-m", "echo_cli"]
START_TIMEOUT_S = 600.0  # the learner loads its model and starts listening within this


def config_flags(cfg: LearnerConfig) -> list[str]:
    """`cfg` as `echo-rl learner start` flags: one per field that differs from the default."""
    flags: list[str] = []
    for section in dataclasses.fields(cfg):
        value, default = getattr(cfg, section.name), type(getattr(cfg, section.name))()
        for field in dataclasses.fields(value):
            given, flag = getattr(value, field.name), "--" + field.name.replace("_", "-")
            if given == getattr(default, field.name):
                continue
            if isinstance(given, bool):
                flags.append(flag if given else f"--no-{flag[2:]}")
            elif isinstance(given, dict):
                for key, item in given.items():
                    flags += [flag, f"{key}={json.dumps(item)}"]  # a TOML scalar (strings quoted)
            else:
                flags += [flag, str(given)]
    return flags


class LocalSwarm:
    """A learner process (`echo-rl learner start LEARNER_ARGS`) and `workers` worker processes on this machine.

    `learner_log`: the file the learner's output goes to (None: this process's terminal)."""

    def __init__(
        self, learner_args: list[str], run_dir: Path, workers: int = 2, worker_threads: int = 1,
        engine: str = "llamacpp", worker_args: tuple[str, ...] = (), learner_log: Path | None = None,
        weights: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.learner_args, self.run_dir, self.learner_log = learner_args, Path(run_dir), learner_log
        self.n_workers, self.worker_threads, self.engine, self.worker_args = (
            workers,
            worker_threads,
            engine,
            worker_args,
        )
        self.weights = weights  # worker k's weight format (`worker join --quant`): weights[k % len], or f16
        self.learner: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []

    def start(self) -> LocalSwarm:
        """Start the learner, wait until it listens, then start the workers. RuntimeError if the learner
        exits first or does not listen within START_TIMEOUT_S."""
        addr_file = self.run_dir / "learner.addr"
        addr_file.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.learner_log, "w") if self.learner_log else None  # noqa: SIM115 - lives as long as the learner
        self.learner = subprocess.Popen(ECHO + ["learner", "start", *self.learner_args], stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (addr_file.exists() and addr_file.read_text().strip()):
            if self.learner.poll() is not None:
                raise RuntimeError(f"the learner exited with {self.learner.returncode} before it listened")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the learner did not listen within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        addr = addr_file.read_text().strip()
        for k in range(1, self.n_workers + 1):
            worker_log = open(self.run_dir / f"worker-{k}.log", "w")  # noqa: SIM115 - lives as long as the worker
            cmd = ECHO + ["worker", "join", "--learner", addr, "--threads", str(self.worker_threads)]
            cmd += ["--engine", self.engine, "--identity", str(self.run_dir / f"worker-{k}.key")]
            cmd += ["--work-dir", str(self.run_dir / f"worker-{k}"), *self.worker_args]
            cmd += ["--quant", self.weights[(k - 1) % len(self.weights)]] if self.weights else []
            env = {**os.environ, "COLUMNS": "120"}
            self.workers.append(subprocess.Popen(cmd, stdout=worker_log, stderr=worker_log, env=env))
        return self

    def records(self, timeout_s: float | None = None) -> Iterator[dict]:
        """Each step's record as the learner appends it to metrics.jsonl, until the learner exits (or
        `timeout_s` passes: TimeoutError). A learner that failed raises RuntimeError naming its log."""
        assert self.learner is not None, "start() the swarm first"
        path, seen = self.run_dir / "metrics.jsonl", 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            done = self.learner.poll() is not None  # read once more after it ends: its last lines
            lines = path.read_text().splitlines() if path.exists() else []
            complete = [ln for ln in lines[seen:] if ln.endswith("}")]  # a line being written is left for later
            for line in complete:
                yield json.loads(line)
            seen += len(complete)
            if done:
                if self.learner.returncode != 0:
                    raise RuntimeError(
                        f"the learner exited with {self.learner.returncode}: see {self.run_dir}/learner.log"
                    )
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the swarm run did not finish within {timeout_s} s")
            time.sleep(0.5)

    def status(self) -> dict:
        """`echo-rl status --json` of the running learner (docs/status.md)."""
        res = subprocess.run(
            ECHO + ["status", "--run-dir", str(self.run_dir), "--json"], capture_output=True, text=True, timeout=60
        )
        if res.returncode != 0:
            raise RuntimeError(f"echo-rl status failed: {res.stderr.strip().splitlines()[-1:]}")
        return json.loads(res.stdout)

    def close(self) -> None:
        """Stop the workers (SIGTERM, then kill after 30 s) and the learner if it still runs."""
        for process in [*self.workers, *([self.learner] if self.learner else [])]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.workers, *([self.learner] if self.learner else [])]:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def local_swarm(
    cfg: LearnerConfig, workers: int = 2, worker_threads: int = 1, engine: str = "llamacpp",
    worker_args: tuple[str, ...] = (),
) -> LocalSwarm:  # fmt: skip
    """Start a swarm run of `cfg` with `workers` workers (use it in a `with` block); the learner logs to
    RUN_DIR/learner.log."""
    cfg.validate()
    run_dir = Path(cfg.run.run_dir)
    swarm = LocalSwarm(
        config_flags(cfg), run_dir, workers, worker_threads, engine, worker_args, run_dir / "learner.log"
    )
    return swarm.start()
