import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny():
    from learner.train.models import tiny_policy

    return tiny_policy(seed=0)


# Files of learner and worker swarms that run for minutes: collected first, so that under pytest-xdist
# (scripts/test.sh: two processes, a file at a time) they start early and the short files fill in beside them,
# instead of one long file running alone at the end.
LONG_FILES = (
    "test_distributed.py", "test_families.py", "chaos/test_kills.py", "chaos/test_nat.py", "test_env_swarm.py",
    "test_hosted.py", "chaos/test_open_swarm.py", "test_report.py", "test_quantized_workers.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONG_FILES) if path.endswith("tests/" + name)), len(LONG_FILES))

    items.sort(key=rank)  # stable: within a file and among the rest, collection order


# every kind of environment: the built-ins, a module:Class plugin, a verifiers one, one that raises now and then
EVERY_ENV = [
    "sokoban", "calculator", "calculator-tools", "kuhn-poker", "examples.guess_env:GuessEnv",
    "verifiers:tests.vf_guess", "verifiers:tests.vf_tools", "tests.bad_envs:Flaky",
]  # fmt: skip


def run_cli(
    *args: str, timeout: float = 300, cwd: Path | None = None, columns: int | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `echo-rl ARGS` as a real subprocess (python -m echo_cli) and capture its output; `env` adds to ours."""
    env = dict(os.environ) | ({"COLUMNS": str(columns)} if columns else {}) | (env or {})
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


def weights_moved(run_dir: Path) -> bool:
    """Whether the newest checkpoint of a tiny-model run differs from the initial tiny weights (seed 0)."""
    import torch

    from learner.train.checkpoint import list_checkpoints, load_weights
    from learner.train.models import tiny_policy

    initial, trained = tiny_policy(seed=0).model, tiny_policy(seed=0).model
    load_weights(list_checkpoints(run_dir)[-1], trained)
    pairs = zip(initial.state_dict().values(), trained.state_dict().values(), strict=True)
    return any(not torch.equal(a, b) for a, b in pairs)
