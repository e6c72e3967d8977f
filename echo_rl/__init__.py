"""echo-rl as a Python library: a run from a config object, a local swarm in one call, tasks as plain Python
callables, and the primitives of a scripted experiment (docs/api.md).

    import echo_rl
    cfg = echo_rl.Config()                  # every default runs: SmolLM2-135M learning arithmetic
    for record in echo_rl.train(cfg):       # co-located; each step's metrics.jsonl record
        print(record["step"], record["reward_mean"])

The primitives follow the Tinker SDK's names (TrainingClient.forward_backward, optim_step,
save_weights_and_get_sampling_client, SamplingClient.sample), synchronous and in this process;
SwarmTrainingClient samples through a swarm instead (save_weights_for_sampler publishes to the workers).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_rl.client import SamplingClient, SwarmTrainingClient, TrainingClient
from echo_rl.swarm import LocalSwarm, local_swarm
from learner.config import (
    EvalConfig,
    GRPOConfig,
    LearnerConfig,
    ModelConfig,
    RunConfig,
    SamplerConfig,
    SwarmConfig,
    TaskConfig,
)
from learner.tasks import Problem, Task, make_task

Config = LearnerConfig

__all__ = [
    "Config", "RunConfig", "ModelConfig", "TaskConfig", "GRPOConfig", "SamplerConfig", "SwarmConfig", "EvalConfig",
    "Problem", "Task", "FunctionTask", "make_task", "train", "TrainingClient", "SamplingClient",
    "SwarmTrainingClient", "LocalSwarm", "local_swarm",
]  # fmt: skip


@dataclass
class FunctionTask:
    """A task from two plain functions: `sample(rng) -> Problem` and `reward(completion, answer) -> float`.

    `name` appears in metrics; a task not named `jsonl:...` has a held-out split for --eval-every
    (learner.tasks.split), so `sample` should draw from many distinct problems."""

    name: str
    sample: Callable[[random.Random], Problem]
    reward: Callable[[str, Any], float]


def train(cfg: LearnerConfig, task: Task | None = None, resume: bool = False) -> Iterator[dict]:
    """A co-located run (`echo-rl learner start --colocated`) from a config object; yields each step's record
    as it is written to RUN_DIR/metrics.jsonl. `task`: any object with name, sample and reward (a
    FunctionTask) instead of cfg.task. A multi-turn environment: cfg.env.env = "module:Class" (or a
    built-in name), see docs/environments.md."""
    from learner.colocated_loop import train_colocated
    from worker.engines import sampler_engine

    cfg.validate()
    yield from train_colocated(
        cfg, sampler_engine(cfg.sampler, cfg.model.device, Path(cfg.run.run_dir) / "sampler"), resume, task
    )
