"""A multi-turn environment seen as a task: a problem is an episode's seed and its first user message.

The loops draw problems, render prompts and lease groups the same way for tasks and environments, through
learner.rollout_source.RolloutSource: an environment's groups are played (envs.episode.play_episodes)
rather than completed once, and scored by replaying each episode, never by a reward on text.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from envs import EnvError, close_env, failure, first_message
from envs.episode import EpisodeRules
from envs.tools import ToolEnv
from learner.tasks import Problem, Task

START_TRIES = 20  # seeds in a row whose reset() may raise before sampling gives up
log = logging.getLogger(__name__)


@dataclass
class EnvironmentTask:
    """Episodes of `episodes.spec.name`: `sample` draws a 63-bit seed and resets a fresh environment with it."""

    episodes: EpisodeRules
    tools: tuple[dict, ...] = field(init=False)  # a tool environment's tools as JSON schemas, for every prompt

    def __post_init__(self) -> None:
        self.tools = tool_schemas(self.episodes)

    @property
    def name(self) -> str:
        return self.episodes.spec.name

    def sample(self, rng: random.Random) -> Problem:
        """A seed whose episode starts: one whose reset() raises (the environment's bug) is logged and skipped,
        up to START_TRIES in a row."""
        for _ in range(START_TRIES):
            seed = rng.getrandbits(63)
            try:
                return Problem(first_message(self.episodes.make_env, seed), seed, self.tools)
            except Exception as exc:  # noqa: BLE001 - any failure of the environment's own code
                error = failure(exc)
                log.warning("environment %s failed to start episode %d (%s); drawing another", self.name, seed, error)
        raise EnvError(f"environment {self.name!r} failed to start {START_TRIES} episodes in a row, the last: {error}")

    def reward(self, completion: str, answer: Any) -> float:
        raise TypeError("an environment's reward comes from replaying its episodes (envs.episode.replay_episode)")


def tool_schemas(episodes: EpisodeRules) -> tuple[dict, ...]:
    """The JSON schemas of a tool environment's tools (its own, or transformers' reading of each function's
    type hints and Google-style docstring); () for another environment."""
    env = episodes.make_env()
    try:
        if not isinstance(env, ToolEnv):
            return ()
        if (given := env.tool_schemas()) is not None:  # an environment that has its tools' schemas already
            return tuple(given)
        schemas = []
        for tool in env.tools:
            try:
                schemas.append(get_json_schema(tool))
            except Exception as exc:  # noqa: BLE001 - transformers' own exception types, shown in one line
                name = getattr(tool, "__name__", tool)
                raise EnvError(f"environment {episodes.spec.name!r}: tool {name!r} needs type hints and a docstring "
                               f"with an Args section ({failure(exc)})") from None  # fmt: skip
        return tuple(schemas)
    finally:
        close_env(env)


def episode_rules(task: Task) -> EpisodeRules | None:
    """The episode rules of an environment task (also through a train/held-out split), None for a task."""
    return getattr(getattr(task, "task", task), "episodes", None)
