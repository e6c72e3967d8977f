"""Rollout verification: recompute a worker's behaviour logprobs with the weights it claims to have used.

A worker reports, for every sampled token, log mu(token) under the policy version x it held. The learner
keeps the 16-bit weights of every version still inside the staleness window (exactly what it
published), loads version x into a float32 copy of the architecture, and recomputes the logprobs at the
same temperature and top-p. The divergence of a group is

    d = mean over its tokens of min(|log mu_worker - log mu_x|, CAP)

With top-p < 1, log mu_x is taken under two nuclei, the strict one and the one a token wider, whichever
is closer: rounding can put a token just inside the worker's nucleus and just outside ours.

and a worker whose d exceeds `tolerance` is flagged: the submission is refused and every group of
that worker still in the buffer is dropped. Honest llama.cpp output (F16 GGUF, its own kernels) differs
from torch only by rounding; `echo-rl bench verify` measures that noise and how far forged logprobs land.

Which groups: every group of a worker's first `first` groups, then each group with probability
`fraction` (seeded, so a worker cannot tell which will be checked).
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Mapping

import numpy as np
import torch

from learner.trainer import Rollout, pack_completions
from p2p.codec import bf16_to_f32
from p2p.messages import is_adapter

log = logging.getLogger(__name__)

CAP = 10.0  # nats: one token outside the recomputed nucleus must not make d infinite


def to_float(array: np.ndarray) -> torch.Tensor:
    """A wire tensor (bf16 bits as uint16, f16 or f32) as float32."""
    if array.dtype == np.uint16:
        array = bf16_to_f32(array)
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def merged_weights(
    base: Mapping[str, np.ndarray], adapters: Mapping[str, np.ndarray] | None, scale: float
) -> dict[str, torch.Tensor]:
    """Full float32 weights under HF names; LoRA adapters merged: W + scale * B A."""
    weights = {name: to_float(a) for name, a in base.items() if not is_adapter(name)}
    for name, a in (adapters or {}).items():
        if name.endswith(".lora_A.weight"):
            target = name.removesuffix(".lora_A.weight") + ".weight"
            b = adapters[name.removesuffix(".lora_A.weight") + ".lora_B.weight"]
            weights[target] = weights[target] + scale * (to_float(b) @ to_float(a))  # [out, r] @ [r, in]
    return weights


def sampler_logprobs(model: torch.nn.Module, batch: list[Rollout], temperature: float, top_p: float) -> torch.Tensor:
    """log mu(token) for every completion token of `batch`: [K, N], K = 1 (top_p = 1) or 2 (top_p < 1).

    mu = softmax(logits / T) restricted to the top-p nucleus and renormalised, as worker.sampling draws
    it (-inf outside). With top_p < 1, row 0 is the strict nucleus and row 1 the nucleus one token wider.
    """
    ids, mask, rows_t, cols_t = pack_completions(batch)  # [B, T], [B, T], [N], [N]
    # the output layer only at completion positions (as learner.trainer.completion_logprobs)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    logits = model.lm_head(out.hidden_states[-1][rows_t, cols_t]).double() / temperature  # [N, V]
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]
    targets = ids[rows_t, cols_t + 1][:, None]  # [N, 1]
    if top_p >= 1.0:
        return logp.gather(1, targets).T  # [1, N]
    sorted_p, order = logp.exp().sort(dim=-1, descending=True)  # [N, V]
    strict = (sorted_p.cumsum(-1) - sorted_p) < top_p  # [N, V] a prefix of the sorted tokens
    wider = strict | torch.cat([torch.ones_like(strict[:, :1]), strict[:, :-1]], dim=1)
    out = []
    for keep_sorted in (strict, wider):
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)  # [N, V]
        kept_mass = (logp.exp() * keep).sum(-1, keepdim=True)  # [N, 1]
        truncated = torch.where(keep, logp - kept_mass.log(), torch.tensor(-torch.inf, dtype=logp.dtype))
        out.append(truncated.gather(1, targets)[:, 0])
    return torch.stack(out)  # [2, N]


def divergence(reported: list[float], recomputed: torch.Tensor) -> float:
    """Mean over tokens of min(|reported - recomputed|, CAP) in nats; `recomputed` [K, N]: the closest row
    counts for each token."""
    diff = (torch.tensor(reported, dtype=torch.float64)[None, :] - recomputed).abs().nan_to_num(CAP, CAP, CAP)
    return float(diff.min(dim=0).values.clamp(max=CAP).mean())


class RolloutVerifier:
    """Keeps the published weights of recent versions and recomputes behaviour logprobs on demand.

    Thread-safe: handlers on several threads may verify at once (one model, one at a time)."""

    def __init__(
        self, make_model, temperature: float, top_p: float, first: int, fraction: float, tolerance: float,
        lora_scale: float = 0.0, keep: int = 4, seed: int = 0,
    ) -> None:  # fmt: skip
        self.make_model = make_model  # () -> a float32 torch model of the policy's architecture (no LoRA)
        self.temperature, self.top_p = temperature, top_p
        self.first, self.fraction, self.tolerance = first, fraction, tolerance
        self.lora_scale = lora_scale
        self.keep = keep  # versions kept besides a LoRA base: staleness + publish_every + 1 is enough
        self.versions: dict[int, tuple[dict[str, np.ndarray], int | None]] = {}  # v -> (wire tensors, adapter base)
        self.checked: dict[str, int] = {}  # worker -> groups verified
        self.divergences: deque[float] = deque(maxlen=1000)  # of the newest verified groups, for status
        self.flagged: dict[str, str] = {}  # worker -> why
        self._rng = random.Random(seed)
        self._model: torch.nn.Module | None = None
        self._loaded = -1
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.first > 0 or self.fraction > 0

    def remember(self, version: int, tensors: dict[str, np.ndarray], adapter_base: int | None) -> None:
        """Keep a published version's wire tensors (the newest `keep`, and the base LoRA versions need)."""
        if not self.enabled:
            return
        with self._lock:
            self.versions[version] = (tensors, adapter_base)
            bases = {b for _, b in self.versions.values() if b is not None}
            for old in sorted(self.versions)[: -self.keep]:
                if old not in bases:
                    del self.versions[old]

    def wants(self, worker: str) -> bool:
        """Whether to verify this worker's next group."""
        with self._lock:
            return self.checked.get(worker, 0) < self.first or self._rng.random() < self.fraction

    def check(self, worker: str, version: int, group: list[Rollout]) -> float | None:
        """The group's divergence d from version `version`, or None if that version is no longer kept.
        Flags the worker when d > tolerance."""
        with self._lock:
            if version not in self.versions:
                return None
            self._load_locked(version)
            with torch.no_grad():
                recomputed = sampler_logprobs(self._model, group, self.temperature, self.top_p)
            d = divergence([lp for r in group for lp in r.behaviour_logprobs], recomputed)
            self.checked[worker] = self.checked.get(worker, 0) + 1
            self.divergences.append(d)
            if d > self.tolerance:
                self.flagged[worker] = (
                    f"logprobs diverge from v{version} by {d:.3f} nats/token (tolerance {self.tolerance})"
                )
            return d

    def _load_locked(self, version: int) -> None:
        if self._loaded == version:
            return
        tensors, base = self.versions[version]
        weights = merged_weights(self.versions[base][0], tensors, self.lora_scale) if base is not None else (
            merged_weights(tensors, None, 0.0))  # fmt: skip
        if self._model is None:
            self._model = self.make_model().float().eval().requires_grad_(False)
        missing, unexpected = self._model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"verifier weights do not fit the model: {unexpected[:3]} {missing[:3]}")
        self._loaded = version
