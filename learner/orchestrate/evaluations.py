"""Held-out evaluation in a swarm: the run's held-out set leased whole to one worker, verified like any lease.

    request(v)      after version v is published: evaluate a version >= v
    offer(worker)   a worker holding x >= v asks for work and no evaluation lease is out: it gets one lease of
                    n greedy and n k-sample groups (learner.evaluation.Evaluator.requests), drawn from the run's
                    evaluation stream; x stays in the verifier's window until the lease ends
    submit          validate -> the lease's groups, sizes and version x -> verify the groups the verifier picks
                    (sampled: draws and logprobs; greedy: every token the most likely) -> score -> a result
    expiry, or the worker going silent: the next worker that asks gets the evaluation

One worker and one version per evaluation, so its figures are those of one policy: the ones `echo-rl eval`
computes on that version's checkpoint (the same prompts and draws, the same llama.cpp sampling).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from envs.episode import ReplayError
from learner.evaluation import Evaluator
from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify import RolloutVerifier
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import LeaseGrant, RolloutSubmission


@dataclass
class EvalLease:
    lease_id: int
    worker: str
    version: int  # the version the worker evaluates (it held it when it asked)
    issued_at: float
    deadline: float


class EvalBoard:
    """The evaluations a swarm run asked for and the one lease out on them; thread-safe (handler threads)."""

    def __init__(self, evaluator: Evaluator, verifier: RolloutVerifier, timeout_s: float) -> None:
        self.evaluator, self.verifier, self.timeout_s = evaluator, verifier, timeout_s
        self.requests = evaluator.requests()  # rendered once: the same prompts at every evaluation
        self.pending: list[int] = []  # versions asked for (evaluate one >= each), oldest first
        self.lease: EvalLease | None = None
        self.taking: EvalLease | None = None  # a lease whose completions are being checked: none is offered meanwhile
        self.results: list[dict] = []  # finished evaluations not yet put in a step's record
        self.last: dict | None = None  # the newest finished evaluation, for status
        self.issued = self.expired = 0
        self._lock = threading.Lock()

    def request(self, version: int) -> None:
        with self._lock:
            if version not in self.pending:
                self.pending.append(version)

    def waiting_for(self, version: int) -> bool:
        """Whether an evaluation of `version` (or a newer one) is still to come."""
        with self._lock:
            return any(v <= version for v in self.pending)

    def drain(self) -> list[dict]:
        with self._lock:
            results, self.results = self.results, []
            return results

    def offer(self, worker: str, version: int) -> LeaseGrant | None:
        """An evaluation lease for a worker holding `version`, if one is due and it may take it."""
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            if self.lease is not None or self.taking is not None or not self.pending or version < self.pending[0]:
                return None
            if self.verifier.enabled and version not in self.verifier.versions:
                return None  # its work could not be verified
            self.lease = EvalLease(secrets.randbits(62), worker, version, now, now + self.timeout_s)
            self.issued += 1
            self.verifier.pin(version)
            lease_id = self.lease.lease_id
        return LeaseGrant(
            lease_id, self.requests, self.evaluator.params, min_version=version, deadline_s=self.timeout_s
        )

    def summary(self) -> dict:
        """For the status document: versions waiting for an evaluation, the lease out, the counts, the newest result."""
        with self._lock:
            lease = self.lease
            out = None if lease is None else {"worker": lease.worker[-8:], "version": lease.version}
            return {
                "pending": list(self.pending), "leased": out, "issued": self.issued, "expired": self.expired,
                "last": self.last,
            }  # fmt: skip

    def holds(self, lease_id: object) -> bool:
        with self._lock:
            return self.lease is not None and self.lease.lease_id == lease_id

    def forget_worker(self, worker: str) -> None:
        """A silent worker's evaluation lease is given up: the next worker that asks gets the evaluation."""
        with self._lock:
            if self.lease is not None and self.lease.worker == worker:
                self._end_locked()

    def submit(self, peer: str, msg: dict, vocab_size: int, max_tokens: int, max_turns: int = 0) -> tuple[dict, int]:
        """Take an evaluation lease's completions: (the result, groups verified). Raises BadRequest or
        Misbehaviour like training submissions; the verifier may have flagged `peer` (the caller acts on it).
        `max_turns` > 0: an environment's episodes (p2p.messages.RolloutSubmission.from_wire)."""
        with self._lock:  # closing the lease first: a replay, even a concurrent one, finds none
            lease = self.lease
            if lease is None or lease.lease_id != msg.get("lease"):
                raise BadRequest("no such evaluation lease (it expired)")
            if lease.worker != peer:
                raise Misbehaviour("another worker's evaluation lease")
            self.lease, self.taking = None, lease  # its version stays pinned while it is verified
        try:
            return self._take(peer, lease, msg, vocab_size, max_tokens, max_turns)
        finally:
            with self._lock:
                self.taking = None  # done, or refused: then the evaluation is still pending for the next worker
            self.verifier.unpin(lease.version)

    def _take(
        self, peer: str, lease: EvalLease, msg: dict, vocab_size: int, max_tokens: int, max_turns: int
    ) -> tuple[dict, int]:
        sizes = [r.group_size for r in self.requests]
        submission = RolloutSubmission.from_wire(msg, sizes, max_tokens, vocab_size, max_turns)
        if submission.version != lease.version:
            raise BadRequest(f"the evaluation lease is for v{lease.version}, not v{submission.version}")
        if [g.group for g in submission.groups] != [r.group for r in self.requests]:
            raise Misbehaviour("the evaluation lease's groups, in order, are required")
        checked = 0
        for request, group in zip(self.requests, submission.groups, strict=True):
            if not self.verifier.wants(peer):
                continue
            rollouts = [
                Rollout(request.prompt_ids, c.tokens, c.logprobs, 0.0, 0.0, lease.version, c.spans)
                for c in group.completions
            ]
            if request.greedy:
                measured = self.verifier.check_greedy(peer, lease.version, rollouts)
            else:
                measured = self.verifier.check(peer, lease.version, self.evaluator.params.seed, request.group, rollouts)
            checked += measured is not None
            if peer in self.verifier.flagged:
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
        try:  # an environment's episodes are replayed: one that does not reproduce is a forgery
            figures = self.evaluator.score([g.completions for g in submission.groups])
        except ReplayError as exc:
            self.verifier.flag(peer, f"an evaluation episode does not replay: {exc}")
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}") from None
        result = {
            "version": lease.version,
            **figures,
            "worker": peer[-8:],
            "seconds": round(time.monotonic() - lease.issued_at, 3),
        }
        with self._lock:
            self.results.append(result)
            self.last = result
            self.pending = [v for v in self.pending if v > lease.version]
        return result, checked

    def _expire_locked(self, now: float) -> None:
        if self.lease is not None and now > self.lease.deadline:
            self.expired += 1
            self._end_locked()

    def _end_locked(self) -> None:
        assert self.lease is not None
        self.verifier.unpin(self.lease.version)
        self.lease = None
