"""The [swarm] table of a training run's configuration (learner.config): the learner's libp2p host, policy
versions, leases, staleness, verification and the weight formats it takes from workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from p2p.config import check_uplink, require
from p2p.messages import WEIGHT_FORMATS

# Quantized formats a learner takes without a sampler correction (GRPOConfig.corrects_sampler) only where
# swarm.quant_formats names them: in the demo's swarm runs, 4-bit workers under the behaviour objective clipped a
# quarter of their tokens and learned little in 20 steps, where objectives correcting for the sampler learned
# (docs/benchmarks.md, "Quantized workers in a swarm").
FOUR_BIT = ("q4_k_m", "q4_0")


@dataclass
class SwarmConfig:
    """The distributed learner: its libp2p host, policy versions, leases and staleness."""

    listen: str = "/ip4/127.0.0.1/tcp/0"
    """Multiaddr to listen on; /ip4/0.0.0.0/tcp/4001 accepts workers from other machines (port 0: any free port)."""
    sync_mode: Literal["async", "pull"] = "async"
    """async: train on any buffered batch within staleness; pull: workers hold the newest version for every lease."""
    staleness: int = 2
    """S: a rollout from policy version x is trained on at version v only if v - x <= S (async mode)."""
    publish_every: int = 1
    """kappa: publish a policy version every this many optimizer steps (must be <= S + 1; pull mode uses 1)."""
    full_every: int = 10
    """Every this many publications also gets a full snapshot beside its delta, for workers that join or restart."""
    wire_dtype: Literal["bf16", "f16"] = "f16"
    """16-bit format of published weights: f16 (exactly what the workers' F16 GGUF holds) or bf16 (smaller deltas)."""
    wire_topk: float = 1.0
    """Share of each weight matrix's coordinates a delta version changes: the largest changes; the rest is
    carried to later versions (error feedback). 1: every change."""
    chunk_kib: int = 0
    """KiB per chunk of a published version (0: by its size, 256 KiB to 4 MiB; smaller ones relay sooner between
    peers on slow links, each costing a request; larger where a version would have over 4096)."""
    chunk_memory_mb: int = 256
    """Published chunks kept in memory, MB; older ones are served from RUN_DIR/chunks on disk."""
    lease_timeout: float = 120.0
    """Seconds a worker has to return a lease before its prompts are leased to another worker."""
    groups_per_lease: int = 1
    """Prompt groups handed out in one lease."""
    autoscale: bool = True
    """async: activate only the workers the capacity model needs, cheapest first (docs/capacity-model.md)."""
    margin: float = 0.1
    """Autoscale: keep the active workers' fresh supply this fraction above the learner's demand."""
    worker_silence: float = 30.0
    """Seconds without a heartbeat after which a worker is dropped and its leases go to others."""
    min_workers: int = 1
    """Leases wait until this many workers hold a policy version, so that a run starts with its swarm rather
    than with whichever worker joined first (checked once per start; workers that leave later do not stop it)."""
    prefetch_batches: int = 1
    """async: batches of prompt groups leased or buffered ahead of training (1: the next is made during this step)."""
    verify_first: int = 8
    """A worker's groups are all verified until this many were; then first / (groups accepted) of them."""
    verify_fraction: float = 0.05
    """The least share of an established worker's groups verified (0 with verify_first = 0: no checks)."""
    verify_tolerance: float = 0.02
    """Mean |logprob difference| per token (nats) above which a worker is flagged and its rollouts dropped."""
    verify_draw_tolerance: float = 0.02
    """How far a token's draw may miss its inverse-CDF interval (probability mass) before the worker is flagged."""
    verify_off_draw: float = 0.05
    """Share of a group's tokens that may lie beside their draw's token (float noise) before the worker is flagged."""
    quant_formats: str = "auto"
    """Weight formats workers may run besides f16 (`worker join --quant`), comma-separated; auto: q8_0, and
    q4_k_m, q4_0 where the objective corrects for the sampler (not behaviour; a correction); "": 16-bit only."""
    check_llamacpp: bool = True
    """Before serving a family llama.cpp runs through its converter, sample a few tokens with llama.cpp here and
    refuse llama.cpp workers if it departs from the learner (holds an F16 copy of the model once)."""
    read_timeout: float = 30.0
    """Seconds a peer has to deliver a whole request (a slow peer cannot hold the learner's streams open)."""
    uplink_mbit: float = 0.0
    """The learner's upload speed, Mbit/s: what it sends is paced at that rate (broadcasts end sooner; 0: unpaced)."""
    upload_bps: float = 0.0
    """A hard cap on the learner's upload in bytes/s, e.g. to emulate a home uplink (0 = no cap)."""
    relay: bool = True
    """Relay the hole punches of workers behind NATs (handshakes only: their chunks never cross the learner)."""
    secret_file: str = ""
    """File holding the swarm secret: only workers proving it (HMAC challenge) get work ("": no secret)."""
    allow: str = ""
    """File of worker peer ids allowed to work, one per line ("": any peer that passes the secret check)."""

    def weight_formats(self, corrected: bool = False) -> tuple[str, ...]:
        """The weight formats the learner takes: f16 and those in quant_formats, once each; auto: q8_0, and the
        FOUR_BIT formats where the objective is `corrected` for the sampler (GRPOConfig.corrects_sampler)."""
        text = self.quant_formats
        if text.strip() == "auto":
            text = ",".join(["q8_0", *(FOUR_BIT if corrected else ())])
        names = dict.fromkeys(["f16", *(name.strip() for name in text.split(","))])
        return tuple(name for name in names if name)

    def validate(self) -> None:
        require(
            self.listen.startswith("/"),
            "swarm.listen",
            f"must be a multiaddr like /ip4/0.0.0.0/tcp/4001, got {self.listen!r}",
        )
        require(self.staleness >= 0, "swarm.staleness", f"must be >= 0, got {self.staleness}")
        require(self.publish_every >= 1, "swarm.publish_every", "must be >= 1")
        require(self.full_every >= 1, "swarm.full_every", "must be >= 1")
        require(0 < self.wire_topk <= 1, "swarm.wire_topk", f"must be in (0, 1], got {self.wire_topk}")
        require(self.chunk_kib == 0 or 4 <= self.chunk_kib <= 4096, "swarm.chunk_kib",
                f"must be 0 (by size) or 4 to 4096, got {self.chunk_kib}")  # fmt: skip
        require(self.chunk_memory_mb >= 0, "swarm.chunk_memory_mb", f"must be >= 0, got {self.chunk_memory_mb}")
        require(self.lease_timeout > 0, "swarm.lease_timeout", "must be > 0")
        require(self.groups_per_lease >= 1, "swarm.groups_per_lease", "must be >= 1")
        require(self.prefetch_batches >= 1, "swarm.prefetch_batches", "must be >= 1")
        require(self.margin >= 0, "swarm.margin", f"must be >= 0, got {self.margin}")
        require(self.worker_silence > 0, "swarm.worker_silence", "must be > 0")
        require(self.min_workers >= 1, "swarm.min_workers", f"must be >= 1, got {self.min_workers}")
        require(self.read_timeout > 0, "swarm.read_timeout", f"must be > 0, got {self.read_timeout}")
        require(self.upload_bps >= 0, "swarm.upload_bps", f"must be >= 0 (0: no cap), got {self.upload_bps}")
        check_uplink(self.uplink_mbit, "swarm.uplink_mbit")
        require(self.verify_first >= 0, "swarm.verify_first", f"must be >= 0, got {self.verify_first}")
        bad = [repr(f) for f in self.weight_formats(corrected=True) if f not in WEIGHT_FORMATS]
        require(not bad, "swarm.quant_formats", f"{', '.join(bad)}: choose auto (the default), \"\" (16-bit only) "
                f"or formats from {', '.join(WEIGHT_FORMATS[1:])}")  # fmt: skip
        require(
            0 <= self.verify_fraction <= 1, "swarm.verify_fraction", f"must be in [0, 1], got {self.verify_fraction}"
        )
        require(self.verify_tolerance > 0, "swarm.verify_tolerance", f"must be > 0, got {self.verify_tolerance}")
        require(
            0 < self.verify_draw_tolerance < 1,
            "swarm.verify_draw_tolerance",
            f"must be in (0, 1), got {self.verify_draw_tolerance}",
        )
        require(
            0 < self.verify_off_draw <= 1, "swarm.verify_off_draw", f"must be in (0, 1], got {self.verify_off_draw}"
        )
        if self.sync_mode == "pull":
            require(
                self.publish_every == 1, "swarm.publish_every", "must be 1 in pull mode (workers need every version)"
            )
        else:
            require(
                self.publish_every <= self.staleness + 1,
                "swarm.publish_every",
                f"must be <= staleness + 1 ({self.staleness + 1}), or no rollout could ever be fresh enough",
            )
