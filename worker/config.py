"""Configuration of `echo-rl worker join` (kept apart from the daemon so the CLI starts without libp2p)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from p2p.config import check_uplink, paced_bps, require
from p2p.messages import WEIGHT_FORMATS

DEFAULT_IDENTITY = "~/.config/echo-rl/worker.key"
DEFAULT_WORK_DIR = "~/.cache/echo-rl/worker"


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
    quant: str = "f16"
    """llama.cpp: weight format, f16, q8_0, q4_0 or q4_k_m (made here from each 16-bit version; README), or
    auto: the largest that fits this worker's memory and that the learner can verify."""
    memory_gib: float = 0.0
    """For an auto weight format: the memory a worker may use, GiB (0: the GPU's when offloading, else free RAM)."""
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
    name: str = ""
    """This worker's name on this machine: its own identity and work dir (worker-NAME.key, worker-NAME)."""
    gpu: int = -1
    """GPU index to run on (-1: as the environment says); also names the worker gpuN."""
    identity: str = DEFAULT_IDENTITY
    """ed25519 identity file (created if missing); one worker process at a time may hold it."""
    work_dir: str = DEFAULT_WORK_DIR
    """Where converted weights and spilled chunks go."""
    listen: str = "/ip4/0.0.0.0/tcp/0"
    """Multiaddr to listen on for other workers (0.0.0.0: every interface, each announced)."""
    announce: str = ""
    """Address to announce instead (a port forwarded on your router), e.g. /ip4/1.2.3.4/tcp/99."""
    hole_punch: bool = True
    """Behind a NAT, reach other workers behind NATs by hole punching (through the learner's relay)."""
    uplink_mbit: float = 0.0
    """Your upload speed, Mbit/s (a speed test's figure): what the worker sends is paced at 90% of it
    rather than sent in bursts your router queues, which makes the whole swarm's broadcast faster (0: unpaced)."""
    secret_file: str = ""
    """File holding the swarm secret, if the learner requires one."""
    allow_env: str = ""
    """Plugin environments (module:Class, comma-separated) this worker may import for a run; built-in ones need none."""

    def upload_bps(self) -> float | None:
        """Bytes/s this worker's host paces everything it sends at, or None (unpaced)."""
        return paced_bps(self.uplink_mbit)

    def validate(self) -> None:
        require(self.learner.startswith("/") and "/p2p/" in self.learner, "worker.learner",
                "must be the learner's full multiaddr, e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...")  # fmt: skip
        require(self.threads >= 1, "worker.threads", "must be >= 1")
        require(self.max_batch >= 1, "worker.max_batch", "must be >= 1")
        require(self.max_groups >= 1, "worker.max_groups", "must be >= 1")
        require(self.quant in (*WEIGHT_FORMATS, "auto"), "worker.quant",
                f"must be auto or one of {', '.join(WEIGHT_FORMATS)}, got {self.quant!r}")  # fmt: skip
        require(0 <= self.memory_gib <= 1 << 20, "worker.memory_gib",
                f"must be in [0, 1048576] GiB, got {self.memory_gib}")  # fmt: skip
        require(self.memory_gib == 0 or self.quant == "auto", "worker.memory_gib", "only --quant auto reads it: add "
                "--quant auto, or leave --memory-gib out")  # fmt: skip
        require(self.quant == "f16" or self.engine == "llamacpp", "worker.quant",
                f"{self.quant} needs --engine llamacpp: the transformers engine runs 16-bit weights")  # fmt: skip
        require(self.gpu_layers >= -1, "worker.gpu_layers", f"must be >= -1 (-1: all), got {self.gpu_layers}")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "worker.device",
                f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")  # fmt: skip
        require(0.05 <= self.poll_s <= 60, "worker.poll_s", f"must be within [0.05, 60] seconds, got {self.poll_s}")
        require(self.price >= 0, "worker.price", "must be >= 0")
        check_uplink(self.uplink_mbit, "worker.uplink_mbit")
        require(self.listen.startswith("/"), "worker.listen", "must be a multiaddr")
        announce_ok = re.fullmatch(r"/(ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/[1-9]\d*(/p2p/\w+)?", self.announce)
        require(not self.announce or announce_ok is not None, "worker.announce",
                f"must be /ip4/HOST/tcp/PORT, got {self.announce!r}")  # fmt: skip
        require(self.gpu >= -1, "worker.gpu", f"must be a GPU index (0, 1, ...) or -1, got {self.gpu}")
        require(re.fullmatch(r"[A-Za-z0-9_.-]{0,32}", self.name) is not None, "worker.name",
                f"must be up to 32 letters, digits, '_', '.' or '-', got {self.name!r}")  # fmt: skip
        # defaults that follow from the name: workers on one machine each get their own identity and store
        if self.gpu >= 0 and not self.name:
            self.name = f"gpu{self.gpu}"
        if self.name and self.identity == DEFAULT_IDENTITY:
            self.identity = f"~/.config/echo-rl/worker-{self.name}.key"
        if self.name and self.work_dir == DEFAULT_WORK_DIR:
            self.work_dir = f"~/.cache/echo-rl/worker-{self.name}"


@dataclass
class WorkerRootConfig:
    """`echo-rl worker join` configuration: one [worker] table."""

    worker: WorkerConfig

    def validate(self) -> None:
        self.worker.validate()
