"""Held-out evaluation: how well the current policy solves problems that training never draws.

On n fixed held-out prompts (learner.tasks.split), one greedy completion and k sampled ones each:

    accuracy    = 1/n sum_i [ r(greedy_i) >= 1 ]
    pass_at_k   = 1/n sum_i [ max_j r(sample_ij) >= 1 ]      (k samples: the unbiased estimator
                                                              1 - C(n-c, k) / C(n, k) with n = k)
    reward_mean = mean of r over the n * k samples

The prompts and the samples' random stream depend only on the run's seed, so every evaluation of a run
(and `echo-rl eval` on its checkpoints) sees the same prompts and draws: differences between versions
are the policy's, not the luck of the draw.

An environment's held-out problems are episode seeds that training never plays (learner.tasks.split); each
is played greedily once and k times sampled (envs.episode.play_episodes), r is the episode's return as the
learner's replay computes it, and `turns_mean` adds the sampled episodes' model turns.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from envs.episode import EpisodeRules
from learner.config import LearnerConfig
from learner.rollout_source import RolloutSource
from learner.tasks import Problem, Task, make_task, step_seed
from learner.tasks.environment import episode_rules
from learner.tasks.split import has_split, split_task
from learner.train.grpo import clamp_reward
from learner.train.models import Policy
from p2p.config import ConfigError
from p2p.messages import Completion, Engine, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

PROMPT_STREAM, SAMPLE_STREAM = -1, -2  # step_seed indices of the evaluation's prompts and draws (steps are >= 1)
MAX_DRAWS_PER_PROMPT = 20  # a small task or file may hold fewer distinct problems than eval_prompts


def eval_task(cfg: LearnerConfig, training_task: Task | None = None) -> Task:
    """The task evaluation draws from: --eval-task's held-out split, else the training task's (`training_task`
    if given, else cfg.task; an environment's task needs the policy: learner.run.environment_task)."""
    if cfg.eval.eval_task:
        return split_task(make_task(cfg.eval.eval_task, cfg.eval.eval_task_args), "held_out")
    task = training_task or make_task(cfg.task.task, cfg.task.task_args)
    if not has_split(task):
        raise ConfigError(
            f"--eval-every: task {task.name!r} has no held-out split (its file is all training data); "
            "pass --eval-task jsonl:EVAL_PATH"
        )
    return split_task(task, "held_out")


def held_out_problems(task: Task, n: int, seed: int) -> list[Problem]:
    """Up to `n` distinct problems of `task`, a function of `seed` alone (fewer if the task has fewer)."""
    rng = random.Random(step_seed(seed, PROMPT_STREAM))
    by_seed = episode_rules(task) is not None  # an environment's episodes differ by seed, not first message
    problems: dict[object, Problem] = {}
    for _ in range(n * MAX_DRAWS_PER_PROMPT):
        problem = task.sample(rng)
        problems.setdefault(problem.answer if by_seed else problem.prompt, problem)
        if len(problems) == n:
            break
    if len(problems) < n:
        log.info("evaluation: the task holds only %d distinct held-out problems (asked for %d)", len(problems), n)
    return list(problems.values())


@dataclass
class Evaluator:
    """A run's held-out set and how to sample it; `evaluate(engine)` scores the engine's current policy.
    A swarm sends `requests()` to a worker as one lease and `score`s what comes back."""

    task: Task
    policy: Policy  # renders prompts, decodes completions
    problems: list[Problem]
    samples: int  # k
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int

    @classmethod
    def for_run(cls, cfg: LearnerConfig, policy: Policy, task: Task | None = None) -> Evaluator:
        """The evaluator of a run: `task` is eval_task(cfg) (made before the model loads, to fail fast)."""
        task = task or eval_task(cfg)
        problems = held_out_problems(task, cfg.eval.eval_prompts, cfg.run.seed)
        sampler = cfg.sampler
        return cls(
            task, policy, problems, cfg.eval.eval_samples, sampler.temperature, sampler.top_p,
            sampler.max_new_tokens, cfg.run.seed,
        )  # fmt: skip

    @property
    def params(self) -> SamplingParams:
        """The samples' parameters; their seed is the run's evaluation stream, the same at every evaluation."""
        return SamplingParams(self.temperature, self.top_p, self.max_new_tokens, step_seed(self.seed, SAMPLE_STREAM))

    @functools.cached_property
    def source(self) -> RolloutSource:
        """The held-out problems' rollouts: completions of a task, or episodes of an environment."""
        return RolloutSource(self.task, self.policy)

    @property
    def episodes(self) -> EpisodeRules | None:
        """An environment's rules (its problems are episodes to play), None for a task."""
        return self.source.episodes

    def requests(self) -> list[GenerationRequest]:
        """One greedy request per prompt, then one of k samples per prompt (group i: prompt i in both; the
        greedy completion is number k, after the samples, so that each episode of a group has its own index)."""
        prompts = [self.source.prompt(p) for p in self.problems]
        pairs = list(enumerate(zip(self.problems, prompts, strict=True)))
        greedy = [self.source.request(p, ids, 1, i, greedy=True, completion=self.samples) for i, (p, ids) in pairs]
        return greedy + [self.source.request(p, ids, self.samples, i) for i, (p, ids) in pairs]

    def evaluate(self, engine: Engine) -> dict:
        """Greedy accuracy, pass@k and mean sampled reward of `engine`'s policy on the held-out prompts."""
        tick = time.perf_counter()
        groups = self.source.generate(engine.generate, self.requests(), self.params)  # greedy at temperature 0
        return {**self.score(groups), "seconds": round(time.perf_counter() - tick, 3)}

    def score(self, groups: Sequence[Sequence[Completion]]) -> dict:
        """The figures of the module docstring from the completions of requests(), in their order."""
        n = len(self.problems)
        greedy, sampled = groups[:n], groups[n:]
        greedy_rewards = [self._rewards(p, g)[0] for p, g in zip(self.problems, greedy, strict=True)]
        sample_rewards = [self._rewards(p, g) for p, g in zip(self.problems, sampled, strict=True)]
        figures = {
            "task": self.task.name,
            "prompts": n,
            "k": self.samples,
            "accuracy": sum(r >= 1.0 for r in greedy_rewards) / n,
            "pass_at_k": sum(max(rs) >= 1.0 for rs in sample_rewards) / n,
            "reward_mean": sum(map(sum, sample_rewards)) / (n * self.samples),
            "greedy_reward_mean": sum(greedy_rewards) / n,
            "greedy_len_mean": sum(len(g[0].tokens) for g in greedy) / n,
        }
        if self.episodes is not None:  # model turns per sampled episode
            figures["turns_mean"] = sum((len(c.spans) + 1) // 2 for g in sampled for c in g) / (n * self.samples)
        return figures

    def _rewards(self, problem: Problem, group: Sequence[Completion]) -> list[float]:
        """Each completion's reward; an episode's: its return as the replay computes it (envs.episode.ReplayError
        for one the environment does not reproduce)."""
        return [clamp_reward(r) for r in self.source.returns(problem, group).values]
