"""From sampled completions to scored, advantage-weighted rollouts (rewards are computed here, never
trusted from a worker)."""

from __future__ import annotations

import torch

from learner.grpo import clamp_reward, group_advantages
from learner.models import Policy
from learner.tasks import Problem, Task
from learner.trainer import Rollout
from p2p.messages import Completion


def score_groups(
    task: Task,
    policy: Policy,
    problems: list[Problem],
    prompts: list[list[int]],
    groups: list[list[Completion]],
    version: int,
) -> list[list[Rollout]]:
    """Score every completion with the task's reward and attach group-normalised advantages."""
    scored = []
    for problem, prompt_ids, group in zip(problems, prompts, groups, strict=True):
        # any reward function's value, made safe to normalise: non-finite scores 0, clamped to +-REWARD_LIMIT
        rewards = [clamp_reward(task.reward(policy.decode(c.tokens), problem.answer)) for c in group]
        advantages = group_advantages(torch.tensor([rewards], dtype=torch.float64))[0].tolist()
        scored.append(
            [
                Rollout(prompt_ids, c.tokens, c.logprobs, reward, advantage, version)
                for c, reward, advantage in zip(group, rewards, advantages, strict=True)
            ]
        )
    return scored
