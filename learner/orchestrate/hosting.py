"""The learner's side of a hosted environment (`--env-host learner`, docs/environments.md): it steps the
environment of every episode its workers play, one round trip per round of turns, so the environment need
not be deterministic (a tool with a clock, a sandbox with timeouts, a service) and is never replayed.

    ENV_STEP          -> step(worker, msg): for the worker's live lease (`live_lease`: its owner and its
                         groups' requests), each turn of the request stepped on the episode's own environment
                         (envs.episode.HostedEpisode: created at its first turn, reset with the group's seed)
    ROLLOUT           -> check(lease, submission): every episode the worker claims must be, token for token,
                         the one the learner hosted, with its return; then the lease's environments are closed

A worker steps only its own live lease's episodes (another's lease is misbehaviour), each turn once and in
order (a turn sent again gets the same answer), at most one turn per episode per request, within the run's
budgets; a step of a lease that is already stepping is refused, not queued. A worker holds one live lease,
so opening a new one closes its previous lease's environments, as does a lease that is no longer live when
stepped; at most MAX_LEASES leases are hosted at once. A submission for episodes the learner no longer
hosts is refused without a flag (BadRequest): only an episode that differs from the hosted one is a forgery.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from envs.episode import EpisodeRules, HostedEpisode, ReplayError
from learner.config import LearnerConfig
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import EnvStepReply, EnvStepRequest, GenerationRequest, RolloutSubmission
from p2p.wire import FrameLimits

MAX_LEASES = 1024  # leases whose episodes are hosted at once (one per worker)
STEP_CONCURRENCY = 8  # ENV_STEP requests answered at once: the other protocols keep their threads
LiveLease = Callable[[int], tuple[str, list[GenerationRequest]] | None]  # a live lease's worker and requests


def env_step_limits(cfg: LearnerConfig) -> FrameLimits:
    """What one ENV_STEP request may hold: a turn of every episode of a lease (an evaluation's too), at most 9
    bytes of msgpack a token plus framing; twice that, as slack."""
    episodes = cfg.swarm.groups_per_lease * cfg.grpo.group_size
    if cfg.eval.eval_every:  # an evaluation lease: a greedy episode and k sampled ones per held-out seed
        episodes = max(episodes, cfg.eval.eval_prompts * (1 + cfg.eval.eval_samples))
    size = episodes * (9 * cfg.sampler.max_new_tokens + 32) + 1024
    return FrameLimits(max_bytes=2 * size, max_array=max(cfg.sampler.max_new_tokens, episodes, 16), max_map=8,
                       max_str=64, max_bin=0)  # fmt: skip


@dataclass
class _HostedLease:
    worker: str
    requests: list[GenerationRequest]  # in the lease's order (an evaluation lease has two requests per group)
    episodes: dict[tuple[int, int], HostedEpisode] = field(default_factory=dict)  # (group, completion) ->
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def close(self) -> None:
        """Close its environments (under its lock: a step on it may be under way)."""
        with self.lock:
            self.closed = True
            for episode in self.episodes.values():
                episode.close()  # envs.close_env: a close() that raises is logged, the rest still closed
            self.episodes.clear()


class EpisodeHost:
    """The episodes of a hosted environment that the learner's live leases hold (module docstring)."""

    def __init__(self, rules: EpisodeRules, vocab_size: int, live_lease: LiveLease) -> None:
        self.rules, self.vocab_size, self.live_lease = rules, vocab_size, live_lease
        self._leases: OrderedDict[int, _HostedLease] = OrderedDict()
        self._lock = threading.Lock()

    def step(self, worker: str, msg: dict) -> dict:
        """Answer one ENV_STEP request (p2p.messages.EnvStepRequest) of `worker`."""
        request = EnvStepRequest.from_wire(msg, self.rules.spec.turn_tokens)
        lease = self._lease(worker, request.lease)
        if not lease.lock.acquire(blocking=False):
            raise BadRequest(f"a step of lease {request.lease} is under way: send the next after its answer")
        try:
            if lease.closed:
                raise BadRequest(f"lease {request.lease} is over")
            seen: set[tuple[int, int]] = set()
            holders = []
            for turn in request.turns:  # the whole request is checked before any episode steps
                holder = next((r for r in lease.requests if r.group == turn.group
                               and r.completion <= turn.completion < r.completion + r.group_size), None)  # fmt: skip
                if holder is None:
                    raise BadRequest(f"episode {turn.completion} of group {turn.group} is not in lease {request.lease}")
                holders.append(holder)
                if (turn.group, turn.completion) in seen:
                    raise BadRequest(f"episode {turn.completion} of group {turn.group} has two turns in one request")
                seen.add((turn.group, turn.completion))
                if turn.tokens and max(turn.tokens) >= self.vocab_size:
                    raise BadRequest(f"a turn's token ids must be below the vocabulary's {self.vocab_size}")
            steps = []
            for turn, holder in zip(request.turns, holders, strict=True):
                key = (turn.group, turn.completion)
                if key not in lease.episodes:
                    lease.episodes[key] = HostedEpisode(self.rules, holder, turn.completion)
                try:
                    steps.append(lease.episodes[key].turn(turn.turn, turn.tokens))
                except ReplayError as exc:
                    raise BadRequest(str(exc)) from None
        finally:
            lease.lock.release()
        return EnvStepReply(steps).to_wire()

    def _lease(self, worker: str, lease_id: int) -> _HostedLease:
        """The worker's hosted lease `lease_id`, opened at its first step; the worker's other hosted leases
        (and this one, once it is no longer live) are closed."""
        live = self.live_lease(lease_id)
        if live is not None and live[0] != worker:
            raise Misbehaviour(f"lease {lease_id} is another worker's")
        stale: list[_HostedLease] = []
        with self._lock:
            if live is None:
                lease = self._leases.pop(lease_id, None)
                stale += [lease] if lease is not None else []
            else:
                lease = self._leases.get(lease_id)
                if lease is None:
                    stale += [self._leases.pop(k) for k, v in list(self._leases.items()) if v.worker == worker]
                    lease = self._leases[lease_id] = _HostedLease(worker, list(live[1]))
                    while len(self._leases) > MAX_LEASES:
                        stale.append(self._leases.popitem(last=False)[1])
        for old in stale:
            old.close()
        if live is None:
            raise BadRequest(f"lease {lease_id} is not a live lease of yours")
        return lease

    def check(self, lease_id: int, submission: RolloutSubmission) -> None:
        """Raise ReplayError unless every episode of the submission is the one the learner hosted (BadRequest
        when the learner no longer hosts them: they cannot be checked, and nothing says they are forged); the
        lease's environments are closed either way."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise BadRequest(f"lease {lease_id}'s episodes are not hosted here (any more): they cannot be checked")
        try:
            with lease.lock:
                if [g.group for g in submission.groups] != [r.group for r in lease.requests]:
                    raise ReplayError(f"the submission's groups are not lease {lease_id}'s, in its order")
                for request, group in zip(lease.requests, submission.groups, strict=True):
                    first = request.completion
                    for j, completion in enumerate(group.completions):
                        episode = lease.episodes.get((group.group, first + j))
                        if episode is None:
                            raise BadRequest(f"episode {first + j} of group {group.group} was not played here")
                        episode.check(completion)
        finally:
            lease.close()

    def close(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), OrderedDict()
        for lease in leases:
            lease.close()
