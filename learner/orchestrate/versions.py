"""The policy versions the learner has trained and published, and how fast they spread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from p2p.host import BadRequest, Misbehaviour


@dataclass
class PolicyVersions:
    """Version bookkeeping shared by the training loop (which moves it) and the handlers (which read it).

    trained: the version the learner holds (optimizer steps done); published: the newest version workers
    can fetch (-1 before the first)."""

    publish_every: int
    trained: int = 0
    published: int = -1
    published_at: dict[int, float] = field(default_factory=dict)  # version -> monotonic time it was published
    made_at: dict[int, float] = field(default_factory=dict)  # version -> when its step ended (before encoding)
    payload_bytes: dict[int, int] = field(default_factory=dict)  # version -> bytes on the wire
    bcast_seconds: dict[int, float] = field(default_factory=dict)  # version -> seconds until a worker held it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def mark_published(self, version: int, payload_bytes: int) -> None:
        with self._lock:
            self.payload_bytes[version] = payload_bytes
            self.published = version
            self.published_at[version] = time.monotonic()
            for per_version in (self.payload_bytes, self.published_at, self.made_at, self.bcast_seconds):
                for old in [v for v in per_version if v < version - 100]:  # bounded over long runs
                    del per_version[old]

    def mark_made(self, version: int) -> None:
        """The step that makes `version` ended: its broadcast time B starts (encoding is part of it)."""
        with self._lock:
            self.made_at.setdefault(version, time.monotonic())

    def newest_made(self) -> tuple[int, float] | None:
        """(version, when it was made) of the newest version a step has made, None before any."""
        with self._lock:
            return max(self.made_at.items(), default=None)

    def first_held(self, version: int) -> None:
        """A worker reports holding `version`: the first report ends its broadcast time B (from the end of
        the step that made it, as docs/capacity-model.md defines B; from publication if that is unknown)."""
        with self._lock:
            start = self.made_at.get(version, self.published_at.get(version))
            if start is not None:
                self.bcast_seconds.setdefault(version, time.monotonic() - start)

    def check_published(self, version: int) -> None:
        """A version a worker states must have been published before it is stored (status shows it).
        The next publication is refused without a penalty: its manifest can be fetched a moment before
        `published` is set. Anything beyond that no honest worker can hold."""
        newest = self.published
        if version > newest:
            kind = Misbehaviour if version > newest + self.publish_every else BadRequest
            raise kind(f"version {version} was never published (newest is {newest})")
