"""Configuration of `echo-rl worker join` (kept apart from the daemon so the CLI starts without libp2p)."""

from __future__ import annotations

import re
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
    gpu_layers: int = -1
    """llama.cpp: layers offloaded to the GPU (-1: all when llama.cpp was built with a GPU backend, else 0)."""
    device: str = "auto"
    """transformers engine: auto (cuda when torch sees a GPU), cpu, cuda or cuda:N."""
    max_groups: int = 4
    """Most prompt groups to ask for in one lease."""
    overlap: bool = True
    """Fetch the next policy version while generating (false: stop generating until it is loaded)."""
    poll_s: float = 1.0
    """Seconds between heartbeats, each of which asks the learner for its newest version."""
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
    allow_env: str = ""
    """Plugin environments (module:Class, comma-separated) this worker may import for a run; built-in ones need none."""

    def validate(self) -> None:
        require(self.learner.startswith("/") and "/p2p/" in self.learner, "worker.learner",
                "must be the learner's full multiaddr, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...")  # fmt: skip
        require(self.threads >= 1, "worker.threads", "must be >= 1")
        require(self.max_batch >= 1, "worker.max_batch", "must be >= 1")
        require(self.max_groups >= 1, "worker.max_groups", "must be >= 1")
        require(self.gpu_layers >= -1, "worker.gpu_layers", f"must be >= -1 (-1: all), got {self.gpu_layers}")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "worker.device",
                f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")  # fmt: skip
        require(0.05 <= self.poll_s <= 60, "worker.poll_s", f"must be within [0.05, 60] seconds, got {self.poll_s}")
        require(self.price >= 0, "worker.price", "must be >= 0")
        require(self.listen.startswith("/"), "worker.listen", "must be a multiaddr")


@dataclass
class WorkerRootConfig:
    """`echo-rl worker join` configuration: one [worker] table."""

    worker: WorkerConfig

    def validate(self) -> None:
        self.worker.validate()
