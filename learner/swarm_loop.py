"""The distributed learner: train on rollouts that workers generate, publish versions to the swarm.

    start host -> publish the current weights as a version -> loop:
        wait for a batch of groups within staleness  (workers lease prompts and push rollouts meanwhile)
        one optimizer step                           (version v -> v + 1)
        publish every kappa steps                    (full snapshot or XOR delta, signed, seeded to peers;
                                                      encoded in the background while the next step trains)
        record metrics (utilisation = training time / wall time), checkpoint every K steps

The swarm side (host, seeder, publisher, journal, verifier, handlers) is learner.swarm_side's; this loop
drives it step by step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from learner.config import LearnerConfig
from learner.evaluation import eval_task
from learner.orchestrate.handlers import LearnerService
from learner.orchestrate.journal import group_of
from learner.orchestrate.verify_quantized import QuantEngines
from learner.run import Phases, Run, batch_metrics, open_run
from learner.swarm_side import start_swarm
from learner.train.data_parallel import full_state, init_world, leave
from p2p.config import ConfigError
from p2p.messages import Engine, ModelSpec

log = logging.getLogger(__name__)


def train_distributed(
    cfg: LearnerConfig, resume: bool = False, probe: Callable[[ModelSpec], Engine | None] | None = None,
    quant: QuantEngines | None = None,
) -> Iterator[dict]:
    """Run (or resume) a swarm GRPO run; yields each step's metrics after it is written.

    Under torchrun, rank 0 runs this loop and the other ranks `follow` it (learner.train.data_parallel).
    `probe` builds a llama.cpp engine for a spec on this machine (learner.swarm_side.refuse_departing_llamacpp);
    `quant`, llama.cpp engines that replay quantized workers (learner.orchestrate.verify_quantized)."""
    every = cfg.eval.eval_every
    if every and every % cfg.swarm.publish_every:
        raise ConfigError(
            f"--eval-every {every} must be a multiple of --publish-every {cfg.swarm.publish_every}: "
            "workers evaluate published versions"
        )
    if every and not cfg.env.env:  # (an environment's held-out seeds are drawn from the run's task)
        eval_task(cfg)  # a bad evaluation task fails before the model loads
    world = init_world(cfg.model.device)
    run = open_run(cfg, resume, world)
    if not world.leader:
        follow(run)
        leave(world)
        return
    trainer, grpo = run.trainer, cfg.grpo
    side = start_swarm(cfg, run, resume, probe, quant)
    try:
        service, journal, resumed = side.service, side.journal, side.resumed
        verifier, seeder, publisher = side.verifier, side.seeder, side.publisher
        for group_id in resumed.pending():  # accepted before the restart, not trained on yet
            service.buffer.add(group_of(resumed.groups[group_id]))
        replay = {s: r for s, r in resumed.steps.items() if s > run.start_step}
        if resume:
            log.info(
                "journal: %d accepted groups back in the buffer, %d steps to train again, %d groups to lease again",
                len(resumed.pending()), len(replay), len(resumed.unreturned()),
            )  # fmt: skip
        version = run.start_step
        service.advance(version)

        side.publish(version, side.snapshot())
        evals = service.evals  # held-out evaluation leases (learner.orchestrate.evaluations), with --eval-every
        if evals is not None and run.start_step == 0:
            evals.request(0)  # the initial policy: the baseline
        publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")  # encodes while we train
        pending: Future | None = None

        t_run = time.perf_counter() - run.wall_offset
        for step in range(run.start_step + 1, cfg.run.steps + 1):
            phases = Phases(world.device)  # seconds and peak memory of wait, train, publish

            # 1. wait for a batch: P groups generated within the staleness bound (with dynamic sampling:
            #    P groups with signal, plus the groups set aside without it, which count in the metrics)
            stale: list[int] = []
            service.waiting_for_batch()
            with phases("wait"):
                if step in replay:  # journaled before the learner stopped: the same groups again
                    batch, set_aside = (
                        [group_of(resumed.groups[g]) for g in replay[step][k]] for k in ("batch", "set_aside")
                    )
                else:
                    taken = None
                    while taken is None:
                        taken = service.buffer.take(grpo.prompts_per_step, version, timeout=1.0)
                        service.leases.expire()
                    batch, set_aside = taken
                    stale = journal.step(step, batch, set_aside)

            # 2. one optimizer step on them. The version moves on before the step: leases handed out
            #    from now on are measured against it (in pull mode: none until it is published)
            version = step
            service.advance(version)
            with phases("train"):
                stats = trainer.step(world.broadcast([r for g in batch for r in g.rollouts]))

            # 3. publish every kappa steps: snapshot the weights here (the next step changes them), encode,
            #    sign and seed in the background. One publication at a time: a delta needs the one before
            if version % cfg.swarm.publish_every == 0:
                with phases("publish"):
                    if pending is not None:
                        pending.result()  # also raises if it failed
                    pending = publishing.submit(side.publish, version, side.snapshot())

            # 4. held-out evaluation of the published versions every N steps, and of the last one: a lease
            #    to a worker; the run's end waits for its result
            if evals is not None and (version % every == 0 or step == cfg.run.steps):
                evals.request(version - version % cfg.swarm.publish_every)
            if evals is not None and step == cfg.run.steps:
                with phases("eval"):
                    if pending is not None:
                        pending.result()  # the version to evaluate reaches the seeder
                    wait_for_evaluation(service, version - version % cfg.swarm.publish_every)
            seconds = phases.seconds
            step_s = sum(seconds.values())

            decisions = service.schedule(step, seconds["train"], step_s, trained=stats["trained_tokens"] > 0)
            counters = service.leases.counters
            groups = [g.rollouts for g in batch + set_aside]  # all this step generated
            record = {
                "step": step,
                "wall_s": round(time.perf_counter() - t_run, 3),
                **batch_metrics(groups, stats),
                "utilisation": seconds["train"] / step_s if step_s > 0 else 0.0,
                "buffer": service.buffer.held,
                "staleness": service.buffer.staleness_histogram(batch, version - 1),
                "stale_dropped": service.buffer.dropped_stale,
                "groups_accepted": service.buffer.added,
                "groups_consumed": service.buffer.consumed,
                "groups_set_aside": service.buffer.set_aside,
                "groups_dropped_flagged": service.buffer.dropped_flagged,
                "verification": verifier.cost(),  # since the start: groups replayed and seconds spent
                "leases": {
                    "issued": counters.issued,
                    "completed": counters.completed,
                    "expired": counters.expired,
                    "refused": dict(counters.refused),
                    "declined": dict(service.declined),
                },
                "workers": service.worker_table(),
                "decisions": [{"worker": d.worker[-8:], "active": d.active, "reason": d.reason} for d in decisions],
                "bcast_s": {str(v): round(s, 2) for v, s in sorted(service.versions.bcast_seconds.items())[-3:]},
                "version_bytes": {str(v): b for v, b in sorted(service.versions.payload_bytes.items())[-3:]},
                "seconds": {k: round(v, 4) for k, v in seconds.items()},
                "memory_gib": phases.memory(
                    run,
                    verifier=verifier.held_gib(),
                    chunk_store=seeder.store.memory_used / 2**30,
                    publisher=publisher.held_gib(),
                ),  # fmt: skip
                "batch_groups": [g.group_id for g in batch],
                "set_aside_groups": [g.group_id for g in set_aside],
                "stale_groups": stale,
                "replayed": step in replay,
            }
            results, revoked = evals.drain() if evals is not None else ([], [])  # during this step, oldest first
            if revoked:  # figures whose evaluator was flagged since: reports leave them out (echo_cli.report)
                record["eval_revoked"] = revoked
            for result in results:
                if result["version"] == 0:
                    record["eval_initial"] = result
                elif "eval" in record:  # two in one step (a slow worker): the newest is "eval", none is lost
                    record.setdefault("eval_earlier", []).append(record.pop("eval"))
                    record["eval"] = result
                else:
                    record["eval"] = result
            if run.record(step, record):
                journal.checkpointed(step)
            service.step_recorded(record)
            yield record
        if pending is not None:
            pending.result()  # the last version reaches the seeder before we stop serving
        publishing.shutdown()
        leave(world)
    finally:
        side.close()
        run.close()


def wait_for_evaluation(service: LearnerService, version: int) -> None:
    """Wait (at most an evaluation lease's time, twice) until a worker returned the evaluation of `version`."""
    evals = service.evals
    assert evals is not None
    deadline = time.monotonic() + 2 * evals.timeout_s
    if evals.waiting_for(version):  # say why the run has not ended yet: this can take a slow worker minutes
        log.info("waiting (at most %.0fs) for a worker's held-out evaluation of v%d", 2 * evals.timeout_s, version)
    while evals.waiting_for(version) and time.monotonic() < deadline:
        service.leases.expire()
        time.sleep(0.2)
    if evals.waiting_for(version):
        log.warning("no worker returned the held-out evaluation of v%d in %.0fs: the run ends without it",
                    version, 2 * evals.timeout_s)  # fmt: skip


def follow(run: Run) -> None:
    """Ranks > 0: train on the batches rank 0 broadcasts and join its collective calls, in its order
    (the first publication, then per step: batch, optimizer step, publication, checkpoint)."""
    cfg, world, model = run.cfg, run.world, run.policy.model
    full_state(model, world)
    for step in range(run.start_step + 1, cfg.run.steps + 1):
        run.trainer.step(world.broadcast(None))
        if step % cfg.swarm.publish_every == 0:
            full_state(model, world)
        run.record(step, None)
