"""One rollout source under both loops: what the learner samples from, a task or a multi-turn environment.

The co-located loop, the swarm's prompt book and intake, held-out evaluation and the Python API go through
these methods and never ask which kind they have:

    prompt(problem)                          -> the first prompt's tokens (with a tool environment's tools)
    request(problem, prompt, G, group, ...)  -> what an engine is asked (an environment's: with the seed)
    generate(generate, requests, params)     -> the groups (envs.episode.generate_rollouts: completed once,
                                                or played as episodes turn by turn)
    returns(problem, group)                  -> each rollout's return: the task's reward of its text, or the
                                                environment's return as the learner's replay computes it

Workers hold the other half: generate_rollouts with the run's episode rules (SpecReply.env) or none.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from envs.episode import EpisodeRules, Generate, Replayed, generate_rollouts, replay_episode
from learner.tasks import Problem, Task
from learner.tasks.environment import episode_rules
from learner.train.models import Policy
from p2p.messages import Completion, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Returns:
    """A group's returns, and which of its episodes the environment raised in (then every return counts 0: a
    bug of the environment teaches nothing)."""

    values: list[float]
    failed: list[bool]


@dataclass(frozen=True)
class RolloutSource:
    """`task`'s rollouts sampled from `policy` (see the module docstring)."""

    task: Task
    policy: Policy

    @functools.cached_property
    def episodes(self) -> EpisodeRules | None:
        """An environment's episode rules (workers get them with the model spec), None for a task."""
        return episode_rules(self.task)

    def prompt(self, problem: Problem) -> list[int]:
        return self.policy.render_prompt(problem.prompt, problem.tools)

    def request(
        self, problem: Problem, prompt_ids: list[int], group_size: int, group: int, greedy: bool = False,
        completion: int = 0,
    ) -> GenerationRequest:
        episode = problem.answer if self.episodes is not None else None  # an environment's problem is a seed
        return GenerationRequest(prompt_ids, group_size, group, greedy=greedy, completion=completion, episode=episode)

    def generate(
        self, generate: Generate, requests: Sequence[GenerationRequest], params: SamplingParams
    ) -> list[list[Completion]]:
        return generate_rollouts(generate, requests, params, self.episodes)

    def returns(self, problem: Problem, group: Sequence[Completion]) -> Returns:
        """The group's returns; an episode its environment does not reproduce raises envs.episode.ReplayError.
        A hosted environment's episodes are not replayed: their records are the learner's own, played here or
        checked against what it hosted before they are scored (learner.orchestrate.hosting.EpisodeHost.check)."""
        if self.episodes is None:
            rewards = [self.task.reward(self.policy.response(c.tokens), problem.answer) for c in group]
            return Returns(rewards, [False] * len(group))
        if self.episodes.spec.hosted:
            replayed = [Replayed(c.reward or 0.0, 0, 0, 0, "raised" if c.finish_reason == "error" else None)
                        for c in group]  # fmt: skip
        else:
            replayed = [replay_episode(c, problem.answer, self.episodes) for c in group]
        failed = [r.error is not None for r in replayed]
        if any(failed):
            error = next(r.error for r in replayed if r.error)
            log.warning("environment %s raised in an episode of seed %d (%s): its group trains on nothing",
                        self.episodes.spec.name, problem.answer, error)  # fmt: skip
            return Returns([0.0] * len(group), failed)
        return Returns([r.reward for r in replayed], failed)
