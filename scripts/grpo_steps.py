"""Real GRPO steps for the benchmarks that need trained versions (bench_lora, bench_overlap): the policy
samples its own rollouts with an engine, trains on them, and the engine gets the new weights."""

from __future__ import annotations

import random

from learner.config import GRPOConfig
from learner.orchestrate.rollouts import score_groups
from learner.tasks import make_task
from learner.train.models import Policy, model_spec
from learner.train.trainer import GRPOTrainer
from learner.train.wire_weights import send_to_sampler
from p2p.messages import GenerationRequest, SamplingParams


def train(policy: Policy, engine, steps: int, lr: float, lora: bool, on_step=None) -> None:
    """GRPO steps on rollouts the engine samples from the current policy; on_step(step) after each."""
    spec, task, rng = model_spec(policy), make_task("arithmetic", {"ops": "+", "max_value": 20}), random.Random(0)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=lr, skip_equal_groups=False), temperature=1.0)
    for step in range(1, steps + 1):
        problems = [task.sample(rng) for _ in range(4)]
        prompts = [policy.render_prompt(p.prompt) for p in problems]
        requests = [GenerationRequest(p, 8, k) for k, p in enumerate(prompts)]
        groups = engine.generate(requests, SamplingParams(1.0, 1.0, 48, step))
        trainer.step([r for g in score_groups(task, policy, problems, prompts, groups, step - 1) for r in g])
        send_to_sampler(engine, spec, policy.model, adapters_only=lora)
        if on_step is not None:
            on_step(step)
