"""The primitives of a scripted experiment, named after the Tinker SDK's, running in this process.

    client = TrainingClient(cfg)                           # the policy, its optimizer, a sampler (co-located)
    sampler = client.save_weights_and_get_sampling_client()
    samples = sampler.sample(prompts, num_samples=8)       # completions with behaviour logprobs
    rollouts = client.score(problems, samples)             # rewards by the task, group-normalised advantages
    client.forward_backward(rollouts)                      # the GRPO loss's gradient, accumulated
    client.optim_step()                                    # one AdamW step

Unlike Tinker's, calls are synchronous (no futures) and the sampler holds one version: a SamplingClient
whose weights were replaced by a newer save refuses to sample rather than sample from the wrong policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from learner.config import LearnerConfig
from learner.orchestrate.rollouts import Rollout, score_groups
from learner.run import open_run
from learner.tasks import Problem, Task
from learner.train.checkpoint import save_checkpoint
from learner.train.models import model_spec
from learner.train.wire_weights import wire_tensors
from p2p.messages import GenerationRequest, SamplingParams


@dataclass
class Sample:
    """One sampled completion: its prompt's token ids, its tokens with their behaviour logprobs, its text."""

    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]  # log mu of each token under the distribution it was drawn from
    text: str


class TrainingClient:
    """A policy being trained in this process: the run directory of `cfg` (metrics, checkpoints), the GRPO
    trainer and a sampler engine that holds the weights last saved for sampling."""

    def __init__(self, cfg: LearnerConfig, task: Task | None = None, resume: bool = False) -> None:
        from echo_cli.research import sampler_engine

        cfg.validate()
        self.cfg = cfg
        self.run = open_run(cfg, resume, task=task)
        self.policy, self.trainer, self.task = self.run.policy, self.run.trainer, self.run.task
        self.spec = model_spec(self.policy)
        self.engine = sampler_engine(cfg, self.run.run_dir / "sampler")
        self.engine.load_policy(self.spec, wire_tensors(self.policy.model))
        self.step = self.run.start_step  # optimizer steps taken
        self.sampler_step = self.step  # the step whose weights the sampler holds

    def forward_backward(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Add the GRPO loss's gradient on `rollouts` to the accumulated gradient (learner.train.trainer)."""
        return self.trainer.forward_backward(list(rollouts))

    def optim_step(self) -> dict[str, float]:
        """Clip the accumulated gradient and take one optimizer step with it."""
        self.step += 1
        return self.trainer.optim_step()

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Load the current weights into the sampler (a LoRA run: only its adapters) and sample from them."""
        if self.step != self.sampler_step:
            if self.policy.lora_rank:
                self.engine.load_adapters(self.spec, wire_tensors(self.policy.model, adapter_only=True))
            else:
                self.engine.load_policy(self.spec, wire_tensors(self.policy.model))
            self.sampler_step = self.step
        return SamplingClient(self, self.step)

    def score(self, problems: Sequence[Problem], groups: Sequence[Sequence[Sample]]) -> list[Rollout]:
        """The rollouts to train on: each sample's reward by the task, advantages normalised per group."""
        prompts = [group[0].prompt_ids for group in groups]
        scored = score_groups(self.task, self.policy, list(problems), prompts, [list(g) for g in groups], self.step)
        return [r for group in scored for r in group]

    def save_state(self) -> Path:
        """A checkpoint of the weights and optimizer in RUN_DIR/checkpoints, which `echo-rl eval`, `export` and
        `learner start --resume` read."""
        state = {"wall_s": 0.0, "config": dataclasses.asdict(self.cfg)}
        path = save_checkpoint(
            self.run.run_dir, self.step, self.policy.model, self.trainer.optimizer, state,
            self.cfg.run.keep_checkpoints,
        )  # fmt: skip
        assert path is not None  # one process: it is the leader
        return path


class SamplingClient:
    """Samples from the weights a TrainingClient saved at step `step`."""

    def __init__(self, client: TrainingClient, step: int) -> None:
        self.client, self.step = client, step

    def sample(
        self, prompts: Sequence[str | list[int]], num_samples: int = 1, temperature: float | None = None,
        max_tokens: int | None = None, top_p: float | None = None, seed: int = 0,
    ) -> list[list[Sample]]:  # fmt: skip
        """`num_samples` completions of each prompt (a user message, rendered with the chat template, or token
        ids as they are); temperature 0 is greedy. Defaults: the config's [sampler]. Same seed, same samples."""
        client = self.client
        if client.sampler_step != self.step:
            raise RuntimeError(
                f"this sampling client holds step {self.step}'s weights, replaced by step {client.sampler_step}'s: "
                "sample from the client save_weights_and_get_sampling_client() returned last"
            )
        sampler = client.cfg.sampler
        ids = [client.policy.render_prompt(p) if isinstance(p, str) else list(p) for p in prompts]
        params = SamplingParams(
            sampler.temperature if temperature is None else temperature,
            sampler.top_p if top_p is None else top_p,
            max_tokens or sampler.max_new_tokens,
            seed,
        )
        groups = client.engine.generate([GenerationRequest(p, num_samples, k) for k, p in enumerate(ids)], params)
        decode = client.policy.decode
        return [
            [Sample(p, c.tokens, c.logprobs, decode(c.tokens)) for c in group]
            for p, group in zip(ids, groups, strict=True)
        ]
