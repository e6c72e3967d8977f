"""Leases: which prompt groups a worker is generating, until when, and what happens when it vanishes.

The learner chooses every prompt (seeded by the run seed and the group's index), never the worker.
A lease holds some groups for one worker until its deadline; an expired lease's groups go back to the
front of the queue and are leased to someone else. A submission for a lease that is unknown, owned
by another worker, already completed or expired is refused and counted.

Budgets per identity, so that one worker taking leases and returning none cannot stall training:
- one live lease per worker: an honest worker asks for its next lease only after submitting the last, so
  asking again gives up the lease it holds (its groups go to others);
- a lease counts towards the next batch (`owed_groups`, what lease admission subtracts from its room) only
  while its worker is reliable (its last lease came back and was accepted) and the lease is not overdue
  (`due`: about twice the worker's measured lease time). Other leases are extras on top of the batch: the
  learner leases the batch's groups to others meanwhile, and a late submission is still accepted;
- the groups of expired leases go first to reliable workers; an unreliable one gets new groups, so that
  identities that never return cannot hold the same prompts back for ever.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Lease:
    lease_id: int
    worker: str
    group_ids: list[int]
    min_version: int
    issued_at: float
    deadline: float
    due: float  # after this the lease no longer counts towards the next batch (module docstring)
    counted: bool  # issued to a reliable worker: the batch counts on it until `due`
    weights: str = "f16"  # the weight format its worker declared: its groups are verified as drawn on it


@dataclass
class LeaseCounters:
    issued: int = 0
    completed: int = 0
    expired: int = 0
    reissued_groups: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # reason -> count

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


class LeaseError(ValueError):
    """A submission that does not match a live lease of this worker; `reason` is one of late, unknown,
    duplicate (a replay), not_owner (someone else's lease)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


CLOSED_KEPT = 10_000  # closed lease ids remembered (to tell a replay from an unknown lease)


class LeaseTable:
    """Hands out prompt groups by lease; group ids count up from `first_group`."""

    def __init__(self, timeout_s: float, first_group: int = 0) -> None:
        self.timeout_s = timeout_s
        self.next_group = first_group
        self.requeued: deque[int] = deque()  # groups of expired leases, issued first
        self.live: dict[int, Lease] = {}
        self.closed: dict[int, str] = {}  # lease id -> "completed" | "expired" | "refused"
        self.counters = LeaseCounters()
        self.expirations: deque[tuple[str, float]] = deque(maxlen=CLOSED_KEPT)  # (worker, seconds held), to drain
        self.reliable: dict[str, bool] = {}  # worker -> its last lease came back and was accepted
        self.abandoned = 0  # leases given up by a worker asking for another while holding one
        self._lock = threading.Lock()

    def issue(
        self, worker: str, n_groups: int, min_version: int, timeout_s: float | None = None, due_s: float | None = None,
        weights: str = "f16",
    ) -> Lease:
        """A lease of `n_groups` groups for `worker`, which gives up any lease it still holds. `due_s`: seconds
        the next batch counts on it (None: until its deadline); an unreliable worker's lease is never counted."""
        with self._lock:
            self._expire_locked()
            for held in [lease for lease in self.live.values() if lease.worker == worker]:
                self.abandoned += 1
                self.reliable[worker] = False
                self._requeue_locked(held)
            counted = self.reliable.get(worker, False)
            groups = []
            while len(groups) < n_groups:
                if self.requeued and counted:
                    groups.append(self.requeued.popleft())
                else:
                    groups.append(self.next_group)
                    self.next_group += 1
            now = time.monotonic()
            timeout_s = timeout_s or self.timeout_s
            due = now + min(timeout_s, due_s if due_s is not None else timeout_s)
            lease_id = secrets.randbits(62)
            lease = Lease(lease_id, worker, groups, min_version, now, now + timeout_s, due, counted, weights)
            self.live[lease.lease_id] = lease
            self.counters.issued += 1
            return lease

    def is_reliable(self, worker: str) -> bool:
        with self._lock:
            return self.reliable.get(worker, False)

    def get(self, lease_id: int) -> Lease | None:
        """The live lease `lease_id`, if any (for checking a submission before closing its lease)."""
        with self._lock:
            return self.live.get(lease_id)

    def complete(self, lease_id: int, worker: str) -> Lease:
        """Close a live lease of `worker`; raises LeaseError (and counts why) otherwise."""
        with self._lock:
            self._expire_locked()
            lease = self.live.get(lease_id)
            if lease is None:
                reason = {"completed": "duplicate", "refused": "duplicate", "expired": "late"}.get(
                    self.closed.get(lease_id, ""), "unknown"
                )
                self.counters.refuse(reason)
                raise LeaseError(f"lease {lease_id} is {reason}", reason)
            if lease.worker != worker:
                self.counters.refuse("not_owner")
                raise LeaseError(f"lease {lease_id} belongs to another worker", "not_owner")
            del self.live[lease_id]
            self._close_locked(lease_id, "completed")
            self.counters.completed += 1
            self.reliable[worker] = True  # unless its submission is refused: release()
            return lease

    def release(self, lease: Lease) -> None:
        """A completed lease whose submission was refused: its groups go to other workers."""
        with self._lock:
            self.reliable[lease.worker] = False
            self._close_locked(lease.lease_id, "refused")
            self.counters.completed -= 1
            self.counters.refuse("invalid")
            self.counters.reissued_groups += len(lease.group_ids)
            self.requeued.extend(lease.group_ids)

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def drain_expirations(self) -> list[tuple[str, float]]:
        """Leases that expired since the last call: (worker, seconds it held the lease)."""
        with self._lock:
            self._expire_locked()
            out = list(self.expirations)
            self.expirations.clear()
            return out

    def open_leases(self) -> dict[str, int]:
        """Live leases per worker."""
        with self._lock:
            out: dict[str, int] = {}
            for lease in self.live.values():
                out[lease.worker] = out.get(lease.worker, 0) + 1
            return out

    def requeue_worker(self, worker: str) -> int:
        """Give the live leases of a worker that vanished to others; returns how many there were."""
        with self._lock:
            gone = [lease for lease in self.live.values() if lease.worker == worker]
            for lease in gone:
                self._requeue_locked(lease)
            return len(gone)

    def outstanding_groups(self) -> int:
        """Groups in live leases, counted or not."""
        with self._lock:
            return sum(len(lease.group_ids) for lease in self.live.values())

    def owed_groups(self) -> int:
        """Groups the next batch counts on: in leases of reliable workers that are not overdue."""
        now = time.monotonic()
        with self._lock:
            return sum(len(lease.group_ids) for lease in self.live.values() if lease.counted and now <= lease.due)

    def unproven_groups(self, besides: str = "") -> int:
        """Groups in live leases of workers that were not reliable when they got them (but `besides`'s)."""
        with self._lock:
            return sum(len(x.group_ids) for x in self.live.values() if not x.counted and x.worker != besides)

    def summary(self) -> dict[str, int]:
        """For the status document: groups owed to the next batch, groups in unproven leases, leases given up."""
        owed, unproven = self.owed_groups(), self.unproven_groups()
        return {"owed_groups": owed, "unproven_groups": unproven, "abandoned": self.abandoned}

    def forget_worker(self, worker: str) -> None:
        """A worker dropped (silent) or flagged: nothing of it is remembered."""
        with self._lock:
            self.reliable.pop(worker, None)

    def _close_locked(self, lease_id: int, how: str) -> None:
        self.closed[lease_id] = how
        if len(self.closed) > CLOSED_KEPT:  # dicts keep insertion order: forget the oldest tenth
            for old in list(self.closed)[: CLOSED_KEPT // 10]:
                del self.closed[old]

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for lease in [lease for lease in self.live.values() if lease.deadline < now]:
            self.expirations.append((lease.worker, now - lease.issued_at))
            self.reliable[lease.worker] = False
            self._requeue_locked(lease)

    def _requeue_locked(self, lease: Lease) -> None:
        del self.live[lease.lease_id]
        self._close_locked(lease.lease_id, "expired")
        self.counters.expired += 1
        self.counters.reissued_groups += len(lease.group_ids)
        self.requeued.extend(lease.group_ids)
