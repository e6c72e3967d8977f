"""What a host allows: penalties and temporary bans of misbehaving peers, and byte-rate caps."""

from __future__ import annotations

import logging
import threading
import time

import trio

log = logging.getLogger(__name__)


class PeerGuard:
    """Penalties and temporary bans by peer id.

    A peer is banned at time t for ban_seconds when its penalties in (t - ban_window, t] weigh ban_after.
    Memory is bounded: only peers with recent penalties or a live ban are remembered.
    """

    def __init__(self, ban_after: int, ban_window: float, ban_seconds: float) -> None:
        self.ban_after, self.ban_window, self.ban_seconds = ban_after, ban_window, ban_seconds
        self._penalties: dict[str, list[tuple[float, float]]] = {}  # peer -> (when, weight)
        self._banned_until: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # reason -> penalties given, for status and tests
        self.bans = 0
        self._lock = threading.Lock()

    def penalise(self, peer: str, reason: str, weight: float = 1.0) -> None:
        """Count an offence of `weight` penalties (less than 1 for one an honest peer can commit by
        accident, a few times, such as a request to a learner that restarted and forgot it)."""
        now = time.monotonic()
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            recent = [(t, w) for t, w in self._penalties.get(peer, []) if t > now - self.ban_window] + [(now, weight)]
            self._penalties[peer] = recent
            total = sum(w for _, w in recent)
            if total >= self.ban_after - 1e-9 and not self._banned_locked(peer, now):
                self._banned_until[peer] = now + self.ban_seconds
                self.bans += 1
                log.warning("peer %s banned for %.0fs after %d offences (last: %s)", peer[-8:], self.ban_seconds,
                            len(recent), reason)  # fmt: skip
            if len(self._penalties) > 10_000:  # forget peers whose penalties are old
                for p in [p for p, ts in self._penalties.items() if ts[-1][0] <= now - self.ban_window]:
                    del self._penalties[p]

    def banned(self, peer: str) -> bool:
        with self._lock:
            return self._banned_locked(peer, time.monotonic())

    def _banned_locked(self, peer: str, now: float) -> bool:
        until = self._banned_until.get(peer)
        if until is not None and until <= now:
            del self._banned_until[peer]
            until = None
        return until is not None

    def banned_peers(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [p for p in list(self._banned_until) if self._banned_locked(p, now)]


class TokenBucket:
    """Caps a byte rate: `take(n)` waits until n bytes fit. Pieces of 16 KiB under a FIFO lock, so
    concurrent streams share the rate fairly."""

    PIECE = 16 * 1024

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.tokens = float(self.PIECE)
        self.stamp = trio.current_time()
        self.lock = trio.Lock()

    async def take(self, n: int) -> None:
        while n > 0:
            piece = min(n, self.PIECE)
            async with self.lock:
                self._refill()
                if self.tokens < piece:
                    await trio.sleep((piece - self.tokens) / self.rate)
                    self._refill()  # counts the whole sleep, oversleeping included, so no rate is lost
                self.tokens -= piece
            n -= piece

    def _refill(self) -> None:
        now = trio.current_time()
        self.tokens = min(self.tokens + (now - self.stamp) * self.rate, 4 * self.PIECE)
        self.stamp = now
