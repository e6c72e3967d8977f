"""A multi-turn environment seen as a task: a problem is an episode's seed and its first user message.

The loops draw problems, render prompts and lease groups the same way for tasks and environments; what
differs is that an environment's groups are played (envs.episode.play_episodes) rather than completed once,
and scored by replaying each episode (learner.orchestrate.rollouts.score_groups), never by a reward on text.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from envs import EnvError, failure, first_message
from envs.episode import EpisodeRules
from learner.tasks import Problem, Task

START_TRIES = 20  # seeds in a row whose reset() may raise before sampling gives up
log = logging.getLogger(__name__)


@dataclass
class EnvironmentTask:
    """Episodes of `episodes.spec.name`: `sample` draws a 63-bit seed and resets a fresh environment with it."""

    episodes: EpisodeRules

    @property
    def name(self) -> str:
        return self.episodes.spec.name

    def sample(self, rng: random.Random) -> Problem:
        """A seed whose episode starts: one whose reset() raises (the environment's bug) is logged and skipped,
        up to START_TRIES in a row."""
        for _ in range(START_TRIES):
            seed = rng.getrandbits(63)
            try:
                return Problem(first_message(self.episodes.make_env, seed), seed)
            except Exception as exc:  # noqa: BLE001 - any failure of the environment's own code
                error = failure(exc)
                log.warning("environment %s failed to start episode %d (%s); drawing another", self.name, seed, error)
        raise EnvError(f"environment {self.name!r} failed to start {START_TRIES} episodes in a row, the last: {error}")

    def reward(self, completion: str, answer: Any) -> float:
        raise TypeError("an environment's reward comes from replaying its episodes (envs.episode.replay_episode)")


def episode_rules(task: Task) -> EpisodeRules | None:
    """The episode rules of an environment task (also through a train/held-out split), None for a task."""
    return getattr(getattr(task, "task", task), "episodes", None)
