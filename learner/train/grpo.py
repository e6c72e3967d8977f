"""The GRPO objective (docs/design.md §4) as pure tensor functions, so it can be checked by hand.

One seam per idea: a policy objective is one function in OBJECTIVES and a correction of the sampler's
mismatch one function in CORRECTIONS, each found by its config value (grpo.objective, grpo.correction)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.config import GRPOConfig

REWARD_LIMIT = 100.0
"""Rewards are clamped to [-REWARD_LIMIT, REWARD_LIMIT]; a non-finite reward scores 0 (learner.tasks)."""
LOG_RATIO_LIMIT = 20.0
"""log(pi / mu) is clamped to [-20, 20] before exp: e^20 ~ 5e8 is finite in float32 and far beyond any clip,
so a clamped token's term is constant (no gradient) instead of inf, whose backward gives 0 * inf = NaN."""


def clamp_reward(reward: float) -> float:
    """A reward from any function, made safe to normalise: finite and within +-REWARD_LIMIT."""
    if not isinstance(reward, int | float) or not math.isfinite(reward):
        return 0.0
    return float(min(max(reward, -REWARD_LIMIT), REWARD_LIMIT))


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps) within each group; A_i = r_i - mean(r) without the scaling
    (Dr. GRPO: dividing by std weighs a group by how little its rewards differ).

    rewards: [P, G] (P prompts, G completions each); std is the population std (ddof 0).
    A group whose rewards are all equal gets A = 0 exactly (not the 1e-10 that rounding of a
    non-dyadic mean would leave), so it contributes no policy gradient.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # [P, 1]
    equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # [P, 1]
    centred = rewards - mean  # [P, G]
    return torch.where(equal, torch.zeros_like(rewards), centred / (std + eps) if scale_by_std else centred)


def exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-LOG_RATIO_LIMIT (finite in float32, and so is its gradient)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


@dataclass
class TokenBatch:
    """The flat inputs of one pass's loss, every tensor [N] over its sampled completion tokens."""

    logp: torch.Tensor  # log pi_theta, with gradient
    logp_behaviour: torch.Tensor  # log mu, the sampler's (from the worker)
    advantages: torch.Tensor  # A of each token's sequence
    sequence: torch.Tensor  # long: which sequence of the pass each token belongs to (0 .. n_sequences - 1)
    logp_proximal: torch.Tensor | None = None  # log pi_prox, the learner's policy before this step (detached)
    correction: torch.Tensor | None = None  # the correction's weight w (detached; 0: dropped), None: all 1


Objective = Callable[[TokenBatch, GRPOConfig], tuple[torch.Tensor, torch.Tensor]]
"""An objective's surrogate per token [N] (maximised) and which tokens it clipped [N] (bool)."""

OBJECTIVES: dict[str, Objective] = {}
"""grpo.objective -> its surrogate. Adding an objective is one function here and one config value."""
PROXIMAL_OBJECTIVES = {"decoupled", "gspo", "cispo"}
"""Objectives whose ratio is to the learner's own policy pi_prox; they take grpo.correction's weight."""


def objective(name: str) -> Callable[[Objective], Objective]:
    def register(fn: Objective) -> Objective:
        OBJECTIVES[name] = fn
        return fn

    return register


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's min(ratio A, clip(ratio, low, high) A) per token, and the unclipped term."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, low, high) * advantages
    return torch.minimum(unclipped, clipped), unclipped


@objective("behaviour")
def behaviour_surrogate(t: TokenBatch, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO against the sampler's policy mu:
        ratio = pi_theta / mu,  surr = min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A),
        surr  = max(surr, ratio_cap A) where A < 0.
    A token with A > 0 and ratio > 1 + eps_high, or with A < 0 and ratio < 1 - eps_low or ratio >
    ratio_cap, contributes a constant: no gradient (the dual clip of Ye et al. 2020, not truncated
    importance sampling, which would keep such a token with weight ratio_cap). The dual clip keeps one
    stale, unlikely token with a negative advantage from dominating the batch. The ratio to mu carries
    staleness and the sampler's mismatch at once, so this objective takes no correction."""
    ratio = exp_ratio(t.logp - t.logp_behaviour)  # [N]
    kept, unclipped = clipped_surrogate(ratio, t.advantages, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    kept = torch.where(t.advantages < 0, torch.maximum(kept, cfg.ratio_cap * t.advantages), kept)
    return kept, kept != unclipped


@objective("decoupled")
def decoupled_surrogate(t: TokenBatch, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO (AReaL): the trust region is the learner's own policy before this step,
        ratio = pi_theta / pi_prox (1 at a step's first update),  surr = min(ratio A, clip(ratio) A),
    and the correction's weight w(pi_prox / mu) re-weights stale and mismatched tokens instead of
    clipping them away. The clip binds from the second minibatch update of a step on."""
    ratio = exp_ratio(t.logp - t.logp_proximal)  # [N]
    kept, unclipped = clipped_surrogate(ratio, t.advantages, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return kept, kept != unclipped


@objective("gspo")
def gspo_surrogate(t: TokenBatch, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its tokens' ratios,
        s_i  = exp(mean_{t in i, kept} (log pi_theta - log pi_prox)),  surr_i = min(s_i A_i, clip(s_i) A_i),
    every token of sequence i carrying surr_i (so loss_norm = sequence gives GSPO's 1/G sum_i exactly).
    The mean runs over the tokens the correction kept, so a dropped token gets no gradient through s_i.
    The paper's clip is far tighter than PPO's (eps_low 3e-4, eps_high 4e-4)."""
    kept = torch.ones_like(t.logp) if t.correction is None else (t.correction > 0).to(t.logp.dtype)  # [N]
    log_ratio = (t.logp - t.logp_proximal) * kept  # [N]
    n = int(t.sequence.max()) + 1 if len(t.sequence) else 0
    sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, t.sequence, log_ratio)
    counts = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, t.sequence, kept)  # [S]
    seq_ratio = exp_ratio(sums / counts.clamp(min=1.0))  # [S]
    kept, unclipped = clipped_surrogate(seq_ratio[t.sequence], t.advantages, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return kept, kept != unclipped


@objective("cispo")
def cispo_surrogate(t: TokenBatch, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): clip the importance weight, not the update, so no token loses its gradient,
        surr = sg(clip(pi_theta / pi_prox, 1 - eps_low, 1 + eps_high)) A log pi_theta
    (sg: no gradient through the weight; d surr / d log pi_theta = clipped weight x A)."""
    ratio = exp_ratio(t.logp.detach() - t.logp_proximal)  # [N]
    weight = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    return weight * t.advantages * t.logp, weight != ratio


Correction = Callable[[torch.Tensor, GRPOConfig], torch.Tensor]
"""log rho = log pi_prox - log mu of one sequence's tokens [n] -> each token's weight w [n] (0: dropped)."""

CORRECTIONS: dict[str, Correction] = {}
"""grpo.correction -> the weight an objective anchored at pi_prox gives each token for the sampler's mismatch
and staleness rho = pi_prox / mu. A dropped token (w = 0) leaves the loss's normaliser too."""


def correction(name: str) -> Callable[[Correction], Correction]:
    def register(fn: Correction) -> Correction:
        CORRECTIONS[name] = fn
        return fn

    return register


@correction("none")
def no_correction(log_rho: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """w = 1: rollouts are trained on as if pi_prox had sampled them."""
    return torch.ones_like(log_rho)


@correction("tis")
def truncated_is(log_rho: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Token-level truncated importance sampling: w = min(rho, ratio_cap)."""
    return exp_ratio(log_rho).clamp(max=cfg.ratio_cap)


@correction("mis")
def masked_is(log_rho: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Token-level masked importance sampling: w = rho where rho <= ratio_cap, else 0 (the token is dropped
    rather than kept at the cap: one the sampler drew far less readily than pi would is a mismatch, not data)."""
    rho = exp_ratio(log_rho)
    return torch.where(rho <= cfg.ratio_cap, rho, torch.zeros_like(rho))


@correction("icepop")
def icepop(log_rho: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """IcePop (Ling team, Ring-1T): two-sided token masking, w = rho where mismatch_low <= rho <= mismatch_high,
    else 0, so tokens where trainer and sampler disagree either way leave the gradient."""
    rho = exp_ratio(log_rho)
    inside = (rho >= cfg.mismatch_low) & (rho <= cfg.mismatch_high)
    return torch.where(inside, rho, torch.zeros_like(rho))


@correction("seq_mask")
def sequence_mask(log_rho: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Sequence-level masking by the geometric mean ratio: g = exp(mean_t log rho); the whole sequence
    has w = 1 where mismatch_low <= g <= mismatch_high, else w = 0 (no re-weighting)."""
    if not len(log_rho):
        return torch.ones_like(log_rho)
    g = float(exp_ratio(log_rho.mean()))
    keep = cfg.mismatch_low <= g <= cfg.mismatch_high
    return torch.full_like(log_rho, 1.0 if keep else 0.0)


def correction_weights(logp_proximal: torch.Tensor, logp_behaviour: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """The correction's weights of one sequence's tokens [n], detached."""
    return CORRECTIONS[cfg.correction](logp_proximal.detach() - logp_behaviour, cfg)


def policy_loss(
    t: TokenBatch,
    token_weights: torch.Tensor,
    cfg: GRPOConfig,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = sum_tokens v * (-w * surr + beta * kl), over flat [N] tokens, with
        surr the objective's (OBJECTIVES[cfg.objective]) surrogate,
        w    the correction's weight (t.correction; 1 for behaviour),
        kl   = exp(logp_ref - logp) - (logp_ref - logp) - 1      (k3 estimator, only when beta > 0),
        v    = `token_weights`, the normalisation: 1/kept tokens (token), 1/(len_i * n_seqs) (sequence) or
               1/(n_seqs * L) (constant, Dr. GRPO), set by the trainer.
    Returns the loss and per-step statistics (token-weighted means)."""
    surrogate, is_clipped = OBJECTIVES[cfg.objective](t, cfg)  # [N], [N]
    weight = t.correction if t.correction is not None else torch.ones_like(surrogate)  # [N]
    per_token = -weight * surrogate  # [N]
    stats = {}
    if logp_ref is not None and cfg.beta > 0:
        delta = (logp_ref - t.logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl_ref = torch.exp(delta) - delta - 1.0  # [N]
        per_token = per_token + cfg.beta * kl_ref
        stats["kl_ref"] = float((kl_ref.detach() * token_weights).sum())
    loss = (per_token * token_weights).sum()
    with torch.no_grad():
        total = token_weights.sum().clamp(min=1e-12)
        log_ratio = (t.logp - t.logp_behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
        ratio = torch.exp(log_ratio)
        stats["clip_frac"] = float((is_clipped.float() * token_weights).sum() / total)
        # k3 estimate of KL(mu || pi_theta): how far the sampler's policy is from the trained one
        stats["kl_behaviour"] = float(((ratio - 1.0 - log_ratio) * token_weights).sum() / total)
        stats["ratio_mean"] = float((ratio * token_weights).sum() / total)
    return loss, stats
