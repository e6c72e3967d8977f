"""Multi-turn environments (docs/environments.md): games and tools the policy plays over several turns.

An episode alternates model turns and environment observations. The worker steps the environment (it needs
each observation to go on); the learner replays every episode from its seed and the model's turns, checks
each observation the worker claims and computes the reward itself (envs.episode). So an environment must be
deterministic: `reset(seed)` and the same actions always give the same observations and rewards.

Both sides import this package, so it imports neither torch nor the learner or the worker: only the standard
library, `tokenizers` (envs.chat) and p2p's plain message types.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Step:
    """What the environment answers to one model turn."""

    observation: str = ""  # shown to the model as the next user turn (rendered with its chat template)
    reward: float = 0.0  # this turn's reward; an episode's return is the sum over its turns
    done: bool = False  # the episode is over (the observation of the last step is never shown)
    tool_results: tuple[str, ...] = ()  # the turn's tool calls' results, shown as tool messages instead (envs.tools)


@runtime_checkable
class Environment(Protocol):
    """One episode of a game or tool. A fresh instance plays each episode: `cls(**args)`, then reset(seed),
    then step(action) once per model turn until a Step says done or a budget runs out (envs.episode)."""

    def reset(self, seed: int) -> str:
        """Start the episode drawn by `seed`; return the first user message (the task, the board, ...)."""
        ...

    def step(self, action: str) -> Step:
        """Apply the model's turn (its text, special tokens removed); return the observation and reward."""
        ...

    # Optional: close() frees what an episode holds; it is called once the episode is over (close_env).


log = logging.getLogger(__name__)


class EnvError(ValueError):
    """An environment name, plugin spec or argument that cannot be used; the message says what is allowed."""


ENV_NAMES = ("sokoban", "calculator", "calculator-tools", "python", "kuhn-poker", "module:Class", "verifiers:MODULE",
             "openenv:URL")

EnvFactory = Callable[[], Environment]


def builtin_envs() -> dict[str, type]:
    from envs.calculator import CalculatorEnv, CalculatorToolEnv
    from envs.kuhn_poker import KuhnPokerEnv
    from envs.python_tool import PythonToolEnv
    from envs.sokoban import SokobanEnv

    return {"sokoban": SokobanEnv, "calculator": CalculatorEnv, "calculator-tools": CalculatorToolEnv,
            "python": PythonToolEnv, "kuhn-poker": KuhnPokerEnv}  # fmt: skip


def make_env(name: str, args: dict[str, Any] | None = None) -> EnvFactory:
    """A factory of fresh episodes of environment `name` (see ENV_NAMES) with keyword `args`.

    The factory is tried here (two instances, reset with seed 0: their first messages must be equal), so a bad
    name, argument or plugin fails before a run starts, with one line saying what to change."""
    args = dict(args or {})
    if name.startswith("verifiers:"):
        from envs.verifiers_env import verifiers_factory  # imports verifiers only for its environments

        factory = verifiers_factory(name.removeprefix("verifiers:"), args)
    elif name.startswith("openenv:"):
        from envs.openenv_env import openenv_factory  # imports openenv only for its environments

        factory = openenv_factory(name.removeprefix("openenv:"), args)
    elif ":" in name:
        factory = _plugin(name, args)
    else:
        classes = builtin_envs()
        if name not in classes:
            raise EnvError(f"unknown environment {name!r}; choose one of {', '.join(ENV_NAMES)}")
        cls = classes[name]
        _check_args(cls, name, args)
        factory = _bound(cls, args)
    _try(factory, name)
    return factory


def _plugin(spec: str, args: dict[str, Any]) -> EnvFactory:
    """`module:Class` (or `package.module:Class`): a user's environment class, imported by name."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr.isidentifier():
        raise EnvError(f"environment {spec!r}: write a plugin as module:Class, e.g. my_envs.maze:MazeEnv")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(
            f"environment {spec!r}: cannot import {module_name!r} ({exc}); install it or add its folder to PYTHONPATH"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a plugin's own import failure, reported in one line
        raise EnvError(f"environment {spec!r}: importing {module_name!r} failed: {failure(exc)}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise EnvError(f"environment {spec!r}: module {module_name!r} has no {attr!r}")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise EnvError(f"environment {spec!r}: {attr!r} must be a class with reset(seed) and step(action) methods")
    _check_args(cls, spec, args)
    return _bound(cls, args)


def _bound(cls: type, args: dict[str, Any]) -> EnvFactory:
    def factory() -> Environment:
        return cls(**args)

    return factory


def _check_args(cls: type, name: str, args: dict[str, Any]) -> None:
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(args) - set(params))
    if unknown:
        allowed = ", ".join(params) or "none"
        raise EnvError(f"environment {name!r} has no argument {unknown[0]!r}; allowed: {allowed}")


def _try(factory: EnvFactory, name: str) -> None:
    try:
        first, again = first_message(factory, 0), first_message(factory, 0)
    except EnvError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's environment failing its first episode, in one line
        raise EnvError(f"environment {name!r} failed to start an episode: {failure(exc)}") from None
    if not isinstance(first, str):
        raise EnvError(f"environment {name!r}: reset(seed) must return the first user message as a str")
    if again != first:  # a group's episodes, and its prompt, must start alike
        raise EnvError(f"environment {name!r}: reset(0) gave two different first messages; the first message must "
                       "depend on the seed only (a group's episodes share their prompt; later observations may vary)")


def failure(exc: BaseException) -> str:
    """An environment's exception in one line (a message may span several: an error stays one line)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def first_message(factory: EnvFactory, seed: int) -> str:
    """The first user message of episode `seed` (a fresh environment, reset and closed)."""
    env = factory()
    try:
        return env.reset(seed)
    finally:
        close_env(env)


def close_env(env: object) -> None:
    """Call an environment's optional close() (an episode is over: free what it holds). A close() that raises
    is logged: the episode's result stands, and the caller goes on closing the others."""
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - the environment's own failure, in one line
            log.warning("an environment's close() raised: %s", failure(exc))


@dataclass(frozen=True)
class EnvSpec:
    """What a worker needs to play a run's episodes: the environment, its arguments and the budgets.
    The learner sends it with the run's spec (p2p.messages.SpecReply.env)."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8  # model turns per episode
    max_tokens: int = 1024  # tokens after the first prompt: model turns and observations together
    turn_tokens: int = 64  # tokens per model turn (the sampler's max_new_tokens)
    hosted: bool = False  # the learner steps the environment; workers ask it for each observation (envs.episode)

    def to_wire(self) -> dict:
        return {"name": self.name, "args": self.args, "max_turns": self.max_turns, "max_tokens": self.max_tokens,
                "turn_tokens": self.turn_tokens, "hosted": self.hosted}  # fmt: skip

    @classmethod
    def from_wire(cls, msg: dict) -> EnvSpec:
        name, args = msg.get("name"), msg.get("args", {})
        budgets = [msg.get(k) for k in ("max_turns", "max_tokens", "turn_tokens")]
        if not isinstance(name, str) or not 0 < len(name) <= 200 or not isinstance(args, dict):
            raise EnvError("the run's environment spec needs a name (a string) and args (a map)")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 20 for v in budgets):
            raise EnvError("the run's environment spec needs max_turns, max_tokens and turn_tokens in [1, 2^20]")
        if not isinstance(hosted := msg.get("hosted", False), bool):
            raise EnvError("the run's environment spec's hosted must be true or false")
        return cls(name, args, *budgets, hosted)
