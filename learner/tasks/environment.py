"""A multi-turn environment seen as a task: a problem is an episode's seed and its first user message.

The loops draw problems, render prompts and lease groups the same way for tasks and environments; what
differs is that an environment's groups are played (envs.episode.play_episodes) rather than completed once,
and scored by replaying each episode (learner.orchestrate.rollouts.score_groups), never by a reward on text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from envs import first_message
from envs.episode import EpisodeRules
from learner.tasks import Problem, Task


@dataclass
class EnvironmentTask:
    """Episodes of `episodes.spec.name`: `sample` draws a 63-bit seed and resets a fresh environment with it."""

    episodes: EpisodeRules

    @property
    def name(self) -> str:
        return self.episodes.spec.name

    def sample(self, rng: random.Random) -> Problem:
        seed = rng.getrandbits(63)
        return Problem(first_message(self.episodes.make_env, seed), seed)

    def reward(self, completion: str, answer: Any) -> float:
        raise TypeError("an environment's reward comes from replaying its episodes (envs.episode.replay_episode)")


def episode_rules(task: Task) -> EpisodeRules | None:
    """The episode rules of an environment task (also through a train/held-out split), None for a task."""
    return getattr(getattr(task, "task", task), "episodes", None)
