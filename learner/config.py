"""Typed configuration of a training run: one dataclass per component, one documented line per field.

A TOML file has one table per component ([run], [model], [task], [env], [grpo], [sampler], [swarm], [eval]);
every field is also a CLI flag of the same name with dashes (`grpo.group_size` -> `--group-size`), see
echo_cli.config.
Each field's docstring is its help text. Every default runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from learner.swarm_config import SwarmConfig
from p2p.config import require

DEVICE_NAMES = re.compile(r"auto|cpu|cuda(:\d+)?")  # what --device accepts (learner.train.devices)


@dataclass
class RunConfig:
    """Where the run lives and how long it lasts."""

    run_dir: str = "runs/latest"
    """Folder for metrics.jsonl, checkpoints and the worker's converted weights."""
    steps: int = 100
    """Optimizer steps to train in total (a resumed run counts the steps already done)."""
    seed: int = 0
    """Seed of prompt selection, sampling and model initialisation."""
    checkpoint_every: int = 10
    """Write a checkpoint every this many steps (and always after the last step)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep on disk."""
    tensorboard: bool = False
    """Also log every step's scalar metrics to RUN_DIR/tensorboard (needs `pip install tensorboard`)."""
    wandb: bool = False
    """Also log them to Weights & Biases: online if logged in, else offline in RUN_DIR/wandb (echo-rl[wandb])."""
    trackio: bool = False
    """Also log them to trackio's local database; `trackio show` displays them (echo-rl[trackio])."""
    project: str = "echo-rl"
    """The W&B / trackio project the run is logged under (the run is named after RUN_DIR)."""

    def validate(self) -> None:
        require(self.steps >= 1, "run.steps", f"must be >= 1, got {self.steps}")
        require(self.checkpoint_every >= 1, "run.checkpoint_every", f"must be >= 1, got {self.checkpoint_every}")
        require(self.keep_checkpoints >= 1, "run.keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        require(bool(self.run_dir), "run.run_dir", "must not be empty")


@dataclass
class ModelConfig:
    """Which policy to train."""

    model: str = "smollm2-135m"
    """`smollm2-135m` (bundled), `tiny` (random 2-layer Llama for tests), or a local HF folder or GGUF file."""
    cache_dir: str = "~/.cache/echo-rl"
    """Where converted model weights are cached between runs."""
    lora_rank: int = 0
    """Train rank-r LoRA adapters on every projection, base frozen (0 = all weights); versions ship adapters only."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) * B A to its weight."""
    device: str = "auto"
    """Where the policy, its batches, the KL reference and the verifier live: auto (cuda if any), cpu, cuda, cuda:N."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: matmuls in bfloat16 (autocast; FSDP2 mixed precision with several ranks), fp32 weights and AdamW."""
    grad_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory for about a third more compute."""

    def validate(self) -> None:
        require(bool(self.model), "model.model", "must not be empty")
        require(
            DEVICE_NAMES.fullmatch(self.device) is not None,
            "model.device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(self.lora_rank >= 0, "model.lora_rank", f"must be >= 0 (0 trains all weights), got {self.lora_rank}")
        require(self.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {self.lora_alpha}")


@dataclass
class TaskConfig:
    """What the policy learns to do."""

    task: str = "arithmetic"
    """arithmetic, countdown, sokoban, knights-knaves, or jsonl:PATH."""
    task_args: dict = field(default_factory=dict)
    """Task knobs, e.g. {max_value = 50} in TOML or --task-args max_value=50 (see each task's docstring)."""

    def validate(self) -> None:
        require(bool(self.task), "task.task", "must not be empty")


@dataclass
class EnvConfig:
    """A multi-turn environment to train on instead of the single-turn task (envs, docs/environments.md)."""

    env: str = ""
    """"" (train on --task), a built-in (sokoban, calculator, ...), module:Class (your own), verifiers:MODULE or
    openenv:URL (docs/environments.md)."""
    env_args: dict = field(default_factory=dict)
    """Environment knobs, e.g. {digits = 3} in TOML or --env-args digits=3 (see each environment's docstring)."""
    max_turns: int = 6
    """Model turns per episode at most; each samples up to sampler.max_new_tokens tokens."""
    max_episode_tokens: int = 512
    """Tokens per episode after its first prompt at most: the model's turns and the observations together."""
    env_host: Literal["worker", "learner"] = "worker"
    """Who steps the environment: each worker (the learner replays every episode: it must be deterministic), or
    the learner, asked by workers for every observation (any environment; one round trip per turn)."""

    def validate(self) -> None:
        require(self.max_turns >= 1, "env.max_turns", f"must be >= 1, got {self.max_turns}")
        require(self.max_episode_tokens >= 2, "env.max_episode_tokens", f"must be >= 2, got {self.max_episode_tokens}")
        require(not self.env_args or bool(self.env), "env.env_args", "needs --env (the environment they configure)")
        require(self.env_host == "worker" or bool(self.env), "env.env_host", "needs --env (the environment hosted)")


@dataclass
class GRPOConfig:
    """The GRPO objective and optimizer (docs/design.md §4)."""

    prompts_per_step: int = 4
    """Prompts per optimizer step; each is completed group_size times."""
    group_size: int = 8
    """Completions per prompt (G); advantages are normalised within a group."""
    lr: float = 5e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    eps_low: float = 0.2
    """Lower clip of the ratio: clip(ratio, 1 - eps_low, 1 + eps_high)."""
    eps_high: float = 0.28
    """Upper clip of the ratio."""
    ratio_cap: float = 3.0
    """behaviour: the dual clip (no gradient for a token with A < 0 and a ratio above it); tis, mis: the cap."""
    objective: Literal["behaviour", "decoupled", "gspo", "cispo"] = "behaviour"
    """behaviour: dual-clip PPO on pi/mu; decoupled, gspo, cispo: ratio to the learner's own policy (§4)."""
    correction: Literal["tis", "mis", "icepop", "seq_mask", "none"] = "tis"
    """decoupled/gspo/cispo: each token's weight from rho = pi_prox/mu; behaviour ignores it (§4)."""
    mismatch_low: float = 0.5
    """icepop: tokens with rho below this are dropped; seq_mask: the same for a sequence's geometric mean."""
    mismatch_high: float = 2.0
    """icepop: tokens with rho above this are dropped; seq_mask: the same for a sequence's geometric mean."""
    minibatches: int = 1
    """Optimizer updates per step, each on its share of the batch (decoupled/gspo/cispo clip from the 2nd)."""
    beta: float = 0.0
    """Weight of the KL penalty to the initial policy (0 = no reference model kept)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    loss_norm: Literal["token", "sequence", "constant"] = "token"
    """token: each token weighs the same (DAPO); sequence: each completion; constant: 1/(n L), Dr. GRPO."""
    advantage_std: bool = True
    """Divide advantages by their group's reward std (GRPO); false: A = r - mean(r) (Dr. GRPO)."""
    skip_equal_groups: bool = True
    """Skip groups whose rewards are all equal (they carry no signal) instead of computing their zero gradient."""
    micro_batch_tokens: int = 4096
    """Padded tokens per forward/backward pass; bounds memory."""
    dynamic_sampling: bool = True
    """Each step trains on prompts_per_step groups with signal: equal-reward ones are set aside and replaced (DAPO)."""
    sampling_rounds: int = 4
    """With dynamic sampling, after this many batches' worth of groups train on whatever signal was found."""

    def corrects_sampler(self) -> bool:
        """Whether the objective weighs tokens for the sampler's mismatch (what 4-bit workers need, §4)."""
        return self.objective != "behaviour" and self.correction != "none"

    def validate(self) -> None:
        require(self.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1")
        require(
            self.group_size >= 2,
            "grpo.group_size",
            f"must be >= 2 (advantages compare completions), got {self.group_size}",
        )
        require(self.lr > 0, "grpo.lr", f"must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, "grpo.weight_decay", "must be >= 0")
        require(0 <= self.eps_low < 1, "grpo.eps_low", f"must be in [0, 1), got {self.eps_low}")
        require(self.eps_high >= 0, "grpo.eps_high", f"must be >= 0, got {self.eps_high}")
        require(self.ratio_cap >= 1 + self.eps_high, "grpo.ratio_cap", "must be >= 1 + eps_high")
        require(self.minibatches >= 1, "grpo.minibatches", f"must be >= 1, got {self.minibatches}")
        require(
            self.objective != "decoupled" or self.minibatches >= 2,
            "grpo.minibatches",
            "must be >= 2 with objective = decoupled: its clip to the learner's own policy binds only from the "
            "second update of a step (e.g. --minibatches 4)",
        )
        require(
            self.objective != "behaviour" or self.correction == "tis",
            "grpo.correction",
            f"{self.correction} needs an objective whose ratio is to the learner's own policy (--objective "
            "decoupled, gspo or cispo): behaviour's ratio pi/mu carries the sampler's mismatch itself",
        )
        require(
            0 < self.mismatch_low < 1 < self.mismatch_high,
            "grpo.mismatch_low",
            f"need 0 < mismatch_low < 1 < mismatch_high, got {self.mismatch_low} and {self.mismatch_high}",
        )
        require(self.beta >= 0, "grpo.beta", f"must be >= 0, got {self.beta}")
        require(self.max_grad_norm > 0, "grpo.max_grad_norm", "must be > 0")
        require(self.micro_batch_tokens >= 64, "grpo.micro_batch_tokens", "must be >= 64")
        require(self.sampling_rounds >= 1, "grpo.sampling_rounds", f"must be >= 1, got {self.sampling_rounds}")


@dataclass
class SamplerConfig:
    """How rollouts are generated."""

    engine: Literal["llamacpp", "transformers"] = "llamacpp"
    """Inference engine: llama.cpp (fast, F16 GGUF) or transformers (reference)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the trainer scores tokens at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; behaviour logprobs are those of the truncated distribution."""
    max_new_tokens: int = 64
    """Completion length limit in tokens."""
    threads: int = 2
    """CPU threads for generation."""
    max_batch: int = 32
    """Sequences decoded together (must be >= group_size)."""
    gpu_layers: int = -1
    """Co-located llama.cpp: layers offloaded to the GPU (-1: all when llama.cpp has a GPU backend, else 0)."""

    def validate(self) -> None:
        require(self.temperature > 0, "sampler.temperature", f"must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "sampler.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens >= 1, "sampler.max_new_tokens", "must be >= 1")
        require(self.threads >= 1, "sampler.threads", "must be >= 1")
        require(self.max_batch >= 1, "sampler.max_batch", "must be >= 1")
        require(self.gpu_layers >= -1, "sampler.gpu_layers", f"must be >= -1 (-1: all), got {self.gpu_layers}")


@dataclass
class EvalConfig:
    """Evaluation on held-out problems during training (learner.evaluation)."""

    eval_every: int = 0
    """Evaluate the policy every this many steps, before training and after the last step too (0 = never)."""
    eval_task: str = ""
    """Task to evaluate on: "" (the training task's held-out split), another generated task's, or jsonl:PATH."""
    eval_task_args: dict = field(default_factory=dict)
    """Knobs of --eval-task (e.g. max_value=99 to test beyond the training range); "" eval task: the training task's."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation, the same ones every time."""
    eval_samples: int = 4
    """k of pass@k: completions sampled per prompt at the sampler's temperature (besides one greedy completion)."""

    def validate(self) -> None:
        require(self.eval_every >= 0, "eval.eval_every", f"must be >= 0 (0: no evaluation), got {self.eval_every}")
        require(self.eval_prompts >= 1, "eval.eval_prompts", f"must be >= 1, got {self.eval_prompts}")
        require(self.eval_samples >= 1, "eval.eval_samples", f"must be >= 1, got {self.eval_samples}")
        require(
            not self.eval_task_args or bool(self.eval_task),
            "eval.eval_task_args",
            "needs --eval-task (the training task's held-out split uses the training task's args)",
        )


@dataclass
class LearnerConfig:
    """A whole training run: one table per component."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        for section in (self.run, self.model, self.task, self.env, self.grpo, self.sampler, self.swarm, self.eval):
            section.validate()
        require(
            not (self.env.env and self.eval.eval_task),
            "eval.eval_task",
            "an environment is evaluated on its own held-out seeds: leave --eval-task out with --env",
        )
        require(
            self.sampler.max_batch >= self.grpo.group_size,
            "sampler.max_batch",
            f"must be >= grpo.group_size ({self.grpo.group_size}), got {self.sampler.max_batch}",
        )
