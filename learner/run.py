"""What every training loop shares: opening (or resuming) a run directory, and recording a step.

RUN_DIR/metrics.jsonl gets one JSON object per step, written before the step's checkpoint: a crash in
between leaves only lines that --resume trims. RUN_DIR/config.json holds the run's configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from envs import EnvFactory, EnvSpec, make_env
from envs.episode import EpisodeRules
from learner.config import LearnerConfig
from learner.evaluation import Evaluator, eval_task
from learner.orchestrate.rollouts import Rollout, has_signal
from learner.tasks import Task, make_task
from learner.tasks.environment import EnvironmentTask
from learner.tasks.split import split_task
from learner.tracking import Trackers
from learner.train.checkpoint import list_checkpoints, load_trainer_state, load_weights, save_checkpoint
from learner.train.data_parallel import World, shard
from learner.train.devices import (
    bound_heap_growth,
    current_gib,
    describe_device,
    enable_grad_checkpointing,
    give_back_freed_memory,
    peak_memory,
    resolve_device,
    training_state_gib,
)
from learner.train.models import Policy, chat_format, load_run_policy, model_spec
from learner.train.trainer import GRPOTrainer, completion_logprobs, frozen_copy
from learner.train.wire_weights import send_to_sampler
from p2p.config import ConfigError
from p2p.messages import Engine, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Run:
    """An open run: its policy, task and trainer, and where it resumes."""

    cfg: LearnerConfig
    run_dir: Path
    policy: Policy
    task: Task
    trainer: GRPOTrainer
    start_step: int
    wall_offset: float  # seconds of wall time before this process (resumed runs)
    trackers: Trackers | None = None  # TensorBoard, W&B, trackio, as configured (rank 0 only)
    world: World = World()  # several training ranks: rank 0 writes metrics and checkpoints

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def record(self, step: int, record: dict | None) -> bool:
        """Append a step's metrics (rank 0's `record`), then checkpoint if it is time (every rank calls
        this: the checkpoint gathers the sharded state). Returns whether a checkpoint was written."""
        if self.world.leader:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.trackers is not None and record is not None:
            self.trackers.log(step, record)
        if step % self.cfg.run.checkpoint_every == 0 or step == self.cfg.run.steps:
            tick = time.perf_counter()
            state = {"wall_s": record["wall_s"] if record else 0.0, "config": dataclasses.asdict(self.cfg)}
            path = save_checkpoint(
                self.run_dir, step, self.policy.model, self.trainer.optimizer, state,
                self.cfg.run.keep_checkpoints, self.world,
            )  # fmt: skip
            if path is not None:
                log.info("checkpoint %s written in %.1fs", path, time.perf_counter() - tick)
            return True
        return False

    def close(self) -> None:
        """End the trackers (a W&B or trackio run is finished; its files are complete)."""
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def open_run(cfg: LearnerConfig, resume: bool, world: World | None = None, task: Task | None = None) -> Run:
    """Load the policy and task onto this rank's device; on --resume restore the newest checkpoint. Never
    overwrites a run. With several ranks the model is sharded (learner.train.data_parallel) after its
    weights are loaded. `world`: this process's rank and device (one process on --device if None). `task`:
    a task object (the Python API's) instead of cfg.task."""
    world = world or World(device=resolve_device(cfg.model.device))
    torch.set_flush_denormal(True)
    bound_heap_growth(saving_memory=cfg.model.grad_checkpointing)
    run_dir = Path(cfg.run.run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    checkpoints = list_checkpoints(run_dir)
    if resume and not checkpoints:
        raise ConfigError(f"--resume: no checkpoint in {run_dir}/checkpoints; start without --resume")
    if not resume and (checkpoints or metrics_path.exists()):
        raise ConfigError(f"{run_dir} already holds a run: pass --resume to continue it or choose another --run-dir")
    if cfg.env.env and task is not None:
        raise ConfigError(f"a task object and --env {cfg.env.env} were both given: train on one of them")
    envs = make_env(cfg.env.env, cfg.env.env_args) if cfg.env.env else None  # a bad one fails before the model loads
    run_dir.mkdir(parents=True, exist_ok=True)

    policy = load_run_policy(cfg.model, cfg.run.seed)
    policy.model.to(world.device)
    if envs is not None:
        task = environment_task(cfg, policy, envs)
    # the held-out problems (an environment's held-out seeds) are evaluation's
    task = split_task(task or make_task(cfg.task.task, cfg.task.task_args), "train")
    if world.size > 1 and cfg.grpo.beta > 0:
        raise ConfigError("grpo.beta > 0 (a reference model) is not supported with several ranks yet: use beta = 0")
    # the KL anchor is the initial policy, so it is copied before a checkpoint's weights are loaded
    reference = frozen_copy(policy.model) if cfg.grpo.beta > 0 else None
    start_step, wall_offset = 0, 0.0
    if resume:
        saved = json.loads((checkpoints[-1] / "state.json").read_text())["config"]["model"]
        if saved["model"] != cfg.model.model:
            raise ConfigError(f"--model {cfg.model.model!r} differs from the checkpoint's {saved['model']!r}")
        if saved.get("lora_rank", 0) != cfg.model.lora_rank:
            raise ConfigError(
                f"--lora-rank {cfg.model.lora_rank} differs from the checkpoint's {saved.get('lora_rank', 0)}: "
                "resume with the same rank"
            )
        state = load_weights(checkpoints[-1], policy.model)
        start_step, wall_offset = state["step"], state["wall_s"]
    if cfg.model.grad_checkpointing:
        enable_grad_checkpointing(policy.model)
    shard(policy.model, world, cfg.model.precision)
    trainer = GRPOTrainer(
        policy.model, cfg.grpo, cfg.sampler.temperature, world, cfg.sampler.top_p, reference, cfg.model.precision,
        max_completion_tokens(cfg),
    )  # fmt: skip
    if resume:
        load_trainer_state(checkpoints[-1], policy.model, trainer.optimizer)
        if world.leader:
            truncate_metrics(metrics_path, start_step)
        log.info("resumed from %s at step %d", checkpoints[-1], start_step)
    log.info(
        "training on %s in %s%s", describe_device(world.device), cfg.model.precision,
        ", gradient checkpointing" if cfg.model.grad_checkpointing else "",
    )  # fmt: skip
    trackers = None
    if world.leader:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        trackers = Trackers(cfg, run_dir)
    return Run(cfg, run_dir, policy, task, trainer, start_step, wall_offset, trackers, world)


def max_completion_tokens(cfg: LearnerConfig) -> int:
    """The most tokens one completion trains on: an episode's model turns, or one sampled completion."""
    if cfg.env.env:
        return min(cfg.env.max_turns * cfg.sampler.max_new_tokens, cfg.env.max_episode_tokens)
    return cfg.sampler.max_new_tokens


def evaluate_checkpoint(cfg: LearnerConfig, checkpoint: Path, engine: Engine) -> dict:
    """`echo-rl eval`: load a checkpoint's policy into `engine` as the run's sampler held it, and evaluate it."""
    envs = make_env(cfg.env.env, cfg.env.env_args) if cfg.env.env else None  # a bad one fails before the model loads
    policy = load_run_policy(cfg.model, cfg.run.seed)
    state = load_weights(checkpoint, policy.model)
    send_to_sampler(engine, model_spec(policy), policy.model)
    task = eval_task(cfg, environment_task(cfg, policy, envs)) if envs else None
    return {"step": state["step"], **Evaluator.for_run(cfg, policy, task).evaluate(engine)}


def environment_task(cfg: LearnerConfig, policy: Policy, envs: EnvFactory) -> EnvironmentTask:
    """The run's environment as a task: its spec (budgets from [env] and the sampler), its factory, and the
    chat format of the policy's template."""
    env = cfg.env
    spec = EnvSpec(env.env, env.env_args, env.max_turns, env.max_episode_tokens, cfg.sampler.max_new_tokens,
                   hosted=env.env_host == "learner")  # fmt: skip
    if not spec.hosted and not getattr(envs(), "replayable", True):
        raise ConfigError(f"environment {env.env!r} is not reproducible, so its episodes cannot be replayed: "
                          "train it with --env-host learner (co-located too)")  # fmt: skip
    return EnvironmentTask(EpisodeRules(spec, envs, chat_format(policy)))


class Phases:
    """Wall seconds and peak memory of each phase of a step: `with phases("train"): ...`.

    The heap a phase freed is given back to the OS as it ends (learner.train.devices.give_back_freed_memory).
    A phase entered twice (dynamic sampling's generation rounds) adds its seconds and keeps its highest
    peak. CPU peaks are the process's resident set (other threads included: the swarm learner's
    handlers verify while it trains), CUDA peaks torch's allocator on the training device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        tick = time.perf_counter()
        with peak_memory(self.device) as peak:
            yield
        give_back_freed_memory()  # what the phase freed is not held into the next one
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - tick
        self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), round(peak["peak_gib"], 3))

    def memory(self, run: Run, **held_gib: float) -> dict[str, float]:
        """The step's memory record: each phase's peak, what the training state holds, `held_gib` (other
        components: the verifier's versions, the chunk store...) and the resident set now, GiB."""
        parts = {**training_state_gib(run.policy.model, run.trainer.optimizer), **held_gib}
        if run.trainer.reference is not None:
            parts["reference"] = sum(p.numel() * p.element_size() for p in run.trainer.reference.parameters()) / 2**30
        return {
            **{f"peak_{name}": gib for name, gib in self.peak_gib.items()},
            **{name: round(gib, 4) for name, gib in parts.items()},
            "resident": round(current_gib(), 3),
        }


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines after `last_step` (written after the checkpoint we resume from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in lines))


def batch_metrics(groups: list[list[Rollout]], stats: dict) -> dict:
    """The metrics every loop reports about the groups generated for a step (with dynamic sampling:
    those trained on and those set aside for lack of signal, so the reward is not biased by the filter)."""
    rollouts = [r for g in groups for r in g]
    rewards = [r.reward for r in rollouts]
    tokens = sum(len(r.completion_ids) for r in rollouts)
    by_version: dict[int, list[float]] = {}
    for r in rollouts:
        by_version.setdefault(r.version, []).append(r.reward)
    return {
        "reward_mean": float(np.mean(rewards)),
        "accuracy": float(np.mean([r >= 1.0 for r in rewards])),
        "loss": stats["loss"],
        "kl": stats["kl_behaviour"],
        "kl_ref": stats["kl_ref"],
        "clip_frac": stats["clip_frac"],
        "dropped_frac": stats.get("dropped_frac", 0.0),  # tokens grpo.correction dropped (mis, icepop, seq_mask)
        "grad_norm": stats["grad_norm"],
        "tokens": tokens,
        "trained_tokens": stats["trained_tokens"],
        "skipped_updates": stats.get("skipped_updates", 0),  # non-finite loss or gradient: the update was dropped
        "completion_len_mean": tokens / len(rollouts),
        "groups": len(groups),
        "equal_reward_groups": sum(not has_signal(g) for g in groups),
        # how good each policy version that generated this batch is: (mean reward, rollouts)
        "reward_by_version": {str(v): [float(np.mean(rs)), len(rs)] for v, rs in sorted(by_version.items())},
        **episode_metrics(rollouts),
    }


def episode_metrics(rollouts: list[Rollout]) -> dict:
    """Turns and tokens per episode of an environment's rollouts (none for single-turn completions):
    tokens_per_episode counts the model's turns and the observations, model_tokens_per_episode the former;
    failed_episodes those whose environment raised (their groups trained on nothing)."""
    episodes = [r for r in rollouts if r.spans]
    if not episodes:
        return {}
    return {
        "turns_per_episode": float(np.mean([(len(r.spans) + 1) // 2 for r in episodes])),
        "tokens_per_episode": float(np.mean([len(r.completion_ids) for r in episodes])),
        "model_tokens_per_episode": float(np.mean([r.model_tokens for r in episodes])),
        "failed_episodes": sum(r.failed for r in episodes),
    }


def sampler_departure(cfg: LearnerConfig, policy: Policy, engine: Engine) -> str | None:
    """Why `engine` (loaded with the policy) cannot sample for this run, or None: the mean |log mu - log pi| of
    a few tokens it samples, against the learner's own logprobs, over half the verifier's tolerance
    (swarm.verify_tolerance). llama.cpp runs a family as released models configure it (Qwen3-MoE's normalised
    top-k weights, Gemma 3's query scale and one global layer in six); a config that departs from that would
    get every llama.cpp worker flagged: it is named here instead, once, before any rollout."""
    prompt = policy.render_prompt("What is 12 + 7? Think, then answer.")
    params = SamplingParams(1.0, 1.0, 16, 0)  # T = 1: the distribution itself, every token counts
    group = engine.generate([GenerationRequest(prompt, 4, 0)], params)[0]
    rollouts = [Rollout(prompt, c.tokens, c.logprobs, 0.0) for c in group]
    with torch.no_grad():
        learner = completion_logprobs(policy.model, rollouts, temperature=1.0).double().cpu()  # (from a GPU too)
    sampler = torch.tensor([lp for c in group for lp in c.logprobs], dtype=torch.float64)
    d = float((sampler - learner).abs().mean())
    limit = cfg.swarm.verify_tolerance / 2
    if d <= limit:
        return None
    return (
        f"the sampler computes this {policy.model.config.model_type} config differently from the learner "
        f"(|log mu - log pi| = {d:.3g} nats a token, over {limit:g}; llama.cpp runs each family as its released "
        "models configure it)"
    )
