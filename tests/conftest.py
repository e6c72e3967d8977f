import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny():
    from learner.models import tiny_policy

    return tiny_policy(seed=0)


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `echo-rl ARGS` as a real subprocess (python -m echo_cli) and capture its output."""
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "echo_cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env,
    )  # fmt: skip


@pytest.fixture
def swarm(tmp_path):
    """Learner and worker processes of one test (tests/swarm.py), killed at its end."""
    from tests.swarm import Swarm

    s = Swarm(tmp_path)
    yield s
    s.close()
