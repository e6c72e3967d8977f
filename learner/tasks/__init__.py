"""Procedural, seeded, verifiable tasks. A task makes problems and scores completions.

Every built-in reward function takes any text and returns a float in [0, 1]; it never raises. Whatever a
reward returns (a user's jsonl reward included) is made finite and clamped to +-100 before it is used
(learner.train.grpo.clamp_reward).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Protocol

from envs.calculator import last_integer  # noqa: F401 - the tasks' answer parser too


def step_seed(seed: int, index: int) -> int:
    """A 63-bit seed for step (or prompt group) `index` of a run seeded `seed`, stable across processes."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Problem:
    """A prompt for the policy and the hidden answer the reward checks against."""

    prompt: str
    answer: Any
    tools: tuple[dict, ...] = ()  # JSON schemas of a tool environment's tools, offered in the prompt (envs.tools)


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, completion: str, answer: Any) -> float: ...


class TaskError(ValueError):
    """A task name or argument that cannot be used; the message says what is allowed."""


TASK_NAMES = ("arithmetic", "countdown", "sokoban", "knights-knaves", "jsonl:PATH", "reasoning-gym:NAME")


def make_task(name: str, args: dict[str, Any] | None = None) -> Task:
    """Build a task from its name (see TASK_NAMES) and keyword arguments (its difficulty knobs)."""
    from learner.tasks.arithmetic import ArithmeticTask
    from learner.tasks.countdown import CountdownTask
    from learner.tasks.jsonl import JsonlTask
    from learner.tasks.knights_knaves import KnightsKnavesTask
    from learner.tasks.reasoning_gym_task import ReasoningGymTask
    from learner.tasks.sokoban import SokobanTask

    args = dict(args or {})
    if name.startswith("jsonl:"):
        return JsonlTask(name.removeprefix("jsonl:"), **_checked(JsonlTask, name, args))
    if name.startswith("reasoning-gym:"):  # its generator's own config fields, checked by the generator
        return ReasoningGymTask(name.removeprefix("reasoning-gym:"), **args)
    classes = {
        "arithmetic": ArithmeticTask,
        "countdown": CountdownTask,
        "sokoban": SokobanTask,
        "knights-knaves": KnightsKnavesTask,
    }
    if name not in classes:
        raise TaskError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    return classes[name](**_checked(classes[name], name, args))


def _checked(cls: type, name: str, args: dict[str, Any]) -> dict[str, Any]:
    import inspect

    allowed = [p for p in inspect.signature(cls).parameters if p != "path"]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise TaskError(f"task {name!r} has no argument {unknown[0]!r}; allowed: {', '.join(allowed)}")
    return args
