"""The house rules of docs/design.md ("Code layout"), checked on every module's imports and length.

Imports point one way: echo_rl (the Python API) -> echo_cli -> learner, worker -> envs -> p2p; learner.train imports
nothing from the swarm side (learner.orchestrate) and learner.plan nothing from train or orchestrate, and no
torch; worker and learner never import each other; envs (both step environments) imports neither, nor torch;
only p2p imports trio or libp2p.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("echo_rl", "echo_cli", "learner", "worker", "envs", "p2p")
MAX_LINES = 400

# (module prefix, imported prefixes it must not use)
FORBIDDEN = [
    ("p2p", ("echo_rl", "echo_cli", "learner", "worker", "envs")),
    ("envs", ("echo_rl", "echo_cli", "learner", "worker", "torch", "transformers", "trio", "libp2p")),
    ("echo_cli", ("echo_rl",)),  # the Python API is a facade over the CLI's packages, not under them
    ("echo_rl", ("echo_cli",)),  # ...and the CLI is another front end beside it, not under it
    ("worker", ("echo_cli", "learner")),
    ("learner", ("echo_cli", "worker")),
    ("learner.train", ("learner.orchestrate", "learner.plan", "learner.colocated_loop", "learner.swarm_loop",
                       "learner.swarm_side", "learner.run")),
    ("learner.plan", ("learner.train", "learner.orchestrate", "learner.tasks", "learner.run", "torch")),
    ("learner.orchestrate", ("learner.colocated_loop", "learner.swarm_loop", "learner.swarm_side", "learner.run")),
    ("learner.evaluation", ("learner.orchestrate", "learner.run", "learner.colocated_loop", "learner.swarm_loop",
                            "learner.swarm_side")),
    ("learner.tasks", ("learner.train", "learner.orchestrate", "learner.plan", "learner.run")),
    ("echo_rl", ("trio", "libp2p")),
    ("echo_cli", ("trio", "libp2p")),
    ("learner", ("trio", "libp2p")),
    ("worker", ("trio", "libp2p")),
]  # fmt: skip


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_imports_point_one_way():
    found = modules()
    assert len(found) > 40  # the walk found the code
    back_edges = [
        f"{module} imports {name}"
        for module, path in found.items()
        for name in sorted(imports(path))
        for prefix, banned in FORBIDDEN
        if within(module, prefix) and any(within(name, b) for b in banned)
    ]
    assert not back_edges, "\n".join(back_edges)


def test_plan_starts_without_torch():
    """`echo-rl plan` and `simulate` load no torch, not even through another module's imports."""
    code = (
        "import sys, learner.plan.simulator, learner.plan.admission, learner.plan.capacity, echo_cli.plan; "
        "bad = [m for m in ('torch', 'transformers', 'trio', 'libp2p') if m in sys.modules]; "
        "assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_environments_load_without_torch():
    """A worker and the learner both play environments: every built-in one loads no torch or libp2p."""
    code = (
        "import sys, envs, envs.episode, envs.chat; from envs import make_env; "
        "[make_env(n) for n in ('sokoban', 'calculator', 'kuhn-poker')]; "
        "bad = [m for m in ('torch', 'transformers', 'trio', 'libp2p') if m in sys.modules]; "
        "assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_modules_stay_small_or_say_why():
    """No module over ~400 lines unless its docstring says why ("Long because ...")."""
    long = []
    for module, path in modules().items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_LINES and "Long because" not in doc:
            long.append(f"{module}: {len(text.splitlines())} lines")
    assert not long, long


def test_tasks_and_environments_meet_in_one_interface():
    """Episodes are played and replayed only through learner.rollout_source and envs (no loop, intake or
    evaluation forks on whether the run has an environment)."""
    allowed = {"learner.rollout_source", "envs.episode"}
    for name, path in modules().items():
        if name in allowed:
            continue
        text = path.read_text()
        for call in ("play_episodes(", "replay_episode("):
            assert call not in text, f"{name} calls {call[:-1]}: go through learner.rollout_source.RolloutSource"
