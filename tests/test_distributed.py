"""A learner and workers as real processes on 127.0.0.1, training the tiny model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Swarm:
    """Starts `echo-rl` processes and always cleans them up."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.run_dir = tmp_path / "run"

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "COLUMNS": "200"}
        proc = subprocess.Popen([sys.executable, "-m", "echo_cli", *args], stdout=log, stderr=log, cwd=ROOT, env=env)
        self.procs.append(proc)
        return proc

    def learner(self, *args: str) -> subprocess.Popen:
        base = ["learner", "start", "--model", "tiny", "--run-dir", str(self.run_dir), "--prompts-per-step", "2"]
        base += ["--group-size", "4", "--max-new-tokens", "16", "--checkpoint-every", "1000"]
        proc = self.spawn("learner", *base, *args)
        addr_file = self.run_dir / "learner.addr"
        deadline = time.monotonic() + 120
        while not addr_file.exists() or not addr_file.read_text().strip():
            assert proc.poll() is None, self.log("learner")
            assert time.monotonic() < deadline, "learner did not start"
            time.sleep(0.2)
        self.addr = addr_file.read_text().strip()
        return proc

    def worker(self, name: str, *args: str) -> subprocess.Popen:
        return self.spawn(
            name, "worker", "join", "--learner", self.addr, "--identity", str(self.tmp / f"{name}.key"),
            "--work-dir", str(self.tmp / name), *args,
        )  # fmt: skip

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


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.close()


def check_accounting(metrics: list[dict], staleness: int) -> None:
    """Every consumed group was within the bound, and every accepted group is consumed, buffered or dropped."""
    for m in metrics:
        assert all(int(k) <= staleness for k in m["staleness"]), m["staleness"]
        assert m["groups_accepted"] == m["groups_consumed"] + m["buffer"] + m["stale_dropped"]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))


@pytest.mark.parametrize("mode, staleness", [("async", 1), ("pull", 0)])
def test_learner_and_two_workers_train(swarm, mode, staleness):
    learner = swarm.learner("--steps", "8", "--sync-mode", mode, "--staleness", str(staleness))
    workers = [swarm.worker("w1"), swarm.worker("w2")]
    assert swarm.wait(learner, 240) == 0, swarm.log("learner")[-3000:]
    for w in workers:  # SIGTERM: a worker leaves cleanly
        w.send_signal(signal.SIGTERM)
    assert [w.wait(60) for w in workers] == [0, 0]
    assert "worker left" in swarm.log("w1") and "worker left" in swarm.log("w2")
    metrics = swarm.metrics()
    assert len(metrics) == 8
    check_accounting(metrics, staleness)
    assert len(metrics[-1]["workers"]) == 2
    assert sum(w["groups"] for w in metrics[-1]["workers"].values()) >= 16
    assert (swarm.run_dir / "checkpoints" / "step-000008").exists()


def test_killed_worker_lease_is_reissued_and_late_joiner_catches_up(swarm):
    # the transformers engine is slow enough on long completions that a lease takes about a second
    learner = swarm.learner("--steps", "40", "--staleness", "2", "--lease-timeout", "4", "--max-new-tokens", "200")
    victim = swarm.worker("victim", "--engine", "transformers", "--max-groups", "2", "-v")
    swarm.worker("steady", "--engine", "transformers", "--max-groups", "1")
    deadline = time.monotonic() + 120
    while "lease " not in swarm.log("victim"):
        assert time.monotonic() < deadline and victim.poll() is None, swarm.log("victim")[-2000:]
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # mid-lease: it was generating
    time.sleep(3)
    joined_at = len(swarm.metrics()) if (swarm.run_dir / "metrics.jsonl").exists() else 0
    swarm.worker("late")
    assert swarm.wait(learner, 400) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    assert len(metrics) == 40
    check_accounting(metrics, 2)
    assert metrics[-1]["leases"]["expired"] >= 1  # the victim's lease went to another worker
    versions = [
        int(line.split("now on v")[1].split()[0]) for line in swarm.log("late").splitlines() if "now on v" in line
    ]
    assert versions and max(versions) > joined_at  # it caught up to versions published after it joined
    assert joined_at < 40


def test_worker_reconnects_after_learner_restart(swarm):
    args = ["--steps", "100000", "--checkpoint-every", "20", "--max-new-tokens", "8"]
    learner = swarm.learner(*args)
    swarm.worker("w1")
    checkpoints = swarm.run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints.exists() and list(checkpoints.glob("step-*"))):
        assert time.monotonic() < deadline, swarm.log("learner")[-2000:]
        time.sleep(0.2)
    learner.send_signal(signal.SIGKILL)
    learner.wait(10)
    time.sleep(2)  # the worker notices and starts retrying
    resumed = swarm.spawn(
        "learner2", "learner", "start", "--model", "tiny", "--run-dir", str(swarm.run_dir),
        "--prompts-per-step", "2", "--group-size", "4", "--resume", *args,
    )  # fmt: skip
    first_step = None
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, swarm.log("learner2")[-3000:] + swarm.log("w1")[-3000:]
        assert resumed.poll() is None, swarm.log("learner2")[-3000:]
        if "resumed from" in swarm.log("learner2"):
            last = swarm.metrics()[-1]
            first_step = first_step or last["step"]
            if last["step"] >= first_step + 5 and any(w["groups"] > 0 for w in last["workers"].values()):
                break  # the same worker came back by itself and feeds the resumed run
        time.sleep(0.3)
    # same identity and port: the address the worker was given still reaches the learner
    assert (swarm.run_dir / "learner.addr").read_text().strip() == swarm.addr
