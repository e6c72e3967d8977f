"""Rollout intake: one submission from the wire to the replay buffer.

    validate (p2p.messages.RolloutSubmission: schema, counts, token ids, lengths, logprob range)
    -> the same submission sent again (the worker lost our reply)? the same reply, nothing counted twice
    -> close the lease (a replay, even a concurrent one, is a duplicate before any work is done)
    -> check against the lease (its groups in order, a version it may use)
    -> verify the groups chosen for checking (learner.orchestrate.verify; a mismatch flags the worker)
    -> score (the task's reward, computed here) -> journal (on disk before "accepted") -> buffer

A refused or failed submission gives its lease's prompt groups back at once. A failure of the learner's
own (a full disk under the journal) is answered as an internal error, never as the worker's fault (p2p.host).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgpack

from envs.episode import ReplayError
from learner.config import LearnerConfig
from learner.orchestrate.evaluations import EvalBoard
from learner.orchestrate.hosting import EpisodeHost
from learner.orchestrate.journal import RolloutJournal
from learner.orchestrate.leases import Lease, LeaseError, LeaseTable
from learner.orchestrate.replay import ReplayBuffer
from learner.orchestrate.rollouts import Rollout, ScoredGroup, score_groups
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.versions import PolicyVersions
from learner.orchestrate.workers import WorkerRecord
from learner.plan.admission import within_staleness
from learner.plan.scheduler import Scheduler
from learner.rollout_source import RolloutSource
from learner.tasks import Problem, Task, step_seed
from learner.train.models import Policy, eos_ids
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import GenerationRequest, MessageError, RolloutReply, RolloutSubmission, SamplingParams
from p2p.wire import FrameLimits, rollout_frame_limits

FORGOTTEN = 4096  # scored groups remembered, so that a draw under way as one is scored does not keep it again
ANSWERED_KEPT = 1024  # replies to submissions kept, so that a worker's resend gets the same answer
RESEND_WAIT = 120.0  # seconds a resend waits for the answer to its first sending, still being checked

log = logging.getLogger(__name__)


class PromptBook:
    """The prompt of each leased group: chosen by the learner, seeded by (run seed, group id), rendered once
    and forgotten once the group is scored."""

    def __init__(self, task: Task, policy: Policy, seed: int) -> None:
        self.task, self.policy, self.seed = task, policy, seed
        self.source = RolloutSource(task, policy)  # a task's prompts or an environment's episode seeds
        self._problems: dict[int, tuple[Problem, list[int]]] = {}
        self._forgotten: OrderedDict[int, None] = OrderedDict()  # the groups scored last (FORGOTTEN of them)
        self._lock = threading.Lock()

    def __getitem__(self, group_id: int) -> tuple[Problem, list[int]]:
        with self._lock:
            if group_id in self._problems:
                return self._problems[group_id]
        # drawn outside the lock: an environment's reset may wait on a service (envs.openenv_env), and other
        # leases' steps need the book meanwhile; a group drawn twice at once is the same draw, the first kept
        problem = self.task.sample(random.Random(step_seed(self.seed, group_id)))
        with self._lock:  # rendered under it: the tokenizer is not shared across threads
            if group_id in self._problems:
                return self._problems[group_id]
            drawn = (problem, self.source.prompt(problem))
            if group_id not in self._forgotten:  # scored while it was drawn: not kept again
                self._problems[group_id] = drawn
            return drawn

    def request(self, group_id: int, group_size: int) -> GenerationRequest:
        """What a lease asks of group `group_id`: its prompt G times (an environment's: G episodes of its seed)."""
        problem, prompt_ids = self[group_id]
        return self.source.request(problem, prompt_ids, group_size, group_id)

    def forget(self, group_ids: list[int]) -> None:
        with self._lock:
            for g in group_ids:
                self._problems.pop(g, None)
                self._forgotten[g] = None
            while len(self._forgotten) > FORGOTTEN:
                self._forgotten.popitem(last=False)


class RolloutIntake:
    """Takes rollout submissions (docstring of this module); thread-safe, called from handler threads."""

    def __init__(
        self, cfg: LearnerConfig, vocab_size: int, prompts: PromptBook, versions: PolicyVersions, leases: LeaseTable,
        verifier: RolloutVerifier, journal: RolloutJournal, buffer: ReplayBuffer, scheduler: Scheduler,
        scheduler_lock: threading.Lock,
    ) -> None:  # fmt: skip
        self.cfg, self.vocab_size, self.prompts, self.versions = cfg, vocab_size, prompts, versions
        self.leases, self.verifier, self.journal, self.buffer = leases, verifier, journal, buffer
        self.scheduler, self._sched_lock = scheduler, scheduler_lock
        self.evals: EvalBoard | None = None  # held-out evaluation leases (learner.orchestrate.evaluations)
        self.tokens_accepted = 0  # sampled tokens of all accepted rollouts: mean length turns tokens/s to rollouts/s
        self.episodes = prompts.source.episodes  # a multi-turn environment's rules, or None
        self.eos_ids = frozenset(eos_ids(prompts.policy))  # where a sampled completion ends, besides its budget
        hosted = self.episodes is not None and self.episodes.spec.hosted  # the learner steps the environment
        self.hosting = EpisodeHost(self.episodes, vocab_size, self._live_lease) if hosted else None
        self._lock = threading.Lock()
        # lease -> (worker, digest of what it sent, our reply) of the last ANSWERED_KEPT submissions taken: a worker
        # that lost our reply (a cut link) sends the same rollouts again and gets the same answer, nothing counted
        # twice; anything else for a closed lease is a replay. A resend that arrives while the first is still being
        # checked waits for its answer (_checking: lease -> worker, digest, set when answered)
        self._answered: OrderedDict[int, tuple[str, bytes, RolloutReply]] = OrderedDict()
        self._checking: dict[int, tuple[str, bytes, threading.Event]] = {}

    def _live_lease(self, lease_id: int) -> tuple[str, list[GenerationRequest]] | None:
        """A live training lease's worker and its groups' requests (what a hosted environment's host serves)."""
        lease = self.leases.get(lease_id)
        if lease is None or time.monotonic() > lease.deadline:
            return self.evals.live(lease_id) if self.evals is not None else None  # an evaluation's
        return lease.worker, [self.prompts.request(g, self.cfg.grpo.group_size) for g in lease.group_ids]

    def submit(self, worker: WorkerRecord, msg: dict) -> RolloutReply:
        arrived = time.monotonic()  # the worker's lease time ends here, not after our own checks
        peer, cfg = worker.peer_id, self.cfg
        lease_id = msg.get("lease")
        if peer in self.verifier.flagged:
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        digest = hashlib.sha256(msgpack.packb(msg)).digest()  # a resend is the same submission, byte for byte
        if isinstance(lease_id, int) and (resend := self._resent(lease_id, peer, digest)) is not None:
            return resend  # (an evaluation's lease is gone once answered: evals.holds() would say no)
        if self.evals is not None and self.evals.holds(lease_id):
            return self._answer_once(lease_id, peer, digest, lambda: self._take_evaluation(worker, msg))
        try:
            submission = RolloutSubmission.from_wire(
                msg, cfg.grpo.group_size, completion_tokens(cfg), self.vocab_size,
                max_turns=cfg.env.max_turns if self.episodes else 0,
            )  # fmt: skip
        except MessageError:
            worker.refused += 1
            self._give_back(peer, msg.get("lease"))  # junk must not hold prompt groups until the lease times out
            raise
        try:  # closing the lease first makes a replay, even a concurrent one, a duplicate before any work
            lease = self.leases.complete(submission.lease, peer)
        except LeaseError as exc:  # a replay or someone else's lease is an offence; a late one is not
            worker.refused += 1
            raise (Misbehaviour if exc.reason in ("duplicate", "not_owner") else BadRequest)(str(exc)) from None

        def take() -> RolloutReply:
            try:
                return self._take(worker, lease, submission, arrived)
            except BaseException as exc:  # refused, or our own failure (a full disk): its prompts go out again
                if isinstance(exc, BadRequest):
                    worker.refused += 1
                self.leases.release(lease)
                raise

        return self._answer_once(lease.lease_id, peer, digest, take)

    def _answer_once(self, lease_id: int, peer: str, digest: bytes, take: Callable[[], RolloutReply]) -> RolloutReply:
        """take() the submission `peer` sent for `lease_id`, keeping the reply: the same submission sent again
        (its worker never saw our answer: a connection lost on the way back) gets it again (_resent)."""
        done = threading.Event()
        with self._lock:
            self._checking[lease_id] = (peer, digest, done)
        try:
            reply = take()
            with self._lock:
                self._answered[lease_id] = (peer, digest, reply)
                while len(self._answered) > ANSWERED_KEPT:
                    self._answered.popitem(last=False)
            return reply
        finally:
            with self._lock:
                if self._checking.get(lease_id, (None, None, None))[2] is done:  # another's may have replaced it
                    del self._checking[lease_id]
            done.set()

    def _resent(self, lease_id: int, peer: str, digest: bytes) -> RolloutReply | None:
        """Our reply to the submission `peer` sent for `lease_id` if this is the same one sent again (waiting
        while the first is still being checked), else None."""
        with self._lock:
            checking = self._checking.get(lease_id)
        if checking is not None and checking[:2] == (peer, digest):
            checking[2].wait(RESEND_WAIT)
        with self._lock:
            answered = self._answered.get(lease_id)
        return answered[2] if answered is not None and answered[:2] == (peer, digest) else None

    def _take(self, worker: WorkerRecord, lease: Lease, submission: RolloutSubmission, arrived: float) -> RolloutReply:
        """Check, score, verify, journal and buffer a submission whose lease is closed. Scoring comes before the
        verifier's replay: it replays an environment's episodes (cheap, no model) and flags a forged one."""
        peer = worker.peer_id
        self._check_against_lease(lease, submission)
        version = submission.version
        problems = [self.prompts[g] for g in lease.group_ids]
        try:
            if self.hosting is not None:  # a hosted environment's episodes must be those the learner stepped
                self.hosting.check(lease.lease_id, submission)
            scored = score_groups(
                self.prompts.task, self.prompts.policy, [p for p, _ in problems], [ids for _, ids in problems],
                [g.completions for g in submission.groups], version, self.cfg.grpo.advantage_std,
            )  # fmt: skip
        except ReplayError as exc:  # an observation, ending or return the environment does not reproduce
            self.verifier.flag(peer, f"an episode does not replay: {exc}")
            self._drop_flagged(peer)
        if why := self._unfinished(submission):  # truncated or run past its end: chosen text, not a sample
            self.verifier.flag(peer, why)
            self._drop_flagged(peer)
        verified = self._verify(peer, lease, submission)
        groups = [ScoredGroup(g, version, peer, rollouts) for g, rollouts in zip(lease.group_ids, scored, strict=True)]
        self.journal.accept(groups)  # on disk before the worker hears "accepted" (learner.orchestrate.journal)
        self.prompts.forget(lease.group_ids)  # a group is scored once: its prompt need not be kept any more
        for group in groups:
            self.buffer.add(group)
        self.verifier.accepted(peer, verified, len(groups))  # only accepted work counts as verified
        fresh = within_staleness(self.versions.trained, version, self.buffer.staleness)
        with self._sched_lock:  # verification (a second or two per checked group) is not the worker's time
            self.scheduler.lease_done(peer, arrived, arrived - lease.issued_at, sum(len(g) for g in scored))
            for _ in scored:
                self.scheduler.group_arrived(peer, fresh=fresh)
        with self._lock:
            worker.groups_accepted += len(scored)
            self.tokens_accepted += sum(r.model_tokens for g in scored for r in g)
        return RolloutReply(len(scored))

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
        newest = self.versions.published
        if not lease.min_version <= submission.version <= newest:
            raise BadRequest(f"version {submission.version} is outside [{lease.min_version}, {newest}]")
        if [g.group for g in submission.groups] != lease.group_ids:
            raise Misbehaviour(f"the lease's groups are {lease.group_ids}, in that order")

    def _unfinished(self, submission: RolloutSubmission) -> str | None:
        """Why a completion did not end where sampling ends it: at its first end-of-turn token or at the token
        budget (a replay checks each token, not where the text stops). None for a multi-turn run (its episodes
        end as their environment replays them)."""
        if self.episodes is not None:
            return None
        budget = self.cfg.sampler.max_new_tokens
        for tokens in (c.tokens for g in submission.groups for c in g.completions):
            if not tokens:
                return "an empty completion"
            if any(t in self.eos_ids for t in tokens[:-1]):
                return "a completion runs on past its end-of-turn token"
            if tokens[-1] not in self.eos_ids and len(tokens) < budget:
                return f"a completion stops before its end-of-turn token and its budget of {budget} tokens"
        return None

    def _verify(self, peer: str, lease: Lease, submission: RolloutSubmission) -> int:
        """Replay the sampling of the groups chosen for checking (learner.orchestrate.verify); returns how many
        were checked. On a mismatch flag the worker and drop its groups from the buffer (and the journal)."""
        checked = 0
        for group in submission.groups:
            if not self.verifier.wants(peer):
                continue
            prompt = self.prompts[group.group][1]
            rollouts = [
                Rollout(prompt, c.tokens, c.logprobs, 0.0, 0.0, submission.version, c.spans) for c in group.completions
            ]
            quantized = None if lease.weights == "f16" else (lease.weights, lease_sampling(self.cfg, lease.lease_id))
            # None: the claimed version left the window of kept weights: too stale to train on, and unverifiable
            if self.verifier.check(peer, submission.version, lease.lease_id, group.group, rollouts,
                                   quantized=quantized) is None:  # fmt: skip
                raise BadRequest(f"v{submission.version} is too old to verify or train on: fetch a newer version")
            checked += 1
            if peer in self.verifier.flagged:
                self._drop_flagged(peer)
        return checked

    def _drop_flagged(self, peer: str) -> None:
        """A worker the verifier flagged: its leases go to others, its groups leave the buffer and the journal."""
        self.leases.requeue_worker(peer)  # none of its leases will be accepted any more
        dropped = self.buffer.drop_worker(peer)
        self.journal.drop([g.group_id for g in dropped])
        if self.evals is not None:  # the held-out figures it answered are recomputed without it
            self.evals.revoke(peer, self.verifier.flagged[peer])
        log.warning(
            "worker %s flagged: %s; %d of its groups dropped from the buffer",
            peer[-8:], self.verifier.flagged[peer], len(dropped),
        )  # fmt: skip
        raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")

    def _take_evaluation(self, worker: WorkerRecord, msg: dict) -> RolloutReply:
        """An evaluation lease's completions (learner.orchestrate.evaluations): every group verified."""
        assert self.evals is not None
        peer = worker.peer_id
        try:
            max_turns = self.cfg.env.max_turns if self.episodes else 0
            verdict, figure = self.evals.submit(peer, msg, self.vocab_size, completion_tokens(self.cfg), max_turns)
        except (MessageError, BadRequest, Misbehaviour):
            worker.refused += 1
            if peer in self.verifier.flagged:
                self._drop_flagged(peer)
            raise
        self.verifier.accepted(peer, verdict["checked"])
        if figure is None:
            log.info("held-out answer from %s verified (%d groups); the figure waits for a second evaluator",
                     peer[-8:], verdict["checked"])  # fmt: skip
        return RolloutReply(verdict["groups"])


def lease_sampling(cfg: LearnerConfig, lease_id: int) -> SamplingParams:
    """How a training lease samples: the run's sampler, keyed by the lease's id (every draw: p2p.draws)."""
    sampler = cfg.sampler
    return SamplingParams(sampler.temperature, sampler.top_p, sampler.max_new_tokens, seed=lease_id)


def completion_tokens(cfg: LearnerConfig) -> int:
    """The most tokens one completion may hold: max_new_tokens, or an episode's max_episode_tokens."""
    return cfg.env.max_episode_tokens if cfg.env.env else cfg.sampler.max_new_tokens


def rollout_limits(cfg: LearnerConfig) -> FrameLimits:
    """What one rollout submission may hold: a lease's groups of G completions of at most completion_tokens
    tokens (p2p.wire.rollout_frame_limits). With --eval-every, at least an evaluation lease's completions."""
    grpo, tokens = cfg.grpo, completion_tokens(cfg)
    completions, groups = cfg.swarm.groups_per_lease * grpo.group_size, cfg.swarm.groups_per_lease
    if cfg.eval.eval_every:  # an evaluation lease: a greedy and a k-sample group per held-out prompt
        completions = max(completions, cfg.eval.eval_prompts * (1 + cfg.eval.eval_samples))
        groups = max(groups, 2 * cfg.eval.eval_prompts)
    arrays = max(tokens, grpo.group_size, cfg.eval.eval_samples, groups, 2 * cfg.env.max_turns, 16)  # spans too
    return rollout_frame_limits(completions * tokens, completions, arrays)
