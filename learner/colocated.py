"""Co-located training: generate -> score -> train -> export -> reload, in one process.

This is the synchronous baseline every distributed mode is compared against. The loop reads top to
bottom; each step is seeded by (seed, step), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from learner.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from learner.config import ConfigError, LearnerConfig
from learner.models import export_tensors, load_policy, model_spec
from learner.rollouts import score_groups
from learner.tasks import make_task
from learner.trainer import GRPOTrainer
from p2p.messages import Completion, GenerationRequest, ModelSpec, SamplingParams

log = logging.getLogger(__name__)


class Sampler(Protocol):
    """What the loop needs from an inference engine (worker.engines.* provide it)."""

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None: ...

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]: ...


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for step `step` of a run seeded `seed` (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") >> 1


def train_colocated(cfg: LearnerConfig, engine: Sampler, resume: bool = False) -> Iterator[dict]:
    """Run (or resume) a co-located GRPO run; yields each step's metrics after it is written."""
    torch.set_flush_denormal(True)
    run_dir = Path(cfg.run.run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    checkpoints = list_checkpoints(run_dir)
    if resume and not checkpoints:
        raise ConfigError(f"--resume: no checkpoint in {run_dir}/checkpoints; start without --resume")
    if not resume and (checkpoints or metrics_path.exists()):
        raise ConfigError(f"{run_dir} already holds a run: pass --resume to continue it or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)

    policy = load_policy(cfg.model.model, cfg.model.cache_dir, cfg.run.seed)
    task = make_task(cfg.task.task, cfg.task.task_args)
    trainer = GRPOTrainer(policy.model, cfg.grpo, cfg.sampler.temperature)
    start_step, wall_offset = 0, 0.0
    if resume:
        state = load_checkpoint(checkpoints[-1], policy.model, trainer.optimizer)
        if state["config"]["model"]["model"] != cfg.model.model:
            raise ConfigError(
                f"--model {cfg.model.model!r} differs from the checkpoint's {state['config']['model']['model']!r}"
            )
        start_step, wall_offset = state["step"], state["wall_s"]
        truncate_metrics(metrics_path, start_step)
        log.info("resumed from %s at step %d", checkpoints[-1], start_step)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    spec = model_spec(policy)
    engine.load_policy(spec, export_tensors(policy.model))
    t_run = time.perf_counter() - wall_offset
    for step in range(start_step + 1, cfg.run.steps + 1):
        seconds: dict[str, float] = {}
        tick = time.perf_counter()

        # 1. prompts: chosen by the learner, seeded by (seed, step)
        rng = random.Random(step_seed(cfg.run.seed, step))
        problems = [task.sample(rng) for _ in range(cfg.grpo.prompts_per_step)]
        prompts = [policy.render_prompt(p.prompt) for p in problems]

        # 2. generate G completions per prompt with the current policy (version step - 1)
        params = SamplingParams(
            cfg.sampler.temperature, cfg.sampler.top_p, cfg.sampler.max_new_tokens, step_seed(cfg.run.seed + 1, step)
        )
        groups = engine.generate([GenerationRequest(p, cfg.grpo.group_size) for p in prompts], params)
        seconds["generate"], tick = time.perf_counter() - tick, time.perf_counter()

        # 3. score on the learner and normalise advantages within each group
        scored = score_groups(task, policy, problems, prompts, groups, version=step - 1)
        rollouts = [r for group in scored for r in group]
        seconds["score"], tick = time.perf_counter() - tick, time.perf_counter()

        # 4. one optimizer step
        stats = trainer.step(rollouts)
        seconds["train"], tick = time.perf_counter() - tick, time.perf_counter()

        # 5. hand the new weights to the sampler
        if stats["trained_tokens"]:
            engine.load_policy(spec, export_tensors(policy.model))
        seconds["export"], tick = time.perf_counter() - tick, time.perf_counter()

        rewards = [r.reward for r in rollouts]
        tokens = sum(len(r.completion_ids) for r in rollouts)
        record = {
            "step": step,
            "wall_s": round(time.perf_counter() - t_run, 3),
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean([r >= 1.0 for r in rewards])),
            "loss": stats["loss"],
            "kl": stats["kl_behaviour"],
            "kl_ref": stats["kl_ref"],
            "clip_frac": stats["clip_frac"],
            "grad_norm": stats["grad_norm"],
            "tokens": tokens,
            "trained_tokens": stats["trained_tokens"],
            "gen_tokens_per_s": tokens / max(seconds["generate"], 1e-9),
            "completion_len_mean": tokens / len(rollouts),
            "equal_reward_groups": sum(len({r.reward for r in g}) == 1 for g in scored),
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
        }
        # metrics first: a crash before the checkpoint lands only leaves lines that --resume trims
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if step % cfg.run.checkpoint_every == 0 or step == cfg.run.steps:
            state = {"wall_s": record["wall_s"], "config": dataclasses.asdict(cfg)}
            path = save_checkpoint(run_dir, step, policy.model, trainer.optimizer, state, cfg.run.keep_checkpoints)
            log.info("checkpoint %s written in %.1fs", path, time.perf_counter() - tick)
        yield record


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines after `last_step` (written after the checkpoint we resume from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in lines))
