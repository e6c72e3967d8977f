"""The learner's side of a hosted environment (`--env-host learner`, docs/environments.md): it steps the
environment of every episode its workers play, one round trip per turn, so the environment need not be
deterministic (a tool with a clock, a sandbox with timeouts, a service) and is never replayed.

    ENV_STEP          -> step(worker, msg): for a live lease of that worker (`live_lease`: its groups'
                         requests), each turn of the request stepped on the episode's own environment
                         (envs.episode.HostedEpisode: created at its first turn, reset with the group's seed)
    ROLLOUT           -> check(lease, submission): every episode the worker claims must be, token for token,
                         the one the learner hosted, with its return; then the lease's environments are closed

A worker can make the learner step only the episodes of a lease it holds, each turn once and in order,
within the run's budgets (a turn sent again gets the same answer); at most MAX_LEASES leases are hosted at
once (the oldest are closed first: a lease that expired unanswered stays until then). Steps run under the
lease's own lock: one worker's slow tool does not hold up another's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from envs.episode import EpisodeRules, HostedEpisode, ReplayError
from p2p.host import BadRequest
from p2p.messages import EnvStepReply, EnvStepRequest, GenerationRequest, RolloutSubmission

MAX_LEASES = 256  # leases whose episodes are hosted at once
LiveLease = Callable[[int], tuple[str, list[GenerationRequest]] | None]  # a live lease's worker and requests


@dataclass
class _HostedLease:
    worker: str
    requests: dict[int, GenerationRequest]  # by group
    episodes: dict[tuple[int, int], HostedEpisode] = field(default_factory=dict)  # (group, completion) ->
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        for episode in self.episodes.values():
            episode.close()


class EpisodeHost:
    """The episodes of a hosted environment that the learner's live leases hold (module docstring)."""

    def __init__(self, rules: EpisodeRules, vocab_size: int, live_lease: LiveLease) -> None:
        self.rules, self.vocab_size, self.live_lease = rules, vocab_size, live_lease
        self._leases: OrderedDict[int, _HostedLease] = OrderedDict()
        self._lock = threading.Lock()

    def step(self, worker: str, msg: dict) -> dict:
        """Answer one ENV_STEP request (p2p.messages.EnvStepRequest) of `worker`."""
        request = EnvStepRequest.from_wire(msg, self.rules.spec.turn_tokens)
        evicted = []
        with self._lock:
            lease = self._leases.get(request.lease)
            if lease is None and (live := self.live_lease(request.lease)) is not None:
                lease = self._leases[request.lease] = _HostedLease(live[0], {r.group: r for r in live[1]})
                while len(self._leases) > MAX_LEASES:
                    evicted.append(self._leases.popitem(last=False)[1])
        for old in evicted:  # under its own lock: a step on it may be under way
            with old.lock:
                old.close()
        if lease is None or lease.worker != worker:
            raise BadRequest(f"lease {request.lease} is not a live lease of yours")
        steps = []
        with lease.lock:
            for turn in request.turns:
                group = lease.requests.get(turn.group)
                if group is None or not group.completion <= turn.completion < group.completion + group.group_size:
                    raise BadRequest(f"episode {turn.completion} of group {turn.group} is not in lease {request.lease}")
                if turn.tokens and max(turn.tokens) >= self.vocab_size:
                    raise BadRequest(f"a turn's token ids must be below the vocabulary's {self.vocab_size}")
                key = (turn.group, turn.completion)
                if key not in lease.episodes:
                    lease.episodes[key] = HostedEpisode(self.rules, group, turn.completion)
                try:
                    steps.append(lease.episodes[key].turn(turn.turn, turn.tokens))
                except ReplayError as exc:
                    raise BadRequest(str(exc)) from None
        return EnvStepReply(steps).to_wire()

    def check(self, lease_id: int, submission: RolloutSubmission) -> None:
        """Raise ReplayError unless every episode of the submission is the one the learner hosted; the lease's
        environments are closed either way."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise ReplayError(f"lease {lease_id}'s episodes were not hosted here (or no longer are)")
        try:
            with lease.lock:
                for group in submission.groups:
                    if group.group not in lease.requests:
                        raise ReplayError(f"group {group.group} is not in lease {lease_id}")
                    first = lease.requests[group.group].completion
                    for j, completion in enumerate(group.completions):
                        episode = lease.episodes.get((group.group, first + j))
                        if episode is None:
                            raise ReplayError(f"episode {first + j} of group {group.group} was never played here")
                        episode.check(completion)
        finally:
            lease.close()

    def close(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), OrderedDict()
        for lease in leases:
            lease.close()

