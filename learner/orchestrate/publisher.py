"""Publishing policy versions: trained weights -> bf16 or f16 -> signed full snapshot or XOR delta -> swarm."""

from __future__ import annotations

import logging

import numpy as np
import torch

from learner.train.wire_weights import wire_dtypes, wire_tensors
from p2p.broadcast import Seeder
from p2p.host import Host
from p2p.manifest import Manifest
from p2p.versions import PolicyVersion, build_from_raw, build_version
from p2p.weights import to_float32

log = logging.getLogger(__name__)


EXACT_TOPK_UP_TO = 1 << 20  # coordinates: an exact k-th largest below this, a sampled quantile above


def top_share(values: np.ndarray, share: float, seed: int = 0) -> np.ndarray:
    """A mask of the largest `share` of `values` (1-D, >= 0), zeros never taken. Exact for small arrays;
    for large ones the cut is the quantile of a 2^20 random sample (O(n), not a sort of every weight
    matrix on the learner's CPU), so about `share` is kept. Ties at the cut (16-bit changes come in whole
    steps of the format, so many are equal) are broken at random, never all taken."""
    k = max(1, int(share * values.size))
    if k >= values.size:
        return values > 0
    rng = np.random.default_rng(seed)
    if values.size > EXACT_TOPK_UP_TO:
        cut = float(np.quantile(values[rng.integers(0, values.size, EXACT_TOPK_UP_TO)], 1 - share))
    else:
        cut = float(np.partition(values, values.size - k)[values.size - k])
    take = values > cut
    if cut > 0 and take.sum() < k:  # fill up to k with coordinates at the cut, chosen at random
        ties = np.flatnonzero(values == cut)
        take[rng.choice(ties, min(k - int(take.sum()), ties.size), replace=False)] = True
    return take


class Publisher:
    """Turns the learner's weights into signed policy versions held by the Seeder.

    Workers hold 16-bit weights: f16 (the default: the precision of the sampler's F16 GGUF, so workers
    sample from the very weights a co-located sampler would) or bf16 (deltas about 40% smaller).
    The first publication is a full snapshot; every later one is a delta against the previous
    publication, so a worker that follows the chain downloads only deltas. Every `full_every`-th
    publication also gets a full snapshot beside its delta (Seeder.snapshots), for late joiners and
    restarted workers; a following worker derives that snapshot from the weights it rebuilt rather than
    download it (BroadcastPeer.sync). Once a snapshot is out, the chain and snapshots older than the
    snapshot before it are dropped: a worker still fetching from there can finish.
    Workers learn of a new version from the learner's heartbeat and lease replies (`newest`).

    Sparse deltas (`topk` < 1, error feedback): a delta version changes only the `topk` share of each
    weight matrix's coordinates where the workers' weights W_pub are furthest from the learner's W
    (rounded to the wire format): W_pub[i] = round16(W[i]) for the largest |round16(W[i]) - W_pub[i]|,
    unchanged elsewhere. The rest is not lost: it stays in W - W_pub and is sent once it is among the
    largest. Workers sample from W_pub exactly (its hash is signed, the verifier replays it), and the
    objective's ratio pi_W / mu_W_pub corrects for the lag like any other staleness. A full snapshot
    sends round16(W) whole and W_pub catches up.

    LoRA runs (`lora`): the first publication is a full snapshot (frozen base and adapters); every later
    one carries only the adapters and names that snapshot as its base (adapter_base). The store keeps
    the base and the newest adapter versions.
    """

    def __init__(
        self,
        seeder: Seeder,
        run_id: str,
        full_every: int,
        chunk_size: int | None = None,
        dtype: str = "f16",
        lora: bool = False,
        topk: float = 1.0,
        adapter_keep: int = 2,
    ) -> None:
        self.seeder = seeder
        self.lora = lora
        self.adapter_keep = adapter_keep  # LoRA versions whose chunks are kept (a worker mid-fetch may want one)
        self.base: int | None = None  # LoRA runs: the version holding the full weights
        self.dtype = dtype  # "bf16" or "f16": the 16-bit format workers get
        self.run_id = run_id
        self.full_every = full_every
        self.chunk_size = chunk_size
        self.published = 0
        self.previous: tuple[int, bytes] | None = None  # (version, raw bf16 bytes) of the last publication
        self.last_full: int | None = None  # the newest full snapshot
        self.beside: PolicyVersion | None = None  # the full snapshot encode() made beside its delta, if any
        self.topk = topk  # share of each matrix's coordinates a delta version changes (1: all)
        self.sent: dict[str, np.ndarray] = {}  # W_pub: the 16-bit weights the workers hold (topk < 1)

    def held_gib(self) -> float:
        """Memory held: the raw 16-bit bytes of the last publication (the next delta's base), GiB."""
        return len(self.previous[1]) / 2**30 if self.previous else 0.0

    def snapshot(self, model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, np.ndarray]:
        """The model's weights in the wire format (see wire_tensors); LoRA runs: adapters only after the base."""
        return wire_tensors(model, self.dtype, self.lora and self.base is not None, state)

    def next_is_full(self) -> bool:
        """Whether the next publication is a full snapshot (the first, and every full_every-th)."""
        adapter = self.lora and self.base is not None
        return not adapter and (self.previous is None or self.published % self.full_every == 0)

    def carry(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The weights the next version gives workers: `tensors` (the learner's, in the wire format) where
        the version is full or topk is 1; else W_pub with only the largest topk share of each matrix's
        changes applied (the class docstring). Returns arrays the caller may keep: they are not changed later."""
        if self.topk >= 1 or self.lora:
            return tensors
        if self.next_is_full() or set(self.sent) != set(tensors):
            self.sent = {name: a.copy() for name, a in tensors.items()}
            return tensors
        out = {}
        for name, new in tensors.items():
            old = self.sent[name]
            if new.ndim < 2:  # norms: a few KB, always whole
                out[name] = new
                continue
            change = np.abs(to_float32(new) - to_float32(old)).reshape(-1)  # 0 where the 16-bit value is the same
            take = top_share(change, self.topk)
            carried = old.copy()
            carried.reshape(-1)[take] = new.reshape(-1)[take]
            out[name] = carried
        self.sent = out
        return out

    def encode(self, version: int, tensors: dict[str, np.ndarray], signer: Host | None = None) -> PolicyVersion:
        """Encode a snapshot as the next version of the chain (the first: full; after it, a delta) and sign
        it with `signer`'s key; the next delta builds on it. When the version is due a full snapshot and
        is not the first, the snapshot is made too and left in `self.beside` (else None). publish() also
        hands them to the seeder (benchmarks call this alone)."""
        adapter = self.lora and self.base is not None
        full = self.next_is_full()
        first = self.previous is None
        pv, raw = build_version(
            self.run_id, version, tensors, wire_dtypes(tensors),
            base=None if first or adapter else self.previous, chunk_size=self.chunk_size,
            adapter_base=self.base if adapter else None,
        )  # fmt: skip
        self.beside = None
        if full and not first:  # the same raw bytes, whole
            self.beside = build_from_raw(self.run_id, version, pv.manifest.tensors, raw, chunk_size=self.chunk_size)
        for made in (pv, self.beside):
            if made is not None and signer is not None:
                made.manifest = made.manifest.signed(signer.key, signer.peer_id)
        self.previous = (version, raw)
        self.published += 1
        if self.lora and self.base is None:
            self.base = version  # the frozen base later versions' adapters apply to
        return pv

    def publish(self, version: int, tensors: dict[str, np.ndarray]) -> Manifest:
        """Encode a snapshot as a full or delta version, sign it, hand it to the seeder, announce it."""
        adapter = self.lora and self.base is not None
        full = self.next_is_full()
        pv = self.encode(version, tensors, self.seeder.host)
        self.seeder.publish(pv, self.beside)
        store = self.seeder.store
        if full:  # keep the chain from the snapshot before this one: a worker mid-way through it can finish
            for kept in (store, self.seeder.snapshots):
                for old in [v for v in kept.manifests if self.last_full is not None and v < self.last_full]:
                    kept.drop(old)
            self.last_full = version
        if adapter:  # a worker mid-fetch may still want the one before
            for old in sorted(v for v in store.manifests if v != self.base)[: -self.adapter_keep]:
                store.drop(old)
        log.info(
            "published v%d (%s, %.1f MB on the wire, %.1f%% of the raw 16-bit tensors)%s", version,
            f"LoRA adapters for v{self.base}" if adapter else pv.manifest.codec,
            pv.manifest.payload_size / 1e6, 100 * pv.manifest.payload_size / pv.manifest.raw_size,
            f"; a {self.beside.manifest.payload_size / 1e6:.1f} MB full snapshot beside it" if self.beside else "",
        )  # fmt: skip
        return pv.manifest
