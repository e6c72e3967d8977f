"""The learner's side of the worker protocols: model spec, leases, rollout intake and heartbeats.

Handlers run in the host's worker threads, concurrently with the training loop; everything they share
with it (the replay buffer, the lease table, the versions) is thread-safe. Every rollout is validated
before it is scored: schema, counts, token ids within the vocabulary, lengths within the lease's token
budget, logprobs in [LOGPROB_FLOOR, 0] (p2p.messages), lease ownership; everything a worker states
(versions, rates, hardware) is checked before it is stored. Rewards are computed here, never taken from
a worker. A failure of the learner's own (a full disk under the journal) is answered as an internal
error, never as the worker's fault (p2p.host).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from learner.config import LearnerConfig
from learner.journal import JournalState, RolloutJournal
from learner.leases import Lease, LeaseError, LeaseTable
from learner.models import Policy
from learner.replay import ReplayBuffer, ScoredGroup
from learner.rollouts import score_groups
from learner.run import step_seed
from learner.scheduler import Decision, Scheduler, SchedulerConfig
from learner.tasks import Problem, Task
from learner.trainer import Rollout
from learner.verify import RolloutVerifier
from p2p.broadcast import Seeder
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    ROLLOUT,
    SPEC,
    STATUS,
    Heartbeat,
    LeaseRequest,
    MessageError,
    ModelSpec,
    RolloutSubmission,
)
from p2p.wire import FrameLimits

log = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    """What the learner knows about one worker."""

    peer_id: str
    price: float = 0.0
    version: int = -1  # newest version it reported holding
    tokens_per_s: float = 0.0  # its own measurement, from heartbeats
    last_seen: float = field(default_factory=time.monotonic)
    groups_accepted: int = 0
    tokens_accepted: int = 0
    refused: int = 0
    hardware: str = ""  # what it declared it runs on, e.g. "llamacpp, 2 threads, x86_64 (8 cores)"


class LearnerService:
    """Serves SPEC, LEASE, ROLLOUT and HEARTBEAT for one run.

    Lease policy. pull: a worker gets a lease only if it holds the newest version, and only until the
    groups leased or buffered at that version make one batch. async: a worker gets a lease if its version
    is within the staleness bound (v - x <= S) and no newer version is being encoded right now, while
    leased plus buffered groups stay below prefetch_batches batches, and (autoscale) the scheduler has
    it active.
    """

    def __init__(
        self,
        seeder: Seeder,
        cfg: LearnerConfig,
        policy: Policy,
        task: Task,
        spec: ModelSpec,
        run_id: str,
        journal: RolloutJournal,
        verifier: RolloutVerifier,
        resumed: JournalState | None = None,
    ) -> None:
        self.seeder = seeder
        self.host = host = seeder.host
        self.cfg = cfg
        self.policy = policy
        self.task = task
        self.spec = spec
        self.run_id = run_id
        swarm = cfg.swarm
        grpo = cfg.grpo
        self.buffer = ReplayBuffer(
            0 if swarm.sync_mode == "pull" else swarm.staleness, grpo.dynamic_sampling, grpo.sampling_rounds
        )
        self.journal = journal
        self.verifier = verifier
        resumed = resumed or JournalState()
        # group ids go on from the last one leased; groups leased but never returned are leased again
        self.leases = LeaseTable(swarm.lease_timeout, resumed.next_group)
        self.leases.requeued.extend(resumed.unreturned())
        # pull mode uses every worker: each lease there waits for the newest version, which the model does not cover
        self.autoscale = swarm.autoscale and swarm.sync_mode == "async"
        self.scheduler = Scheduler(
            SchedulerConfig(
                rollouts_per_step=cfg.grpo.prompts_per_step * cfg.grpo.group_size,
                publish_every=swarm.publish_every,
                staleness=swarm.staleness,
                margin=swarm.margin,
                silence_s=swarm.worker_silence,
                max_groups_per_lease=swarm.groups_per_lease,
                lease_timeout_s=swarm.lease_timeout,
            )
        )
        self._sched_lock = threading.Lock()  # handlers run on several threads; the scheduler is not thread-safe
        self.version = 0  # policy version the learner holds (optimizer steps done)
        self.newest_published = -1
        self.publishing = -1  # version being encoded in the background, -1 if none
        self.workers: dict[str, WorkerRecord] = {}
        self.bcast_seconds: dict[int, float] = {}  # version -> seconds until the first worker held it
        self.published_at: dict[int, float] = {}
        self._bcast_seen = -1  # newest version whose broadcast time the scheduler has seen
        self.tokens_accepted = 0  # completion tokens of all accepted rollouts
        self.version_bytes: dict[int, int] = {}  # version -> bytes on the wire
        self._problems: dict[int, tuple[Problem, list[int]]] = {}
        self._lock = threading.Lock()
        host.handle(SPEC, self._on_spec)
        host.handle(LEASE, self._on_lease)
        host.handle(ROLLOUT, self._on_rollout, limits=rollout_limits(cfg))
        host.handle(HEARTBEAT, self._on_heartbeat)
        host.handle(STATUS, lambda peer, msg: self.status(), guarded=False)  # read-only, open to any peer
        self.last_step: dict[str, Any] = {}  # the newest step's metrics, set by the training loop
        self.started = time.monotonic()

    def problem(self, group_id: int) -> tuple[Problem, list[int]]:
        """The prompt of group `group_id`: chosen by the learner, seeded by (run seed, group id)."""
        with self._lock:
            if group_id not in self._problems:
                problem = self.task.sample(random.Random(step_seed(self.cfg.run.seed, group_id)))
                self._problems[group_id] = (problem, self.policy.render_prompt(problem.prompt))
            return self._problems[group_id]

    def groups_per_batch(self) -> int:
        """Groups to generate for one batch: prompts_per_step, or with dynamic sampling as many more as
        the share of groups with signal says (at most sampling_rounds batches' worth)."""
        grpo = self.cfg.grpo
        if not grpo.dynamic_sampling:
            return grpo.prompts_per_step
        share = max(self.buffer.signal_share, 1 / grpo.sampling_rounds)
        return math.ceil(grpo.prompts_per_step / share)

    def mark_published(self, version: int, payload_bytes: int) -> None:
        with self._lock:
            self.version_bytes[version] = payload_bytes
            self.newest_published = version
            if self.publishing == version:
                self.publishing = -1
            self.published_at[version] = time.monotonic()
            for per_version in (self.version_bytes, self.published_at, self.bcast_seconds):
                for old in [v for v in per_version if v < version - 100]:  # bounded over long runs
                    del per_version[old]

    def _worker(self, peer: str) -> WorkerRecord:
        with self._lock:
            record = self.workers.get(peer)
            if record is None:
                record = self.workers[peer] = WorkerRecord(peer)
            record.last_seen = time.monotonic()
        with self._sched_lock:
            self.scheduler.seen(peer, record.last_seen)
        return record

    def schedule(self, step: int, train_s: float, step_s: float, trained: bool) -> list[Decision]:
        """After each step: update the estimates, drop silent workers, re-plan who generates."""
        now = time.monotonic()
        with self._lock:
            new_bcast = [s for v, s in self.bcast_seconds.items() if v > self._bcast_seen]
            self._bcast_seen = max(self.bcast_seconds, default=self._bcast_seen)
        with self._sched_lock:
            self.scheduler.cfg.rollouts_per_step = self.groups_per_batch() * self.cfg.grpo.group_size
            self.scheduler.step_done(step, train_s, step_s, trained)
            for seconds in new_bcast:
                self.scheduler.broadcast_done(seconds)
            for peer, seconds in self.leases.drain_expirations():  # nothing delivered: measured as such
                self.scheduler.lease_expired(peer, seconds)
            for peer in self.scheduler.drop_silent(now):
                requeued = self.leases.requeue_worker(peer)
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

    def _on_spec(self, peer: str, msg: dict) -> dict:
        self._worker(peer)
        return {"run_id": self.run_id, "spec": self.spec.to_dict(), "group_size": self.cfg.grpo.group_size}

    def _on_heartbeat(self, peer: str, msg: dict) -> dict:
        beat = Heartbeat.from_wire(msg)  # bounded types and ranges (MessageError: a penalty)
        self._check_published(beat.version)
        worker = self._worker(peer)
        with self._lock:
            if beat.version > worker.version and beat.version in self.published_at:
                self.bcast_seconds.setdefault(beat.version, time.monotonic() - self.published_at[beat.version])
            worker.version = beat.version
            worker.price = beat.price
            worker.tokens_per_s = beat.tokens_per_s
            worker.hardware = describe_hardware(beat.hardware)
        with self._sched_lock:
            self.scheduler.seen(peer, worker.last_seen, worker.price)
        self._declare_rate(peer, worker.tokens_per_s)
        return {"newest": self.newest_published}

    def _check_published(self, version: int) -> None:
        """A version a worker states must have been published before it is stored (status shows it).
        The next publication is refused without a penalty: its manifest can be fetched a moment before
        newest_published is set. Anything beyond that no honest worker can hold."""
        newest = self.newest_published
        if version > newest:
            kind = Misbehaviour if version > newest + self.cfg.swarm.publish_every else BadRequest
            raise kind(f"version {version} was never published (newest is {newest})")

    def _declare_rate(self, peer: str, tokens_per_s: float) -> None:
        """Turn a worker's own tokens/s into a declared rollouts/s: the scheduler plans on it until measured."""
        tokens, groups = self.tokens_accepted, self.buffer.added
        if tokens_per_s <= 0 or tokens == 0:
            return
        rollout_tokens = tokens / (groups * self.cfg.grpo.group_size)
        rate = tokens_per_s / rollout_tokens
        lease_s = self.cfg.swarm.groups_per_lease * self.cfg.grpo.group_size / rate
        with self._sched_lock:
            self.scheduler.declare(peer, rate, lease_s)

    def _on_lease(self, peer: str, msg: dict) -> dict:
        request = LeaseRequest.from_wire(msg)
        held, max_groups = request.version, request.max_groups
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        self._check_published(held)
        if held < 0:
            raise BadRequest("a lease needs a policy version: fetch one first")
        worker = self._worker(peer)
        with self._lock:
            worker.version = max(worker.version, held)
        swarm, grpo = self.cfg.swarm, self.cfg.grpo
        wait = {"wait": 0.2, "newest": self.newest_published}
        if swarm.sync_mode == "pull":
            if held != self.version:
                return wait  # refresh to the newest version first (or wait until it is published)
            room = self.groups_per_batch() - len(self.buffer) - self.leases.outstanding_groups()
        else:
            if self.version - held > swarm.staleness:
                return wait  # too stale to be useful: update first
            if held < self.publishing:
                return wait  # the next version is being encoded (about a second): generate with that one
            if self.autoscale:
                with self._sched_lock:
                    if not self.scheduler.may_lease(peer):  # it keeps polling, so it fetches and relays versions
                        return {"wait": 0.5, "newest": self.newest_published, "inactive": True}
            wanted = swarm.prefetch_batches * self.groups_per_batch()
            room = wanted - len(self.buffer) - self.leases.outstanding_groups()
        with self._sched_lock:
            n = min(max_groups, self.scheduler.lease_groups(peer), room)
            deadline = self.scheduler.lease_deadline(peer)
        if n <= 0:
            return wait
        lease = self.leases.issue(peer, n, min_version=held, timeout_s=deadline)
        self.journal.issue(lease.group_ids)
        sampler = self.cfg.sampler
        return {
            "lease": {
                "id": lease.lease_id,
                "groups": [{"group": g, "prompt_ids": self.problem(g)[1]} for g in lease.group_ids],
                "group_size": grpo.group_size,
                "params": {
                    "temperature": sampler.temperature,
                    "top_p": sampler.top_p,
                    "max_new_tokens": sampler.max_new_tokens,
                    "seed": lease.lease_id,
                },
                "min_version": held,
                "deadline_s": deadline,
            }
        }

    def _on_rollout(self, peer: str, msg: dict) -> dict:
        arrived = time.monotonic()  # the worker's lease time ends here, not after our own checks
        grpo, vocab = self.cfg.grpo, self.spec.vocab_size
        worker = self._worker(peer)
        try:
            submission = RolloutSubmission.from_wire(msg, grpo.group_size, self.cfg.sampler.max_new_tokens, vocab)
        except MessageError:
            worker.refused += 1
            self._give_back(peer, msg.get("lease"))  # junk must not hold prompt groups until the lease times out
            raise
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        try:  # closing the lease first makes a replay, even a concurrent one, a duplicate before any work
            lease = self.leases.complete(submission.lease, peer)
        except LeaseError as exc:  # a replay or someone else's lease is an offence; a late one is not
            worker.refused += 1
            raise (Misbehaviour if exc.reason in ("duplicate", "not_owner") else BadRequest)(str(exc)) from None
        try:
            return self._take(peer, worker, lease, submission, arrived)
        except BaseException as exc:  # refused, or our own failure (a full disk): its prompts go out again
            if isinstance(exc, BadRequest):
                worker.refused += 1
            self.leases.release(lease)
            raise

    def _take(
        self, peer: str, worker: WorkerRecord, lease: Lease, submission: RolloutSubmission, arrived: float
    ) -> dict:
        """Check, verify, score, journal and buffer a submission whose lease is closed."""
        self._check_against_lease(lease, submission)
        verified = self._verify(peer, lease.lease_id, submission)
        completions = [g.completions for g in submission.groups]
        version = submission.version
        problems = [self.problem(g) for g in lease.group_ids]
        scored = score_groups(
            self.task, self.policy, [p for p, _ in problems], [ids for _, ids in problems], completions, version
        )
        groups = [ScoredGroup(g, version, peer, rollouts) for g, rollouts in zip(lease.group_ids, scored, strict=True)]
        self.journal.accept(groups)  # on disk before the worker hears "accepted" (learner.journal)
        with self._lock:  # a group is scored once: its prompt need not be remembered (nor rebuilt) any more
            for g in lease.group_ids:
                self._problems.pop(g, None)
        for group in groups:
            self.buffer.add(group)
        self.verifier.accepted(peer, verified)  # only accepted work counts as verified
        with self._sched_lock:  # verification (a second or two per checked group) is not the worker's time
            self.scheduler.lease_done(peer, arrived, arrived - lease.issued_at, sum(len(g) for g in scored))
            for _ in scored:
                self.scheduler.group_arrived(peer, fresh=self.version - version <= self.buffer.staleness)
        tokens = sum(len(r.completion_ids) for g in scored for r in g)
        with self._lock:
            worker.groups_accepted += len(scored)
            worker.tokens_accepted += tokens
            self.tokens_accepted += tokens  # all workers: the mean rollout length turns tokens/s into rollouts/s
        return {"accepted": len(scored)}

    def _give_back(self, peer: str, lease_id: object) -> None:
        """Release the live lease `lease_id` of `peer`, if it is one, so that its groups go to others now."""
        lease = self.leases.get(lease_id) if isinstance(lease_id, int) else None
        if lease is not None and lease.worker == peer:
            try:
                self.leases.release(self.leases.complete(lease.lease_id, peer))
            except LeaseError:  # closed meanwhile (expired, or a concurrent submission)
                pass

    def _check_against_lease(self, lease: Lease, submission: RolloutSubmission) -> None:
        """What the wire schema cannot know: the lease's groups in order, a version it may use."""
        if not lease.min_version <= submission.version <= self.newest_published:
            raise BadRequest(f"version {submission.version} is outside [{lease.min_version}, {self.newest_published}]")
        if [g.group for g in submission.groups] != lease.group_ids:
            raise Misbehaviour(f"the lease's groups are {lease.group_ids}, in that order")

    def _verify(self, peer: str, lease_id: int, submission: RolloutSubmission) -> int:
        """Replay the sampling of the groups chosen for checking (learner.verify); returns how many were
        checked. On a mismatch flag the worker and drop its groups from the buffer (and the journal)."""
        checked = 0
        for group in submission.groups:
            if not self.verifier.wants(peer):
                continue
            prompt = self.problem(group.group)[1]
            rollouts = [Rollout(prompt, c.tokens, c.logprobs, 0.0, 0.0, submission.version) for c in group.completions]
            # None: the claimed version left the window of kept weights, so the group is too stale to train on
            if self.verifier.check(peer, submission.version, lease_id, group.group, rollouts) is not None:
                checked += 1
            if peer in self.verifier.flagged:
                self.leases.requeue_worker(peer)  # none of its leases will be accepted any more
                dropped = self.buffer.drop_worker(peer)
                self.journal.drop([g.group_id for g in dropped])
                log.warning(
                    "worker %s flagged: %s; %d of its groups dropped from the buffer",
                    peer[-8:], self.verifier.flagged[peer], len(dropped),
                )  # fmt: skip
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        return checked

    # -- figures for metrics and status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status document served on /echo/status/1 (schema: docs/status.md)."""
        swarm, last = self.cfg.swarm, self.last_step
        newest = self.newest_published
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
                    "addr": addrs[0] if addrs else None,
                    "role": "worker",
                    "active": active,
                    "activity": reason,
                    "price": w.price,
                    "hardware": w.hardware,
                    "version": w.version,
                    "version_lag": self.version - w.version if w.version >= 0 else None,
                    "newest_share": 1.0 if w.version == newest else (have / len(manifest.chunks) if manifest else 0.0),
                    "tokens_per_s": round(w.tokens_per_s, 1),
                    "open_leases": open_leases.get(w.peer_id, 0),
                    "groups_accepted": w.groups_accepted,
                    "refused": w.refused,
                    "stale_dropped": self.buffer.dropped_by_worker.get(w.peer_id, 0),
                    "verified": self.verifier.checked.get(w.peer_id, 0),
                    "flagged": self.verifier.flagged.get(w.peer_id),
                    "last_seen_s": round(now - w.last_seen, 1),
                }
            )
        divergences, misses = self.verifier.recent()
        divergences.sort()
        return {
            "schema": 1,
            "run_id": self.run_id,
            "peer_id": self.host.peer_id,
            "addrs": self.host.addrs,
            "step": self.version,
            "steps": self.cfg.run.steps,
            "version_published": newest,
            "mode": swarm.sync_mode,
            "staleness": swarm.staleness,
            "publish_every": swarm.publish_every,
            "utilisation": last.get("utilisation"),
            "reward": last.get("reward_mean"),
            "buffer": self.buffer.held,
            "set_aside": self.buffer.set_aside,
            "rollouts_per_s": round(self.buffer.added * self.cfg.grpo.group_size / max(now - self.started, 1e-9), 2),
            "stale_dropped": self.buffer.dropped_stale,
            "uptime_s": round(now - self.started, 1),
            "verification": {
                "groups_checked": len(divergences),
                "divergence_median": divergences[len(divergences) // 2] if divergences else None,
                "divergence_max": divergences[-1] if divergences else None,
                "draw_miss_max": max(misses, default=None),
                "tolerance": swarm.verify_tolerance,
                "draw_tolerance": swarm.verify_draw_tolerance,
                "flagged": dict(self.verifier.flagged),
                "groups_dropped": self.buffer.dropped_flagged,
            },
            "penalties": dict(self.host.guard.counts),
            "banned": self.host.guard.banned_peers(),
            "peers": peers,
        }

    def worker_table(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            workers = dict(self.workers)
        with self._sched_lock:
            estimates = {peer: (s.rollouts_per_s.value, s.lease_s.value) for peer, s in self.scheduler.workers.items()}
        return {
            peer[-8:]: {
                "active": self.activity(peer)[0],
                # the scheduler's estimates: rollouts/s while leased, seconds per lease (None until measured)
                "rollouts_per_s": _round(estimates.get(peer, (None, None))[0]),
                "lease_s": _round(estimates.get(peer, (None, None))[1]),
                "version": w.version,
                "version_lag": self.version - w.version if w.version >= 0 else None,
                "tokens_per_s": round(w.tokens_per_s, 1),
                "groups": w.groups_accepted,
                "refused": w.refused,
                "price": w.price,
                "seen_s_ago": round(now - w.last_seen, 1),
            }
            for peer, w in workers.items()
        }


def rollout_limits(cfg: LearnerConfig) -> FrameLimits:
    """What one rollout submission may hold: a lease's groups of G completions of at most max_new_tokens
    tokens, at most 16 bytes of msgpack per token (an int and a float64) plus framing; twice that, as slack."""
    grpo, tokens = cfg.grpo, cfg.sampler.max_new_tokens
    size = cfg.swarm.groups_per_lease * grpo.group_size * (16 * tokens + 64) + 4096
    return FrameLimits(
        max_bytes=2 * size, max_array=max(tokens, grpo.group_size, cfg.swarm.groups_per_lease, 16),
        max_map=16, max_str=64, max_bin=0,
    )  # fmt: skip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def describe_hardware(hardware: dict) -> str:
    """One bounded line from a worker's declared hardware (untrusted input: only known keys, short values)."""
    engine, machine = str(hardware.get("engine", "?"))[:16], str(hardware.get("machine", "?"))[:16]
    threads, cores = hardware.get("threads"), hardware.get("cores")
    threads = threads if isinstance(threads, int) and 0 < threads < 10_000 else "?"
    cores = cores if isinstance(cores, int) and 0 < cores < 10_000 else "?"
    return f"{engine}, {threads} threads, {machine} ({cores} cores)"
