"""Rollout verification: replay a worker's sampling with the weights it claims to have used.

A worker reports, for every sampled token, log mu(token) under the policy version x it held, and it drew
every token from the lease's counter-based stream (p2p.draws). The learner keeps the 16-bit weights of
every version still inside the staleness window (exactly what it published), loads version x into a
float32 copy of the architecture, and recomputes at the same temperature and top-p:

    logprob divergence   d = mean over the group's tokens of min(|log mu_worker - log mu_x|, CAP)
    draw miss            m = max over the group's tokens of dist(u, [C_x(t - 1), C_x(t)])
    off-draw share       o = share of the group's tokens with dist(u, [C_x(t - 1), C_x(t)]) > DRAW_NOISE

where u = p2p.draws.uniform(lease seed, group, completion, position) is the token's draw and
[C_x(t - 1), C_x(t)] its interval of the inverse CDF in token-id order under version x (dist is 0 inside).
d catches forged logprobs; m catches text the worker did not sample (its own text with exact logprobs,
another seed): given the seed and the weights a completion is determined, up to float noise at the
interval borders. o catches steering within m's tolerance: where the policy is flat, many tokens' intervals
lie within it of u, and a worker that knows u and the weights could pick among them; an honest worker's
token is off its draw only where u lies within float noise of an interval's border, and then by no more
than that noise (DRAW_NOISE), so a worker that steers further often is flagged and one that steers rarely
moves the data by little. Steering within the noise itself is not visible to a replay (docs/security.md).
With top-p < 1 all three are taken under two nuclei, the strict one and the one a token wider, whichever is
closer: rounding can put a token just inside the worker's nucleus and just outside ours.

A worker whose d exceeds `tolerance`, whose m exceeds `draw_tolerance` or whose o exceeds
`off_draw_tolerance` is flagged: the submission is refused and every group of that worker still in the
buffer is dropped. Honest llama.cpp output (F16
GGUF, its own kernels) differs from torch only by rounding; `echo-rl bench verify` measures that noise
and how far forgeries land.

Greedy completions (held-out evaluation, learner.orchestrate.evaluations) have no draws: each token must be
the most likely one under version x, up to the rounding noise between llama.cpp's F16 and float32 logits:

    greedy gap           g = max over the group's tokens of (max_t' z_x(t') - z_x(t))   (z: logits)

and a worker whose g exceeds GREEDY_GAP is flagged like any other forger.

A quantized worker's groups (`worker join --quant`, each drawn alone on llama.cpp) are replayed by llama.cpp on
the same format instead (learner.orchestrate.verify_quantized), where an honest worker's d and m are exactly 0:
its tolerances there are EXACT.

Which groups: each group independently, with a probability that falls as the worker's accepted work grows,

    p(worker) = 1                               while fewer than `first` of its groups were verified
              = max(fraction, first / n)        after, n = its groups accepted so far

drawn from the operating system's randomness, so nothing a worker sees (not the run seed, not its lease
ids) tells which of its groups will be checked. A new identity's forgery is therefore never trained on:
identities are free, so the first groups of each are all checked, and a forger must first deliver
`first` verified honest groups, then about first / (1 - q) in all before a forgery passes with probability
q. Only groups of accepted submissions count as verified or accepted work: replays and refusals never do.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from learner.orchestrate.replay_torch import greedy_gaps, merged_weights, replay_sampling
from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify_quantized import EXACT, QuantizedReplay
from learner.train.trainer import sampled, sampled_logprobs
from p2p.draws import uniforms
from p2p.messages import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

CAP = 10.0  # nats: one token outside the recomputed nucleus must not make d infinite
# logits: SmolLM2's llama.cpp logits differ from float32 torch's by at most 0.086 (p99 0.05; 643 greedy
# positions), so an honest near-tie flips with a gap of at most 2 x 0.086; a substituted token lies lower
# (the median top-1 / top-2 margin there is 1.9, 10% of margins are below 0.26)
GREEDY_GAP = 0.25
# probability mass: how far honest float noise moves a token's inverse-CDF interval (llama.cpp's F16 against the
# float32 replay): SmolLM2 at T 0.8 put up to 8% of a group's tokens beside their draws, by at most 1.2e-3
# (2026-11-25; bench verify: m at most 1.6e-3), so o counts only tokens further off than this
DRAW_NOISE = 2e-3


def divergence(reported: list[float], recomputed: torch.Tensor) -> float:
    """Mean over tokens of min(|reported - recomputed|, CAP) in nats; `recomputed` [K, N]: the closest row
    counts for each token."""
    diff = (torch.tensor(reported, dtype=torch.float64)[None, :] - recomputed).abs().nan_to_num(CAP, CAP, CAP)
    return float(diff.min(dim=0).values.clamp(max=CAP).mean())


def draw_miss(misses: torch.Tensor) -> float:
    """The largest distance of a token's draw from its interval; `misses` [K, N]: per token, the closest row."""
    return float(misses.min(dim=0).values.max()) if misses.numel() else 0.0


def off_draw(misses: torch.Tensor) -> float:
    """The share of tokens whose draw lies further than honest float noise (DRAW_NOISE) outside their interval;
    `misses` [K, N]: per token, the closest row."""
    return float((misses.min(dim=0).values > DRAW_NOISE).double().mean()) if misses.numel() else 0.0


@dataclass(frozen=True)
class Replay:
    """What replaying one group's sampling found (module docstring): d, m and o, and the replay's own logprob of
    every sampled token (of the nucleus closest to the worker's, top_p < 1), in completion order."""

    divergence: float
    draw_miss: float
    off_draw: float
    logprobs: list[float] = field(default_factory=list, repr=False)
    refused: str = ""  # why the group could not be replayed at all (no honest worker sends it): flagged


def group_draws(seed: int, group_id: int, group: list[Rollout], first: int = 0) -> torch.Tensor:
    """The draws behind every sampled token of a group whose completions are numbered from `first`, flat in
    completion order: [N]. An episode's position counts its observation tokens too (p2p.messages.GenerationRequest)."""
    keys = [(group_id, first + j, pos) for j, r in enumerate(group) for pos in sampled(r)]
    return torch.from_numpy(uniforms(seed, keys))


class RolloutVerifier:
    """Keeps the published weights of recent versions and recomputes behaviour logprobs on demand.

    Thread-safe: handlers on several threads may verify at once (one model, one replay at a time; remember(),
    flags and counters do not wait for a replay)."""

    def __init__(
        self, make_model, temperature: float, top_p: float, first: int, fraction: float, tolerance: float,
        draw_tolerance: float, lora_scale: float = 0.0, keep: int = 4, device: torch.device | str = "cpu",
        off_draw_tolerance: float = 1.0, quantized: QuantizedReplay | None = None,
    ) -> None:  # fmt: skip
        self.make_model = make_model  # () -> a float32 torch model of the policy's architecture (no LoRA)
        self.device = torch.device(device)  # where the replay runs (the learner's device)
        self.temperature, self.top_p = temperature, top_p
        self.first, self.fraction, self.tolerance = first, fraction, tolerance
        self.draw_tolerance, self.off_draw_tolerance = draw_tolerance, off_draw_tolerance
        self.lora_scale = lora_scale
        self.quantized = quantized  # replays quantized workers on llama.cpp (None: this learner does not)
        self.keep = keep  # versions kept besides a LoRA base: staleness + publish_every + 1 is enough
        self.versions: dict[int, tuple[dict[str, np.ndarray], int | None]] = {}  # v -> (wire tensors, adapter base)
        self.checked: dict[str, int] = {}  # worker -> groups verified in accepted submissions
        self.groups_accepted: dict[str, int] = {}  # worker -> groups accepted (verified or not)
        self.replays, self.replay_s = 0, 0.0  # groups replayed (accepted or not), and the seconds it took
        self.divergences: deque[float] = deque(maxlen=1000)  # of the newest verified groups, for status
        self.draw_misses: deque[float] = deque(maxlen=1000)
        self.off_draws: deque[float] = deque(maxlen=1000)
        self.flagged: dict[str, str] = {}  # worker -> why
        self.pinned: set[int] = set()  # versions kept whatever their age (an evaluation lease is out on them)
        self._rng = random.SystemRandom()  # the OS's randomness: no seed a worker could learn
        self._model: torch.nn.Module | None = None
        self._loaded = -1
        self._lock = threading.Lock()  # the tables and counters (held briefly)
        self._replaying = threading.Lock()  # the replay model (held for a whole replay)
        self._replaying_quantized = threading.Lock()  # the quantized replay's engines (likewise)

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
                if old not in bases and old not in self.pinned:
                    del self.versions[old]

    def pin(self, version: int) -> None:
        """Keep `version` until unpin(): an evaluation lease on it may come back later than the window."""
        with self._lock:
            self.pinned.add(version)

    def unpin(self, version: int) -> None:
        with self._lock:
            self.pinned.discard(version)

    def held_gib(self) -> float:
        """Memory held: the kept versions' wire tensors, the float32 replay model and quantized ones, GiB."""
        with self._lock:
            kept = sum(a.nbytes for tensors, _ in self.versions.values() for a in tensors.values())
            model = sum(p.numel() * p.element_size() for p in self._model.parameters()) if self._model else 0
        quantized = self.quantized.held_bytes() if self.quantized is not None else 0
        return (kept + model + quantized) / 2**30

    def share(self, worker: str) -> float:
        """p(worker): the probability that its next group is verified (module docstring)."""
        with self._lock:
            if not self.enabled:
                return 0.0
            if self.checked.get(worker, 0) < self.first:
                return 1.0
            return max(self.fraction, min(1.0, self.first / max(1, self.groups_accepted.get(worker, 0))))

    def wants(self, worker: str) -> bool:
        """Whether to verify this group of `worker`: an independent draw from the OS's randomness."""
        return self._rng.random() < self.share(worker)

    def measure(
        self, version: int, seed: int, group_id: int, group: list[Rollout], params: tuple[float, float] | None = None,
        first: int = 0, quantized: tuple[str, SamplingParams] | None = None,
    ) -> Replay | None:  # fmt: skip
        """Replay a group's sampling (its lease's `seed`, its id, its completions in order, numbered from `first`)
        under version `version`, or None if that version is no longer kept. `params`: the lease's (temperature,
        top_p), where they are not the run's (`echo-rl serve`'s requests each bring theirs). `quantized`: the
        weight format the worker declared and its lease's sampling, for a group drawn alone on llama.cpp."""
        temperature, top_p = params or (self.temperature, self.top_p)
        if quantized is not None:
            return self._measure_quantized(version, group_id, group, first, *quantized)
        with self._replaying:
            if not self._load(version):
                return None
            tick = time.perf_counter()
            with torch.no_grad():
                recomputed, misses = replay_sampling(
                    self._model, group, temperature, top_p, group_draws(seed, group_id, group, first)
                )
            with self._lock:
                self.replays += 1
                self.replay_s += time.perf_counter() - tick
        reported = [lp for r in group for lp in sampled_logprobs(r)]
        closest = (torch.tensor(reported, dtype=torch.float64)[None, :] - recomputed).abs().nan_to_num(CAP, CAP, CAP)
        logprobs = recomputed.gather(0, closest.argmin(dim=0, keepdim=True))[0].tolist()  # [N]
        return Replay(divergence(reported, recomputed), draw_miss(misses), off_draw(misses), logprobs)

    def check(
        self, worker: str, version: int, seed: int, group_id: int, group: list[Rollout],
        params: tuple[float, float] | None = None, first: int = 0, quantized: tuple[str, SamplingParams] | None = None,
    ) -> Replay | None:  # fmt: skip
        """measure() a group of `worker` and flag the worker when d > tolerance, a token's draw misses its
        interval by more than draw_tolerance (both EXACT for quantized weights: the replay is exact), or more than
        off_draw_tolerance of its tokens are off their draws. None if the version is no longer kept."""
        replay = self.measure(version, seed, group_id, group, params, first, quantized)
        if replay is None:
            return None
        d, m, o = replay.divergence, replay.draw_miss, replay.off_draw
        tolerance, draw_tolerance = (self.tolerance, self.draw_tolerance) if quantized is None else (EXACT, EXACT)
        on = f"v{version}" if quantized is None else f"v{version} {quantized[0]}"
        with self._lock:
            self.divergences.append(d)
            self.draw_misses.append(m)
            self.off_draws.append(o)
            if replay.refused:
                self.flagged[worker] = f"a group no honest worker sends ({replay.refused})"
            elif d > tolerance:
                self.flagged[worker] = f"logprobs diverge from {on} by {d:.3g} nats/token (tolerance {tolerance})"
            elif m > draw_tolerance:
                self.flagged[worker] = (
                    f"tokens were not sampled from the lease's draws under {on}: a draw misses its "
                    f"token's interval by {m:.4f} (tolerance {draw_tolerance})"
                )
            elif o > self.off_draw_tolerance:
                self.flagged[worker] = (
                    f"tokens were steered off the lease's draws under v{version}: {o:.1%} of them lie beside "
                    f"their draw's token (tolerance {self.off_draw_tolerance:.1%})"
                )
        return replay

    def _measure_quantized(
        self, version: int, group_id: int, group: list[Rollout], first: int, fmt: str, sampling: SamplingParams
    ) -> Replay | None:
        """measure() for a group drawn alone on `fmt` weights: llama.cpp's replay of its wave (verify_quantized)."""
        if self.quantized is None:  # (the handlers lease to quantized workers only where it is set)
            raise RuntimeError("this learner replays no quantized weights")
        request = GenerationRequest(group[0].prompt_ids, len(group), group_id, completion=first)
        with self._replaying_quantized:
            with self._lock:
                if version not in self.versions:
                    return None
                tensors, base = self.versions[version]
                base_tensors = self.versions[base][0] if base is not None else None
            tick = time.perf_counter()
            engine = self.quantized.load(fmt, version, tensors, base, base_tensors)
            try:
                replayed = engine.replay(request, [r.completion_ids for r in group], sampling)
            except ValueError as exc:  # more completions than G, one too long, a token outside the vocabulary
                return Replay(CAP, 1.0, 1.0, refused=str(exc))
            with self._lock:
                self.replays += 1
                self.replay_s += time.perf_counter() - tick
        recomputed = torch.tensor([[x for r in replayed for x in r.logprobs]], dtype=torch.float64)  # [1, N]
        misses = torch.tensor([[x for r in replayed for x in r.misses]], dtype=torch.float64)  # [1, N]
        reported = [lp for r in group for lp in sampled_logprobs(r)]
        return Replay(divergence(reported, recomputed), draw_miss(misses), off_draw(misses), recomputed[0].tolist())

    def close_quantized(self) -> None:
        """Free the quantized replay's engines (the learner is stopping), once no replay runs on them."""
        with self._replaying_quantized:
            self.quantized.close()

    def check_greedy(self, worker: str, version: int, group: list[Rollout]) -> float | None:
        """The greedy gap g of a group's completions under `version`; flags the worker when g > GREEDY_GAP.
        None if that version is no longer kept."""
        with self._replaying:
            if not self._load(version):
                return None
            tick = time.perf_counter()
            with torch.no_grad():
                gap = float(greedy_gaps(self._model, group).max())
        with self._lock:
            self.replays += 1
            self.replay_s += time.perf_counter() - tick
            if gap > GREEDY_GAP:
                self.flagged[worker] = (
                    f"greedy tokens are not the most likely under v{version}: one lies {gap:.3f} below "
                    f"(tolerance {GREEDY_GAP})"
                )
        return gap

    def doubt(self, replay: Replay | None = None, greedy_gap: float | None = None) -> float:
        """How close a verified group came to being flagged: its largest measure over that measure's tolerance
        (0: replayed exactly; above 1 it would have been flagged). Evaluation prefers the closer of two answers."""
        if greedy_gap is not None:
            return greedy_gap / GREEDY_GAP
        if replay is None:
            return 0.0
        return max(
            replay.divergence / max(self.tolerance, 1e-9),
            replay.draw_miss / max(self.draw_tolerance, 1e-9),
            replay.off_draw / max(self.off_draw_tolerance, 1e-9),
        )

    def flag(self, worker: str, why: str) -> None:
        """Flag `worker` for a forgery found elsewhere (an episode its environment does not replay)."""
        with self._lock:
            self.flagged[worker] = why

    def accepted(self, worker: str, verified_groups: int, groups: int | None = None) -> None:
        """Count a submission that was accepted: `groups` groups (None: as many as verified), of which
        `verified_groups` were verified (only accepted ones are verified work)."""
        with self._lock:
            self.checked[worker] = self.checked.get(worker, 0) + verified_groups
            accepted = verified_groups if groups is None else groups
            self.groups_accepted[worker] = self.groups_accepted.get(worker, 0) + accepted

    def summary(self) -> dict:
        """The status documents' verification block (docs/status.md): the newest checked groups' figures."""
        with self._lock:
            divergences, misses, off_draws = sorted(self.divergences), list(self.draw_misses), list(self.off_draws)
        n = len(divergences)
        return {"groups_checked": n, "divergence_median": divergences[n // 2] if n else None,
                "divergence_max": divergences[-1] if n else None, "draw_miss_max": max(misses, default=None),
                "off_draw_max": max(off_draws, default=None), "tolerance": self.tolerance,
                "draw_tolerance": self.draw_tolerance, "off_draw_tolerance": self.off_draw_tolerance,
                **self.cost(), "flagged": dict(self.flagged)}  # fmt: skip

    def cost(self) -> dict[str, float]:
        """Groups replayed so far and the seconds the replays took (for each step's metrics)."""
        with self._lock:
            return {"groups": self.replays, "seconds": round(self.replay_s, 3)}

    def _load(self, version: int) -> bool:
        """Load `version` into the replay model (the caller holds _replaying); False if it is no longer kept."""
        with self._lock:
            if version not in self.versions:
                return False
            if self._loaded == version:
                return True
            tensors, base = self.versions[version]
            base_tensors = self.versions[base][0] if base is not None else None
        weights = merged_weights(base_tensors, tensors, self.lora_scale) if base_tensors is not None else (
            merged_weights(tensors, None, 0.0))  # fmt: skip
        if self._model is None:
            self._model = self.make_model().float().to(self.device).eval().requires_grad_(False)
        missing, unexpected = self._model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"verifier weights do not fit the model: {unexpected[:3]} {missing[:3]}")
        self._loaded = version
        return True
