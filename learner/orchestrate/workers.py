"""What the learner knows about each worker, and the one row per worker that status and metrics show."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerRecord:
    """One worker as the learner sees it: what it declared (checked) and what it delivered."""

    peer_id: str
    price: float = 0.0
    version: int = -1  # newest version it reported holding
    tokens_per_s: float = 0.0  # its own measurement, from heartbeats
    last_seen: float = field(default_factory=time.monotonic)
    groups_accepted: int = 0
    refused: int = 0
    hardware: str = ""  # what it declared it runs on (p2p.messages.describe_hardware)
    punched: int = 0  # peers behind NATs it says it reached by hole punching (heartbeats)
    weights: str = "f16"  # the weight format it declared (p2p.messages.WEIGHT_FORMATS): what its leases are bound to

    def row(self, learner_version: int, now: float, active: bool) -> dict[str, Any]:
        """The fields both the status document (docs/status.md) and each step's metrics show."""
        return {
            "active": active,
            "price": self.price,
            "version": self.version,
            "version_lag": learner_version - self.version if self.version >= 0 else None,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "groups_accepted": self.groups_accepted,
            "refused": self.refused,
            "last_seen_s": round(now - self.last_seen, 1),
            "punched": self.punched,
            "weights": self.weights,
        }
