"""The distributed learner: train on rollouts that workers generate, publish versions to the swarm.

    start host -> publish the current weights as a version -> loop:
        wait for a batch of groups within staleness  (workers lease prompts and push rollouts meanwhile)
        one optimizer step                           (version v -> v + 1)
        publish every kappa steps                    (full snapshot or XOR delta, signed, seeded to peers;
                                                      encoded in the background while the next step trains)
        record metrics (utilisation = training time / wall time), checkpoint every K steps

The learner keeps its identity (RUN_DIR/learner.key) and its port (RUN_DIR/learner.addr) across
restarts, so workers find it again after `--resume`.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import multiaddr
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig
from learner.evaluation import eval_task
from learner.orchestrate.handlers import LearnerService
from learner.orchestrate.journal import JournalState, RolloutJournal, group_of, read_journal
from learner.orchestrate.publisher import Publisher
from learner.orchestrate.verify import RolloutVerifier
from learner.run import Phases, Run, batch_metrics, open_run
from learner.train.data_parallel import full_state, init_world, leave
from learner.train.models import model_spec
from p2p.auth import AUTH, SwarmAuth, read_allow_list, read_secret
from p2p.broadcast import ChunkStore, Seeder
from p2p.config import ConfigError
from p2p.host import Host, HostConfig
from p2p.identity import load_identity

log = logging.getLogger(__name__)


def listen_addr(cfg: LearnerConfig, run_dir: Path) -> str:
    """The configured listen multiaddr; port 0 reuses the port of this run's previous start, if any."""
    addr = multiaddr.Multiaddr(cfg.swarm.listen)
    previous = run_dir / "learner.addr"
    if addr.value_for_protocol("tcp") == "0" and previous.exists():
        try:
            port = multiaddr.Multiaddr(previous.read_text().strip()).value_for_protocol("tcp")
            return cfg.swarm.listen.replace("/tcp/0", f"/tcp/{port}")
        except Exception:  # noqa: BLE001 - an unreadable old address just means a new port
            pass
    return cfg.swarm.listen


def train_distributed(cfg: LearnerConfig, resume: bool = False) -> Iterator[dict]:
    """Run (or resume) a swarm GRPO run; yields each step's metrics after it is written.

    Under torchrun, rank 0 runs this loop and the other ranks `follow` it (learner.train.data_parallel)."""
    every = cfg.eval.eval_every
    if every and every % cfg.swarm.publish_every:
        raise ConfigError(
            f"--eval-every {every} must be a multiple of --publish-every {cfg.swarm.publish_every}: "
            "workers evaluate published versions"
        )
    if every:
        eval_task(cfg)  # a bad evaluation task fails before the model loads
    secret = read_secret(cfg.swarm.secret_file) if cfg.swarm.secret_file else None
    allow = read_allow_list(cfg.swarm.allow) if cfg.swarm.allow else None
    world = init_world(cfg.model.device)
    run = open_run(cfg, resume, world)
    if not world.leader:
        follow(run)
        leave(world)
        return
    policy, trainer, grpo = run.policy, run.trainer, cfg.grpo
    host_cfg = HostConfig(
        listen=[listen_addr(cfg, run.run_dir)],
        read_timeout=cfg.swarm.read_timeout,
        upload_bps=cfg.swarm.upload_bps or None,
    )
    host = Host(load_identity(run.run_dir / "learner.key"), host_cfg)
    host.start()
    addr_file = run.run_dir / "learner.addr"
    addr_file.unlink(missing_ok=True)  # the previous start's address is no sign that this one is ready
    journal: RolloutJournal | None = None
    try:
        auth = SwarmAuth(host.peer_id, secret, allow)
        host.gate = auth.allows
        host.handle(AUTH, auth.on_auth, guarded=False)
        store = ChunkStore(spill_dir=run.run_dir / "chunks", memory_budget=cfg.swarm.chunk_memory_mb << 20)
        seeder = Seeder(host, store)
        publisher = Publisher(
            seeder,
            run_id=secrets.token_hex(8),
            full_every=cfg.swarm.full_every,
            dtype=cfg.swarm.wire_dtype,
            lora=cfg.model.lora_rank > 0,
            topk=cfg.swarm.wire_topk,
        )
        # the journal: accepted groups and each step's batch, so that a killed learner loses none of them
        resumed = read_journal(run.run_dir, run.start_step) if resume else JournalState()
        journal = RolloutJournal(run.run_dir, staleness=0 if cfg.swarm.sync_mode == "pull" else cfg.swarm.staleness)
        journal.open(run.start_step, resumed)
        swarm = cfg.swarm
        verifier = RolloutVerifier(
            lambda: AutoModelForCausalLM.from_config(copy.deepcopy(policy.model.config)),
            cfg.sampler.temperature, cfg.sampler.top_p, swarm.verify_first, swarm.verify_fraction,
            swarm.verify_tolerance, swarm.verify_draw_tolerance,
            lora_scale=cfg.model.lora_alpha / max(cfg.model.lora_rank, 1),
            keep=swarm.staleness + swarm.publish_every + 1, device=world.device,
        )  # fmt: skip
        service = LearnerService(
            seeder, cfg, policy, run.task, model_spec(policy), publisher.run_id, journal, verifier, resumed
        )
        # the address file says "ready": written only once every protocol has its handler, so that a
        # worker or `status` dialing it at once is answered rather than told "protocol not supported"
        addr_file.with_suffix(".tmp").write_text(host.addrs[0] + "\n")
        os.replace(addr_file.with_suffix(".tmp"), addr_file)
        log.info("learner listening on %s", host.addrs[0])
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

        def publish(version: int, tensors: dict) -> None:
            tensors = publisher.carry(tensors)  # what workers will hold (the largest changes, with wire_topk < 1)
            manifest = publisher.publish(version, tensors)
            verifier.remember(version, tensors, manifest.adapter_base)
            service.mark_published(version, manifest.payload_size)

        def snapshot() -> dict:  # with several ranks, every rank takes part in gathering the weights
            return publisher.snapshot(policy.model, full_state(policy.model, world))

        publish(version, snapshot())
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
                    pending = publishing.submit(publish, version, snapshot())

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
            for result in evals.drain() if evals is not None else []:  # finished during this step, oldest first
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
        host.stop()
        run.close()
        if journal is not None:
            journal.close()


def wait_for_evaluation(service: LearnerService, version: int) -> None:
    """Wait (at most an evaluation lease's time, twice) until a worker returned the evaluation of `version`."""
    evals = service.evals
    assert evals is not None
    deadline = time.monotonic() + 2 * evals.timeout_s
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
