"""Learner and worker processes for the swarm tests: `echo-rl` started for real, always cleaned up."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Swarm:
    """Starts `echo-rl` processes and always cleans them up."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.run_dir = tmp_path / "run"

    def spawn(self, name: str, *args: str, ranks: int = 1, within: Sequence[str] = ()) -> subprocess.Popen:
        """`within`: a command the process runs under (echo_cli.netlab: a network namespace)."""
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "COLUMNS": "200"}
        launch = [*within, sys.executable]
        if ranks > 1:  # data-parallel learner: torchrun starts `ranks` processes
            launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        proc = subprocess.Popen([*launch, "-m", "echo_cli", *args], stdout=log, stderr=log, cwd=ROOT, env=env)
        proc.log_path = log.name  # for a failing test to show what the process said
        self.procs.append(proc)
        return proc

    def learner(self, *args: str, ranks: int = 1, within: Sequence[str] = ()) -> subprocess.Popen:
        base = ["learner", "start", "--model", "tiny", "--run-dir", str(self.run_dir), "--prompts-per-step", "2"]
        base += ["--group-size", "4", "--max-new-tokens", "16", "--checkpoint-every", "1000"]
        addr_file = self.run_dir / "learner.addr"
        before = _mtime(addr_file)  # a resumed run's previous address is not a sign that this start is ready
        proc = self.spawn("learner", *base, *args, ranks=ranks, within=within)
        deadline = time.monotonic() + 120
        while _mtime(addr_file) in (None, before):
            assert proc.poll() is None, self.log("learner")
            assert time.monotonic() < deadline, "learner did not start"
            time.sleep(0.2)
        self.addr = addr_file.read_text().strip()
        return proc

    def worker(self, name: str, *args: str, within: Sequence[str] = ()) -> subprocess.Popen:
        # on loopback unless a test says otherwise (a worker listens on every interface by default)
        listen = () if "--listen" in args else ("--listen", "/ip4/127.0.0.1/tcp/0")
        return self.spawn(
            name, "worker", "join", "--learner", self.addr, "--identity", str(self.tmp / f"{name}.key"),
            "--work-dir", str(self.tmp / name), *listen, *args, within=within,
        )  # fmt: skip

    def forger(self, mode: str) -> subprocess.Popen:
        """A lying worker (tests/forging_worker.py, `mode` its lie) on loopback; its log is the `forger` log."""
        log = open(self.tmp / "forger.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forging_worker", mode, "--learner", self.addr,
             "--identity", str(self.tmp / "forger.key"), "--work-dir", str(self.tmp / "forger")],
            stdout=log, stderr=log, cwd=ROOT,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out; learner log:\n{self.log('learner')[-3000:]}")

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
