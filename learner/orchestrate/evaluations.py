"""Held-out evaluation in a swarm: the run's held-out set leased whole to workers, every group verified.

    request(v)      after version v is published: evaluate a version >= v
    offer(worker)   a worker holding x >= v asks for work: it gets one lease of n greedy and n k-sample groups
                    (learner.evaluation.Evaluator.requests), drawn from the run's evaluation stream. The first
                    such lease opens a round on x (x stays in the verifier's window until the round ends); while
                    it is open, another worker holding exactly x gets the same lease, up to EVALUATORS workers
    submit          validate -> the lease's groups, sizes and version x -> verify every group, whatever the
                    worker's standing (sampled: logprobs, draws, off-draw share; greedy: each token the most
                    likely) -> replay an environment's episodes -> the answer and each prompt's doubt
    a figure        once EVALUATORS answers are in, or once no other can come (no lease out, and no other live
                    worker holds x or an older version, or the first answer is one lease time old): per prompt,
                    the answer whose groups replayed closer (RolloutVerifier.doubt); scored; recorded with every
                    evaluator's verdict
    revoke(worker)  a worker flagged later: each kept figure it answered is revoked and recomputed from the other
                    evaluator's answer; a figure it answered alone is revoked and a newer version evaluated again

Why so strict: a held-out figure is what a user believes about the run, and one group of forged right answers
moves it by 1/n, so no group goes unverified (a training group may: it is one of thousands of gradient
samples). Two evaluators make a forgery that slips through the verifier's tolerances lose, prompt by prompt,
to the answer that replays closer, and a figure never rests on one stranger where the swarm has two workers.

One version per figure, so its figures are those of one policy: the ones `echo-rl eval` computes on that
version's checkpoint (the same prompts and draws, the same llama.cpp sampling).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envs.episode import ReplayError
from learner.evaluation import Evaluator
from learner.orchestrate.hosting import EpisodeHost
from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.workers import WorkerRecord
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import Completion, GenerationRequest, LeaseGrant, RolloutSubmission

log = logging.getLogger(__name__)

EVALUATORS = 2  # workers whose answers make one figure, where the swarm has that many holding the version
KEPT_FIGURES = 16  # the newest figures whose answers are kept, to recompute one whose evaluator is flagged later


@dataclass
class EvalLease:
    lease_id: int
    worker: str
    version: int  # the version the worker evaluates (it held it when it asked)
    issued_at: float
    deadline: float


@dataclass
class Answer:
    """One worker's verified answer to an evaluation lease."""

    worker: str
    groups: list[list[Completion]]  # in requests() order: n greedy groups, then n sampled ones
    doubts: list[float]  # per prompt: the larger doubt of its greedy and its sampled group (0: replayed exactly)
    verdict: dict[str, Any]  # what the verifier found, recorded beside the figure


@dataclass
class Round:
    """The evaluation of one version under way: its leases out, the answers in, the answers being verified."""

    version: int
    opened_at: float
    leases: dict[int, EvalLease] = field(default_factory=dict)  # lease id -> lease
    answers: list[Answer] = field(default_factory=list)
    taking: set[str] = field(default_factory=set)  # workers whose answers are being verified
    first_answer_at: float = 0.0

    def workers(self) -> set[str]:
        return {lease.worker for lease in self.leases.values()} | {a.worker for a in self.answers} | self.taking


class EvalBoard:
    """The evaluations a swarm run asked for and the round under way; thread-safe (handler threads).

    `workers`: the learner's live workers (peer id -> record, the version each holds), read to know whether a
    second evaluator can still come."""

    def __init__(
        self, evaluator: Evaluator, verifier: RolloutVerifier, timeout_s: float,
        workers: Mapping[str, WorkerRecord] | None = None, evaluators: int = EVALUATORS,
    ) -> None:  # fmt: skip
        self.evaluator, self.verifier, self.timeout_s = evaluator, verifier, timeout_s
        self.hosting: EpisodeHost | None = None  # a hosted environment's host (learner.orchestrate.hosting)
        self.workers = workers if workers is not None else {}
        self.evaluators = evaluators
        self.requests = evaluator.requests()  # rendered once: the same prompts at every evaluation
        self.pending: list[int] = []  # versions asked for (evaluate one >= each), oldest first
        self.round: Round | None = None
        self.results: list[dict] = []  # figures not yet put in a step's record
        self.revocations: list[dict] = []  # revoked figures not yet put in a step's record
        self.kept: dict[int, tuple[int, list[Answer]]] = {}  # figure -> (version, answers), the newest KEPT_FIGURES
        self.last: dict | None = None  # the newest figure, for status
        self.issued = self.expired = self.figures = self.revoked = 0
        self._lock = threading.Lock()

    def request(self, version: int) -> None:
        with self._lock:
            if version not in self.pending:
                self.pending.append(version)
                self.pending.sort()

    def waiting_for(self, version: int) -> bool:
        """Whether an evaluation of `version` (or a newer one) is still to come."""
        with self._lock:
            self._settle_locked(time.monotonic())
            return any(v <= version for v in self.pending)

    def drain(self) -> tuple[list[dict], list[dict]]:
        """The figures recorded and revoked since the last drain, oldest first."""
        with self._lock:
            self._settle_locked(time.monotonic())
            results, self.results = self.results, []
            revocations, self.revocations = self.revocations, []
            return results, revocations

    def offer(self, worker: str, version: int) -> LeaseGrant | None:
        """An evaluation lease for a worker holding `version`, if one is due and it may take it."""
        now = time.monotonic()
        with self._lock:
            self._settle_locked(now)
            r = self.round
            if r is None:
                if not self.pending or version < self.pending[0]:
                    return None
                if self.verifier.enabled and version not in self.verifier.versions:
                    return None  # its work could not be verified
                r = self.round = Round(version, now)
                self.verifier.pin(version)
            elif version != r.version or worker in r.workers() or len(r.workers()) >= self.evaluators:
                return None
            lease = EvalLease(secrets.randbits(62), worker, version, now, now + self.timeout_s)
            r.leases[lease.lease_id] = lease
            self.issued += 1
        return LeaseGrant(
            lease.lease_id, self.requests, self.evaluator.params, min_version=version, deadline_s=self.timeout_s
        )

    def summary(self) -> dict:
        """For the status document: versions waiting, the leases out, the counts, the newest figure."""
        with self._lock:
            self._settle_locked(time.monotonic())
            leases = [] if self.round is None else list(self.round.leases.values())
            out = [{"worker": lease.worker[-8:], "version": lease.version} for lease in leases]
            return {
                "pending": list(self.pending), "leased": out[0] if out else None, "leases": out,
                "answers": 0 if self.round is None else len(self.round.answers), "issued": self.issued,
                "expired": self.expired, "revoked": self.revoked, "last": self.last,
            }  # fmt: skip

    def live(self, lease_id: int) -> tuple[str, list[GenerationRequest]] | None:
        """A live evaluation lease's worker and its requests (what a hosted environment's host serves)."""
        with self._lock:
            r = self.round
            lease = r.leases.get(lease_id) if r is not None else None
            if lease is None or time.monotonic() > lease.deadline:
                return None
            return lease.worker, list(self.requests)

    def holds(self, lease_id: object) -> bool:
        with self._lock:
            return self.round is not None and isinstance(lease_id, int) and lease_id in self.round.leases

    def forget_worker(self, worker: str) -> None:
        """A silent worker's evaluation lease is given up: another worker may take it."""
        with self._lock:
            if self.round is not None:
                self.round.leases = {i: lease for i, lease in self.round.leases.items() if lease.worker != worker}

    def submit(
        self, peer: str, msg: dict, vocab_size: int, max_tokens: int, max_turns: int = 0
    ) -> tuple[dict, dict | None]:
        """Take an evaluation lease's completions: (the answer's verdict, the figure if this answer completed
        one). Raises BadRequest or Misbehaviour like training submissions; the verifier may have flagged `peer`
        (the caller acts on it). `max_turns` > 0: an environment's episodes (p2p.messages.RolloutSubmission)."""
        with self._lock:  # closing the lease first: a replay, even a concurrent one, finds none
            r = self.round
            lease_id = msg.get("lease")  # a peer's value: a list or a map is no dict key
            lease = r.leases.get(lease_id) if r is not None and isinstance(lease_id, int) else None
            if r is None or lease is None:
                raise BadRequest("no such evaluation lease (it expired)")
            if lease.worker != peer:
                raise Misbehaviour("another worker's evaluation lease")
            del r.leases[lease.lease_id]
            r.taking.add(peer)
        try:
            answer = self._verify(peer, lease, msg, vocab_size, max_tokens, max_turns)
        finally:
            with self._lock:
                r.taking.discard(peer)
        with self._lock:
            if self.round is r and peer not in self.verifier.flagged:
                r.answers.append(answer)
                r.first_answer_at = r.first_answer_at or time.monotonic()
            figure = self._settle_locked(time.monotonic())
        return answer.verdict, figure

    def revoke(self, worker: str, why: str) -> None:
        """`worker` was flagged: its answers count no more. Each kept figure it answered is revoked, and
        recomputed from the other evaluators' answers, or evaluated again (a version >= its own) if none."""
        with self._lock:
            r = self.round
            if r is not None:
                r.answers = [a for a in r.answers if a.worker != worker]
                r.leases = {i: lease for i, lease in r.leases.items() if lease.worker != worker}
            for figure, (version, answers) in list(self.kept.items()):
                if all(a.worker != worker for a in answers):
                    continue
                del self.kept[figure]
                self.revoked += 1
                rest = [a for a in answers if a.worker != worker]
                entry = {"figure": figure, "version": version, "worker": worker[-8:], "why": why}
                if rest:
                    entry["recomputed_as"] = self._record_locked(version, rest, None, recomputes=figure)["figure"]
                else:
                    entry["evaluated_again"] = True
                    if version not in self.pending:
                        self.pending = sorted([*self.pending, version])
                    if self.last is not None and self.last["figure"] == figure:
                        self.last = None
                self.revocations.append(entry)
                log.warning(
                    "held-out figure %d (v%d) revoked: its evaluator %s was flagged; %s", figure, version,
                    worker[-8:], f"recomputed as figure {entry['recomputed_as']}" if rest else "evaluating again",
                )  # fmt: skip

    def _verify(
        self, peer: str, lease: EvalLease, msg: dict, vocab_size: int, max_tokens: int, max_turns: int
    ) -> Answer:
        """Check an answer against its lease and verify every group of it; raises on a forgery."""
        sizes = [r.group_size for r in self.requests]
        submission = RolloutSubmission.from_wire(msg, sizes, max_tokens, vocab_size, max_turns)
        version = lease.version
        if submission.version != version:
            raise BadRequest(f"the evaluation lease is for v{version}, not v{submission.version}")
        if [g.group for g in submission.groups] != [r.group for r in self.requests]:
            raise Misbehaviour("the evaluation lease's groups, in order, are required")
        doubts, checked, worst = [], 0, {"divergence": 0.0, "draw_miss": 0.0, "off_draw": 0.0, "greedy_gap": 0.0}
        for request, group in zip(self.requests, submission.groups, strict=True):
            rollouts = [
                Rollout(request.prompt_ids, c.tokens, c.logprobs, 0.0, 0.0, version, c.spans) for c in group.completions
            ]
            if request.greedy:
                gap = self.verifier.check_greedy(peer, version, rollouts)
                measured, doubt = gap is not None, self.verifier.doubt(greedy_gap=gap) if gap is not None else 0.0
                worst["greedy_gap"] = max(worst["greedy_gap"], gap or 0.0)
            else:
                replay = self.verifier.check(peer, version, self.evaluator.params.seed, request.group, rollouts)
                measured, doubt = replay is not None, self.verifier.doubt(replay)
                if replay is not None:
                    for key in ("divergence", "draw_miss", "off_draw"):
                        worst[key] = max(worst[key], getattr(replay, key))
            if peer in self.verifier.flagged:
                raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}")
            if not measured and self.verifier.enabled:  # (it is pinned: this is a bug, not the worker's fault)
                raise BadRequest(f"v{version} is no longer kept: the evaluation cannot be verified")
            checked += measured
            doubts.append(doubt)
        groups = [g.completions for g in submission.groups]
        try:  # an environment's episodes are replayed (or checked against the hosted ones): one that differs is forged
            if self.hosting is not None:
                self.hosting.check(lease.lease_id, submission)
            self.evaluator.score(groups)
        except ReplayError as exc:
            self.verifier.flag(peer, f"an evaluation episode does not replay: {exc}")
            raise Misbehaviour(f"flagged: {self.verifier.flagged[peer]}") from None
        n = len(self.evaluator.problems)
        verdict = {"worker": peer[-8:], "groups": len(groups), "checked": checked}
        verdict |= {k: round(v, 4) for k, v in worst.items()}
        return Answer(peer, groups, [max(doubts[i], doubts[n + i]) for i in range(n)], verdict)

    def _settle_locked(self, now: float) -> dict | None:
        """Expire late leases; record the round's figure once no further answer can come (module docstring).
        The figure, if this recorded one."""
        r = self.round
        if r is None:
            return None
        for lease_id, lease in list(r.leases.items()):
            if now > lease.deadline:
                del r.leases[lease_id]
                self.expired += 1
        if r.taking or (r.leases and len(r.answers) < self.evaluators):
            return None
        if r.answers and len(r.answers) < self.evaluators and now - r.first_answer_at <= self.timeout_s:
            others = {peer for peer, w in list(self.workers.items())
                      if w.version <= r.version and w.weights == "f16"} - r.workers()  # quantized: never leased
            if others:  # a second evaluator can still come: a worker that holds x, or will once it fetches it
                return None
        figure = None
        if r.answers:
            figure = self._record_locked(r.version, r.answers, now - r.opened_at)
            self.pending = [v for v in self.pending if v > r.version]
        self.round = None  # recorded, or every lease lapsed unanswered: the evaluation is pending still
        self.verifier.unpin(r.version)
        return figure

    def _record_locked(
        self, version: int, answers: list[Answer], seconds: float | None, recomputes: int | None = None
    ) -> dict:
        """Score, per prompt, the answer that replayed closest; record the figure beside every verdict."""
        n = len(self.evaluator.problems)
        pick = [min(range(len(answers)), key=lambda a: (answers[a].doubts[i], a)) for i in range(n)]
        groups = [answers[pick[i]].groups[i] for i in range(n)] + [answers[pick[i]].groups[n + i] for i in range(n)]
        self.figures += 1
        verdicts = [{**a.verdict, "prompts_taken": pick.count(k)} for k, a in enumerate(answers)]
        result = {
            "version": version,
            **self.evaluator.score(groups),
            "figure": self.figures,
            "worker": ",".join(a.worker[-8:] for a in answers),
            "verification": verdicts,
            "seconds": None if seconds is None else round(seconds, 3),
        }
        if recomputes is not None:
            result["recomputes"] = recomputes
        self.kept[self.figures] = (version, answers)
        for old in list(self.kept)[:-KEPT_FIGURES]:
            del self.kept[old]
        self.results.append(result)
        if self.last is None or version >= self.last["version"]:  # (a recomputed figure may be of an older one)
            self.last = result
        log.info(
            "held-out evaluation of v%d by %s: accuracy %.3f, pass@%d %.3f (%d prompts, %d of %d groups verified)",
            version, result["worker"], result["accuracy"], result["k"], result["pass_at_k"], result["prompts"],
            sum(v["checked"] for v in verdicts), sum(v["groups"] for v in verdicts),
        )  # fmt: skip
        return result
