"""The learner's side of the worker protocols: SPEC, LEASE, ROLLOUT, HEARTBEAT and STATUS for one run.

Handlers run in the host's worker threads, concurrently with the training loop; everything they share
with it (the replay buffer, the lease table, the versions) is thread-safe. Every request is parsed into
its typed message (p2p.messages) first; everything a worker states (versions, rates, hardware) is checked
before it is stored. Who gets a lease is learner.plan.admission's rule; what happens to a submission is
learner.orchestrate.intake's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from learner.config import LearnerConfig
from learner.evaluation import Evaluator, eval_task
from learner.orchestrate.evaluations import EvalBoard
from learner.orchestrate.intake import PromptBook, RolloutIntake, completion_tokens, lease_sampling, rollout_limits
from learner.orchestrate.journal import JournalState, RolloutJournal
from learner.orchestrate.leases import LeaseTable
from learner.orchestrate.replay import ReplayBuffer
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.verify_quantized import declared_weights
from learner.orchestrate.versions import PolicyVersions
from learner.orchestrate.workers import WorkerRecord
from learner.plan.admission import LeaseAdmission
from learner.plan.scheduler import Decision, Scheduler, SchedulerConfig
from learner.tasks import Task
from learner.train.devices import describe_device
from learner.train.fit import worker_sizes
from learner.train.models import Policy
from learner.train.trainer import model_device
from p2p.broadcast import Seeder
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    ROLLOUT,
    SPEC,
    STATUS,
    Heartbeat,
    HeartbeatReply,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    ModelSpec,
    SpecReply,
    SpecRequest,
    describe_hardware,
)

log = logging.getLogger(__name__)


class LearnerService:
    """Serves the worker protocols of one run and owns the swarm-side state: versions, workers, leases,
    the replay buffer, the scheduler. The training loop moves it on with `advance`,
    `mark_published`, `schedule` and `step_recorded`."""

    def __init__(
        self, seeder: Seeder, cfg: LearnerConfig, policy: Policy, task: Task, spec: ModelSpec, run_id: str,
        journal: RolloutJournal, verifier: RolloutVerifier, resumed: JournalState | None = None,
    ) -> None:  # fmt: skip
        self.seeder = seeder
        self.host = host = seeder.host
        self.cfg, self.spec, self.run_id = cfg, spec, run_id
        swarm, grpo = cfg.swarm, cfg.grpo
        staleness = 0 if swarm.sync_mode == "pull" else swarm.staleness
        self.buffer = ReplayBuffer(staleness, grpo.dynamic_sampling, grpo.sampling_rounds)
        self.journal = journal
        self.verifier = verifier
        resumed = resumed or JournalState()
        # group ids go on from the last one leased; groups leased but never returned are leased again
        self.leases = LeaseTable(swarm.lease_timeout, resumed.next_group)
        self.leases.requeued.extend(resumed.unreturned())
        # pull mode uses every worker: each lease there waits for the newest version, which the model does not cover
        self.autoscale = swarm.autoscale and swarm.sync_mode == "async"
        self.scheduler = Scheduler(SchedulerConfig(
            rollouts_per_step=grpo.prompts_per_step * grpo.group_size, publish_every=swarm.publish_every,
            staleness=swarm.staleness, margin=swarm.margin, silence_s=swarm.worker_silence,
            max_groups_per_lease=swarm.groups_per_lease, lease_timeout_s=swarm.lease_timeout,
        ))  # fmt: skip
        self._sched_lock = threading.Lock()  # handlers run on several threads; the scheduler is not thread-safe
        self.admission = LeaseAdmission(
            self.scheduler, swarm.sync_mode, swarm.staleness, swarm.prefetch_batches, self.autoscale
        )
        self.versions = PolicyVersions(swarm.publish_every)
        self.prompts = PromptBook(task, policy, cfg.run.seed)
        episodes = self.prompts.source.episodes  # a multi-turn environment's: workers get its rules with the spec
        self.env_wire = None if episodes is None else {"spec": episodes.spec.to_wire(), "chat": episodes.chat.to_wire()}
        # the weight formats this learner takes, and the llama.cpp build quantized ones must share (verify_quantized)
        self.formats = swarm.weight_formats(grpo.corrects_sampler())
        self.quant_build = verifier.quantized.build if verifier.quantized is not None else ""
        sizes, kv = worker_sizes(policy.model.config, completion_tokens(cfg), spec.gguf_recipe, self.formats)
        self.spec_reply = SpecReply(run_id, spec, cfg.grpo.group_size, self.env_wire, quant_build=self.quant_build,
                                    weights_bytes=sizes, kv_bytes=kv).to_wire()  # its vocabulary zstd once  # fmt: skip
        device = model_device(policy.model)
        self.device = f"{describe_device(device)}, {cfg.model.precision}" + (
            ", gradient checkpointing" if cfg.model.grad_checkpointing else "")  # fmt: skip
        self.intake = RolloutIntake(
            cfg, spec.vocab_size, self.prompts, self.versions, self.leases, verifier, journal, self.buffer,
            self.scheduler, self._sched_lock,
        )  # fmt: skip
        self.workers: dict[str, WorkerRecord] = {}
        self.evals: EvalBoard | None = None
        if cfg.eval.eval_every:  # a held-out evaluation is one lease, as long as that many training leases
            work = cfg.eval.eval_prompts * (1 + cfg.eval.eval_samples) / (swarm.groups_per_lease * grpo.group_size)
            evaluator = Evaluator.for_run(cfg, policy, eval_task(cfg, task))
            timeout = swarm.lease_timeout * max(1.0, work)
            self.evals = self.intake.evals = EvalBoard(evaluator, verifier, timeout, self.workers)
        self.gathered = cfg.swarm.min_workers <= 1  # swarm.min_workers hold a version: leases may start
        self.told_eval = False  # that held-out evaluation skips quantized workers, said once
        self.declined: dict[str, int] = {}  # lease requests not granted, by admission's reason
        self.step_started: float | None = None  # when the step under way began (None: waiting for a batch)
        self._bcast_seen = -1  # newest version whose broadcast time the scheduler has seen
        self._lock = threading.Lock()
        self.last_step: dict[str, Any] = {}  # the newest step's metrics (step_recorded)
        self.started = time.monotonic()
        host.handle(SPEC, self._on_spec)
        host.handle(LEASE, self._on_lease)
        host.handle(ROLLOUT, self._on_rollout, limits=rollout_limits(cfg))
        host.handle(HEARTBEAT, self._on_heartbeat)
        host.handle(STATUS, lambda peer, msg: self.status(), guarded=False)  # read-only, open to any peer

    # -- moved on by the training loop ---------------------------------------------------------------

    def advance(self, version: int) -> None:
        """The learner now holds `version` and starts the step that makes it: leases are measured against it."""
        self.versions.trained = version
        self.step_started = time.monotonic()

    def waiting_for_batch(self) -> None:
        """The step is done (its version is made) and the learner waits for rollouts: no step under way to
        time leases against."""
        self.step_started = None
        self.versions.mark_made(self.versions.trained)

    def mark_published(self, version: int, payload_bytes: int) -> None:
        self.versions.mark_published(version, payload_bytes)

    def step_recorded(self, record: dict[str, Any]) -> None:
        self.last_step = record

    def groups_per_batch(self) -> int:
        """Groups to generate for one batch: prompts_per_step, or with dynamic sampling as many more as
        the share of groups with signal says (at most sampling_rounds batches' worth)."""
        grpo = self.cfg.grpo
        if not grpo.dynamic_sampling:
            return grpo.prompts_per_step
        share = max(self.buffer.signal_share, 1 / grpo.sampling_rounds)
        return math.ceil(grpo.prompts_per_step / share)

    def schedule(self, step: int, train_s: float, step_s: float, trained: bool) -> list[Decision]:
        """After each step: update the estimates, drop silent workers, re-plan who generates."""
        now = time.monotonic()
        bcast = self.versions.bcast_seconds
        new_bcast = [s for v, s in list(bcast.items()) if v > self._bcast_seen]
        self._bcast_seen = max(bcast, default=self._bcast_seen)
        with self._sched_lock:
            self.scheduler.cfg.rollouts_per_step = self.groups_per_batch() * self.cfg.grpo.group_size
            self.scheduler.step_done(step, train_s, step_s, trained)
            for seconds in new_bcast:
                self.scheduler.broadcast_done(seconds)
            for peer, seconds in self.leases.drain_expirations():  # nothing delivered: measured as such
                self.scheduler.lease_expired(peer, seconds)
            for peer in self.scheduler.drop_silent(now):
                if self.evals is not None:
                    self.evals.forget_worker(peer)
                requeued = self.leases.requeue_worker(peer)
                self.leases.forget_worker(peer)
                log.info("worker %s went silent: %d of its leases go to others", peer[-8:], requeued)
                with self._lock:
                    self.workers.pop(peer, None)
                self.seeder.forget(peer)
            return self.scheduler.replan() if self.autoscale else []

    def activity(self, peer: str) -> tuple[bool, str]:
        """Whether the scheduler lets this worker generate, and why."""
        if not self.autoscale:
            return True, "autoscale off" if self.cfg.swarm.sync_mode == "async" else "pull mode uses every worker"
        with self._sched_lock:
            state = self.scheduler.workers.get(peer)
            return (state.active, state.reason) if state else (False, "unknown")

    # -- handlers ------------------------------------------------------------------------------------

    def _worker(self, peer: str) -> WorkerRecord:
        with self._lock:
            record = self.workers.get(peer)
            if record is None:
                record = self.workers[peer] = WorkerRecord(peer)
            record.last_seen = time.monotonic()
        with self._sched_lock:
            self.scheduler.seen(peer, record.last_seen)
        return record

    def _on_spec(self, peer: str, msg: dict) -> dict:
        if reason := SpecRequest.from_wire(msg).mismatch():  # an older (or newer) echo-rl: no penalty
            raise BadRequest(reason)
        self._worker(peer)
        return self.spec_reply

    def _on_heartbeat(self, peer: str, msg: dict) -> dict:
        beat = Heartbeat.from_wire(msg)  # bounded types and ranges (MessageError: a penalty)
        self.versions.check_published(beat.version)
        weights = declared_weights(beat.hardware, self.quant_build, self.env_wire is not None, self.verifier.enabled,
                                   self.formats)  # fmt: skip
        worker = self._worker(peer)
        with self._lock:
            if beat.version > worker.version:
                self.versions.first_held(beat.version)
            worker.version = beat.version
            worker.price = beat.price
            worker.tokens_per_s = beat.tokens_per_s
            worker.hardware, worker.punched = describe_hardware(beat.hardware), beat.punched
            worker.weights = weights
        with self._sched_lock:
            self.scheduler.seen(peer, worker.last_seen, worker.price)
        self._declare_rate(peer, worker.tokens_per_s)
        return HeartbeatReply(self.versions.published).to_wire()

    def _declare_rate(self, peer: str, tokens_per_s: float) -> None:
        """Turn a worker's own tokens/s into a declared rollouts/s: the scheduler plans on it until measured."""
        tokens, groups = self.intake.tokens_accepted, self.buffer.added
        if tokens_per_s <= 0 or tokens == 0:
            return
        rollout_tokens = tokens / (groups * self.cfg.grpo.group_size)
        rate = tokens_per_s / rollout_tokens
        lease_s = self.cfg.swarm.groups_per_lease * self.cfg.grpo.group_size / rate if rate > 0 else math.inf
        if not math.isfinite(lease_s):  # bounded at the wire (p2p.messages.MIN_TOKENS_PER_S); belt and braces
            return
        with self._sched_lock:
            self.scheduler.declare(peer, rate, lease_s)

    def _on_lease(self, peer: str, msg: dict) -> dict:
        request = LeaseRequest.from_wire(msg)
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        self.versions.check_published(request.version)
        if request.version < 0:
            raise BadRequest("a lease needs a policy version: fetch one first")
        worker = self._worker(peer)
        with self._lock:
            worker.version = max(worker.version, request.version)
            weights = worker.weights  # the format this lease is bound to (its last heartbeat's)
        versions, now = self.versions, time.monotonic()
        if not self._gather():
            self._decline("gathering")
            return LeaseReply(wait=0.5, newest=versions.published).to_wire()
        quantized = weights != "f16"  # held-out figures are the policy's (echo-rl eval's): 16-bit workers only
        evaluation = self.evals.offer(peer, request.version) if self.evals is not None and not quantized else None
        if quantized and self.evals is not None and self.evals.pending and not self.told_eval:
            self.told_eval = True
            log.info("held-out evaluation goes to 16-bit workers only: %s runs %s", peer[-8:], weights)
        if evaluation is not None:  # held-out evaluation first: any worker holding the version may do it
            return LeaseReply(evaluation).to_wire()
        # leases of workers that have not (lately) returned one are extras, at most a batch (orchestrate.leases)
        batch_groups, buffered, leased = self.groups_per_batch(), len(self.buffer), self.leases.owed_groups()
        if not self.leases.is_reliable(peer) and self.leases.unproven_groups(besides=peer) >= batch_groups:
            self._decline("unproven")
            return LeaseReply(wait=0.5, newest=versions.published).to_wire()
        made, started = versions.newest_made(), self.step_started
        with self._sched_lock:
            admitted = self.admission.admit(
                peer, request.version, request.max_groups, now, version=versions.trained,
                age_s=now - versions.published_at.get(request.version, now),
                batch_groups=batch_groups, buffered=buffered, leased=leased,
                newer_age_s=now - made[1] if made is not None and made[0] > request.version else None,
                step_age_s=None if started is None else now - started,
            )  # fmt: skip
            due_s = self.scheduler.lease_due(peer)
        if not admitted.groups:
            self._decline(admitted.refused)
            # behind/stale/late/newer: generate with a newer version (the worker is fetching it); full: wait
            inactive = admitted.refused == "inactive"  # it keeps polling, so it fetches and relays versions
            return LeaseReply(wait=0.5 if inactive else 0.2, newest=versions.published, inactive=inactive).to_wire()
        lease = self.leases.issue(peer, admitted.groups, request.version, admitted.timeout_s, due_s, weights)
        self.journal.issue(lease.group_ids)
        group_size = self.cfg.grpo.group_size
        grant = LeaseGrant(
            lease.lease_id,
            [self.prompts.request(g, group_size) for g in lease.group_ids],
            lease_sampling(self.cfg, lease.lease_id),
            min_version=request.version,
            deadline_s=admitted.timeout_s,
            alone=quantized,  # each group in a wave of its own: the layout the verifier replays exactly
        )
        return LeaseReply(grant).to_wire()

    def _decline(self, reason: str) -> None:
        with self._lock:
            self.declined[reason] = self.declined.get(reason, 0) + 1

    def _gather(self) -> bool:
        """Whether swarm.min_workers workers hold a version (once they have, for the rest of this start)."""
        if self.gathered:
            return True
        with self._lock:
            ready = sum(w.version >= 0 for w in self.workers.values())
        if ready >= self.cfg.swarm.min_workers:
            self.gathered = True
            log.info("%d workers hold a policy version: leasing prompts", ready)
        return self.gathered

    def _on_rollout(self, peer: str, msg: dict) -> dict:
        return self.intake.submit(self._worker(peer), msg).to_wire()

    # -- figures for metrics and status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status document served on /echo/status/1 (schema: docs/status.md)."""
        swarm, last, verifier = self.cfg.swarm, self.last_step, self.verifier
        newest = self.versions.published
        manifest = self.seeder.store.manifests.get(newest)
        open_leases = self.leases.open_leases()
        now = time.monotonic()
        peers = []
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            have = len(self.seeder.peer_have.get(w.peer_id, {}).get(newest, ()))
            active, reason = self.activity(w.peer_id)
            addrs = self.seeder.peers.get(w.peer_id, [])
            peers.append(
                {
                    "peer_id": w.peer_id,
                    "addr": addrs[0] if addrs else None, "listed": bool(self.seeder.listed(w.peer_id)),
                    "observed": self.seeder.host.observed.get(w.peer_id),
                    "reach": self.seeder.registry.reach(w.peer_id),
                    "role": "worker",
                    **w.row(self.versions.trained, now, active),
                    "activity": reason,
                    "hardware": w.hardware,
                    "newest_share": 1.0 if w.version == newest else (have / len(manifest.chunks) if manifest else 0.0),
                    "open_leases": open_leases.get(w.peer_id, 0),
                    "stale_dropped": self.buffer.dropped_by_worker.get(w.peer_id, 0),
                    "verified": verifier.checked.get(w.peer_id, 0),
                    "verify_share": round(verifier.share(w.peer_id), 4),
                    "reliable": self.leases.is_reliable(w.peer_id),
                    "flagged": verifier.flagged.get(w.peer_id),
                }
            )
        return {
            "schema": 1,
            "run_id": self.run_id,
            "peer_id": self.host.peer_id,
            "addrs": self.host.addrs,
            "step": self.versions.trained,
            "steps": self.cfg.run.steps,
            "version_published": newest,
            "mode": swarm.sync_mode,
            "staleness": swarm.staleness,
            "publish_every": swarm.publish_every,
            "device": self.device,
            "memory_gib": last.get("memory_gib"),
            "utilisation": last.get("utilisation"),
            "reward": last.get("reward_mean"),
            "environment": None
            if self.env_wire is None
            else {
                "name": self.cfg.env.env,
                **{
                    k: last.get(k)
                    for k in ("turns_per_episode", "tokens_per_episode", "model_tokens_per_episode", "failed_episodes")
                },
            },
            "buffer": self.buffer.held,
            "set_aside": self.buffer.set_aside,
            "rollouts_per_s": round(self.buffer.added * self.cfg.grpo.group_size / max(now - self.started, 1e-9), 2),
            "stale_dropped": self.buffer.dropped_stale,
            "leases": self.leases.summary() | {"declined": dict(self.declined)},
            "uptime_s": round(now - self.started, 1),
            "verification": verifier.summary() | {"groups_dropped": self.buffer.dropped_flagged},
            "evaluation": None if self.evals is None else self.evals.summary(),
            "penalties": dict(self.host.guard.counts),
            "banned": self.host.guard.banned_peers(),
            "peers": peers,
        }

    def worker_table(self) -> dict[str, dict[str, Any]]:
        """Each step's per-worker metrics: the status row plus the scheduler's estimates (rollouts/s while
        leased, seconds per lease; None until measured), keyed by the peer id's last 8 characters."""
        now = time.monotonic()
        with self._lock:
            workers = dict(self.workers)
        with self._sched_lock:
            estimates = {peer: (s.rollouts_per_s.value, s.lease_s.value) for peer, s in self.scheduler.workers.items()}
        table = {}
        for peer, w in workers.items():
            rate, lease_s = estimates.get(peer, (None, None))
            table[peer[-8:]] = {
                **w.row(self.versions.trained, now, self.activity(peer)[0]),
                "rollouts_per_s": None if rate is None else round(rate, 3),
                "lease_s": None if lease_s is None else round(lease_s, 3),
            }
        return table
