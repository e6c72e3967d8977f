"""Configuration of `echo-rl worker join` (kept apart from the daemon so the CLI starts without libp2p)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from p2p.config import require


@dataclass
class WorkerConfig:
    """A rollout worker."""

    learner: str = ""
    """The learner's full multiaddr (printed by `learner start`, also in RUN_DIR/learner.addr)."""
    engine: Literal["llamacpp", "transformers"] = "llamacpp"
    """Inference engine: llamacpp or transformers."""
    threads: int = 2
    """CPU threads for generation."""
    max_batch: int = 32
    """Sequences decoded together."""
    max_groups: int = 4
    """Most prompt groups to ask for in one lease."""
    price: float = 0.0
    """What this machine costs, USD per hour (the learner's scheduler prefers cheap workers)."""
    identity: str = "~/.config/echo-rl/worker.key"
    """ed25519 identity file (created if missing)."""
    work_dir: str = "~/.cache/echo-rl/worker"
    """Where converted weights and spilled chunks go."""
    listen: str = "/ip4/127.0.0.1/tcp/0"
    """Multiaddr to listen on for other workers (peer-assisted broadcast)."""
    secret_file: str = ""
    """File holding the swarm secret, if the learner requires one."""

    def validate(self) -> None:
        require(self.learner.startswith("/") and "/p2p/" in self.learner, "worker.learner",
                "must be the learner's full multiaddr, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...")  # fmt: skip
        require(self.threads >= 1, "worker.threads", "must be >= 1")
        require(self.max_batch >= 1, "worker.max_batch", "must be >= 1")
        require(self.max_groups >= 1, "worker.max_groups", "must be >= 1")
        require(self.price >= 0, "worker.price", "must be >= 0")
        require(self.listen.startswith("/"), "worker.listen", "must be a multiaddr")


@dataclass
class WorkerRootConfig:
    """`echo-rl worker join` configuration: one [worker] table."""

    worker: WorkerConfig

    def validate(self) -> None:
        self.worker.validate()
