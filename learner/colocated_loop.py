"""Co-located training: generate -> score -> train -> export -> reload, in one process.

This is the synchronous baseline every distributed mode is compared against. The loop reads top to
bottom; each step is seeded by (seed, step), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from learner.config import LearnerConfig
from learner.evaluation import Evaluator, eval_task
from learner.orchestrate.rollouts import Rollout, has_signal, score_groups
from learner.rollout_source import RolloutSource
from learner.run import Phases, batch_metrics, open_run, sampler_departure
from learner.tasks import Task, step_seed
from learner.train.models import model_spec
from learner.train.wire_weights import send_to_sampler
from p2p.config import ConfigError
from p2p.messages import Engine, SamplingParams


def train_colocated(
    cfg: LearnerConfig, engine: Engine, resume: bool = False, task: Task | None = None
) -> Iterator[dict]:
    """Run (or resume) a co-located GRPO run; yields each step's metrics after it is written. `task`: a task
    object instead of cfg.task (the Python API's)."""
    every = cfg.eval.eval_every
    held_out = eval_task(cfg, task) if every and not cfg.env.env else None  # a bad one fails before the model loads
    run = open_run(cfg, resume, task=task)
    policy, task, trainer = run.policy, run.task, run.trainer
    source = RolloutSource(task, policy)  # a task's completions or an environment's episodes, one interface
    if every and source.episodes is not None:  # an environment's held-out seeds, drawn from the run's task
        held_out = eval_task(cfg, task)
    spec = model_spec(policy)
    send_to_sampler(engine, spec, policy.model)
    if reason := sampler_departure(cfg, policy, engine):
        raise ConfigError(f"{reason}: use --engine transformers")
    evaluator = Evaluator.for_run(cfg, policy, held_out) if held_out else None
    initial = {"version": 0, **evaluator.evaluate(engine)} if evaluator and run.start_step == 0 else None  # baseline
    t_run = time.perf_counter() - run.wall_offset
    try:
        for step in range(run.start_step + 1, cfg.run.steps + 1):
            phases = Phases(run.world.device)  # seconds and peak memory of generate, score, train, export

            # 1-3. prompts chosen by the learner and seeded by (seed, step); G completions each with the
            #      current policy (version step - 1); rewards scored here, advantages normalised per group.
            #      An environment: G episodes per seed, played turn by turn, scored by replaying them.
            #      Dynamic sampling: while fewer than P groups carry signal, draw another P prompts
            rng = random.Random(step_seed(cfg.run.seed, step))
            scored: list[list[Rollout]] = []
            for round_ in range(cfg.grpo.sampling_rounds if cfg.grpo.dynamic_sampling else 1):
                problems = [task.sample(rng) for _ in range(cfg.grpo.prompts_per_step)]
                prompts = [source.prompt(p) for p in problems]
                params = SamplingParams(
                    cfg.sampler.temperature,
                    cfg.sampler.top_p,
                    cfg.sampler.max_new_tokens,
                    step_seed(cfg.run.seed + 1 + round_, step),
                )
                requests = [
                    source.request(problem, p, cfg.grpo.group_size, k)
                    for k, (p, problem) in enumerate(zip(prompts, problems, strict=True))
                ]
                with phases("generate"):
                    groups = source.generate(engine.generate, requests, params)
                with phases("score"):
                    scored += score_groups(task, policy, problems, prompts, groups, step - 1, cfg.grpo.advantage_std)
                if sum(map(has_signal, scored)) >= cfg.grpo.prompts_per_step:
                    break
            batch = scored
            if cfg.grpo.dynamic_sampling:
                batch = [g for g in scored if has_signal(g)][: cfg.grpo.prompts_per_step]

            # 4. one optimizer step
            with phases("train"):
                stats = trainer.step([r for g in batch for r in g])

            # 5. hand the new weights to the sampler (LoRA: only the adapters, hot-swapped on the base)
            with phases("export"):
                if stats["trained_tokens"]:
                    send_to_sampler(engine, spec, policy.model, adapters_only=bool(cfg.model.lora_rank))
            # 6. held-out evaluation of the new version (the checkpoint of this step holds the same weights)
            evaluation = None
            if evaluator and (step % every == 0 or step == cfg.run.steps):
                with phases("eval"):
                    evaluation = {"version": step, **evaluator.evaluate(engine)}
            seconds = phases.seconds

            record = {
                "step": step,
                "wall_s": round(time.perf_counter() - t_run, 3),
                **batch_metrics(scored, stats),
                "gen_tokens_per_s": sum(r.model_tokens for g in scored for r in g) / max(seconds["generate"], 1e-9),
                "utilisation": seconds["train"] / sum(seconds.values()),  # the learner trains, then waits for itself
                "seconds": {k: round(v, 4) for k, v in seconds.items()},
                "memory_gib": phases.memory(run),
            }
            if initial is not None and step == 1:
                record["eval_initial"] = initial
            if evaluation is not None:
                record["eval"] = evaluation
            run.record(step, record)
            yield record
    finally:
        run.close()  # the W&B / trackio run ends with the loop, also when the caller stops early
