"""The primitives of a scripted experiment, named after the Tinker SDK's, running in this process.

    client = TrainingClient(cfg)                           # the policy, its optimizer, a sampler (co-located)
    sampler = client.save_weights_and_get_sampling_client()
    samples = sampler.sample(prompts, num_samples=8)       # completions with behaviour logprobs
    rollouts = client.score(problems, samples)             # rewards by the task, group-normalised advantages
    client.forward_backward(rollouts)                      # the GRPO loss's gradient, accumulated
    client.optim_step()                                    # one AdamW step

Unlike Tinker's, calls are synchronous (no futures) and the sampler holds one version: a SamplingClient
whose weights were replaced by a newer save refuses to sample rather than sample from the wrong policy.
SwarmTrainingClient has the same loop with a swarm as the sampler: save_weights_for_sampler() publishes a
version to the workers, sample() returns a batch of the task's rollouts they generated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from learner.config import LearnerConfig
from learner.orchestrate.rollouts import Rollout, score_groups
from learner.run import open_run
from learner.tasks import Problem, Task
from learner.train.checkpoint import save_checkpoint
from learner.train.models import model_spec
from learner.train.wire_weights import send_to_sampler
from p2p.config import ConfigError
from p2p.messages import GenerationRequest, SamplingParams
from worker.engines import sampler_engine


@dataclass
class Sample:
    """One sampled completion: its prompt's token ids, its tokens with their behaviour logprobs, its text."""

    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]  # log mu of each token under the distribution it was drawn from
    text: str
    spans: list[int] = field(default_factory=list)  # one completion (score_groups reads it as an episode's turns)


class _Optimizer:
    """What both clients share: a run directory of `cfg`, its GRPO trainer, the optimizer steps taken."""

    def __init__(self, cfg: LearnerConfig, task: Task | None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.run = open_run(cfg, resume=False, task=task)
        self.policy, self.trainer, self.task = self.run.policy, self.run.trainer, self.run.task
        self.step = 0  # optimizer steps taken

    def forward_backward(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """Add the GRPO loss's gradient on `rollouts` to the accumulated gradient (learner.train.trainer)."""
        return self.trainer.forward_backward(list(rollouts))

    def optim_step(self) -> dict[str, float]:
        """Clip the accumulated gradient and take one optimizer step with it."""
        self.step += 1
        return self.trainer.optim_step()

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


class TrainingClient(_Optimizer):
    """A policy being trained in this process: the run directory of `cfg` (metrics, checkpoints), the GRPO
    trainer and a sampler engine that holds the weights last saved for sampling."""

    def __init__(self, cfg: LearnerConfig, task: Task | None = None) -> None:
        super().__init__(cfg, task)
        self.spec = model_spec(self.policy)
        self.engine = sampler_engine(cfg.sampler, cfg.model.device, self.run.run_dir / "sampler")
        send_to_sampler(self.engine, self.spec, self.policy.model)
        self.sampler_step = self.step  # the step whose weights the sampler holds

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Load the current weights into the sampler (a LoRA run: only its adapters) and sample from them."""
        if self.step != self.sampler_step:
            send_to_sampler(self.engine, self.spec, self.policy.model, adapters_only=bool(self.policy.lora_rank))
            self.sampler_step = self.step
        return SamplingClient(self, self.step)

    def score(self, problems: Sequence[Problem], groups: Sequence[Sequence[Sample]]) -> list[Rollout]:
        """The rollouts to train on: each sample's reward by the task, advantages normalised per group."""
        prompts = [group[0].prompt_ids for group in groups]
        scored = score_groups(
            self.task, self.policy, list(problems), prompts, [list(g) for g in groups], self.step,
            self.cfg.grpo.advantage_std,
        )  # fmt: skip
        return [r for group in scored for r in group]


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


class SwarmTrainingClient(_Optimizer):
    """A scripted experiment that samples through a swarm: the weights it publishes reach workers by the
    peer-assisted broadcast; workers generate rollouts for its task's prompts, which it leases, verifies and
    scores as `echo-rl learner start` does; it trains on them with forward_backward and optim_step.

    Workers join `address` (`echo-rl worker join --learner ADDRESS`, also written to RUN_DIR/learner.addr).
    Use it in a `with` block, or call close(): it stops serving the swarm."""

    def __init__(self, cfg: LearnerConfig, task: Task | None = None) -> None:
        from learner.swarm_side import start_swarm

        if cfg.eval.eval_every:
            raise ConfigError(
                "SwarmTrainingClient does not evaluate during training: set cfg.eval.eval_every = 0 and run "
                "`echo-rl eval` on the checkpoints save_state() writes"
            )
        super().__init__(cfg, task)
        self.swarm = start_swarm(cfg, self.run, resume=False)
        self.address = self.swarm.host.addrs[0]
        self.published = -1  # the newest version published
        self._stepped = time.monotonic()  # when the last optimizer step ended (the scheduler's step time)
        self._sampled = self._stepped
        self.swarm.service.advance(0)
        self.save_weights_for_sampler()

    def save_weights_for_sampler(self) -> int:
        """Publish the current weights as version `step` (signed, chunked, seeded to the workers, who lease with
        it from now on) and return that version."""
        if self.published != self.step:
            self.swarm.publish(self.step, self.swarm.snapshot())
            self.published = self.step
        return self.step

    def sample(self, timeout_s: float = 600.0) -> list[Rollout]:
        """The rollouts of one batch: grpo.prompts_per_step groups of grpo.group_size completions that workers
        generated within the staleness bound (with dynamic sampling: groups whose rewards differ), verified
        and scored here. TimeoutError if they do not come within `timeout_s` (are workers joined?)."""
        service = self.swarm.service
        service.waiting_for_batch()
        deadline = time.monotonic() + timeout_s
        taken = None
        while taken is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch from the swarm within {timeout_s:.0f} s: workers join {self.address}")
            taken = service.buffer.take(self.cfg.grpo.prompts_per_step, self.step, timeout=1.0)
            service.leases.expire()
        batch, set_aside = taken
        self.swarm.journal.step(self.step + 1, batch, set_aside)
        self._sampled = time.monotonic()
        return [r for group in batch for r in group.rollouts]

    def optim_step(self) -> dict[str, float]:
        """One optimizer step (see forward_backward); the swarm's leases are measured against the new version."""
        stats = super().optim_step()
        now = time.monotonic()
        service = self.swarm.service
        service.advance(self.step)
        service.schedule(self.step, now - self._sampled, now - self._stepped, trained=not stats["skipped"])
        self._stepped = now
        return stats

    def close(self) -> None:
        self.swarm.close()
        self.run.close()

    def __enter__(self) -> SwarmTrainingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
