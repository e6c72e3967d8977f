"""The GRPO objective (docs/design.md §4) as pure tensor functions, so it can be checked by hand."""

from __future__ import annotations

import math

import torch

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


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    rewards: [P, G] (P prompts, G completions each); std is the population std (ddof 0).
    A group whose rewards are all equal gets A = 0 exactly (not the 1e-10 that rounding of a
    non-dyadic mean would leave), so it contributes no policy gradient.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # [P, 1]
    equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # [P, 1]
    return torch.where(equal, torch.zeros_like(rewards), (rewards - mean) / (std + eps))  # [P, G]


def policy_loss(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    eps_low: float,
    eps_high: float,
    ratio_cap: float,
    logp_ref: torch.Tensor | None = None,
    beta: float = 0.0,
    logp_proximal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate, per token, summed with weights. All inputs are flat over completion tokens: [N].

    behaviour (the default: dual-clip PPO against the sampler's policy mu):
        ratio   = exp(clamp(logp - logp_mu, +-LOG_RATIO_LIMIT))          (pi_theta / mu per token)
        surr    = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        surr    = max(surr, ratio_cap * A)  where A < 0                  (dual clip)
    A token with A > 0 and ratio > 1 + eps_high, or with A < 0 and ratio < 1 - eps_low or ratio >
    ratio_cap, contributes a constant: no gradient (this is the dual clip of Ye et al. 2020, not
    truncated importance sampling, which would keep such a token with weight ratio_cap). The dual clip
    keeps one stale, unlikely token with a negative advantage from dominating the batch.

    decoupled (decoupled PPO as in AReaL), given logp_proximal = log pi_prox, the learner's own policy
    before this step's first update (computed once, detached):
        ratio   = exp(clamp(logp - logp_prox, ...))                      (1 at the first update)
        iw      = min(exp(clamp(logp_prox - logp_mu, ...)), ratio_cap)   (truncated importance weight)
        surr    = iw * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    so stale rollouts are re-weighted instead of clipped away, and the trust region is the learner's
    own: it binds from the second minibatch update of a step on (grpo.minibatches >= 2).

    Both:
        kl      = exp(logp_ref - logp) - (logp_ref - logp) - 1          (k3 estimator, only when beta > 0)
        loss    = sum_tokens w * (-surr + beta * kl)
    `token_weights` w sets the normalisation: 1/total_tokens (token-level) or 1/(len_i * n_seqs)
    (sequence-level).
    """
    log_ratio = (logp - logp_behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
    ratio = torch.exp(log_ratio)
    if logp_proximal is not None:
        importance = torch.exp((logp_proximal - logp_behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        importance = importance.clamp(max=ratio_cap)  # [N]
        prox_ratio = torch.exp((logp - logp_proximal).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # [N]
        unclipped = prox_ratio * advantages
        clipped = torch.clamp(prox_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
        kept = torch.minimum(unclipped, clipped)
        surrogate = importance * kept
    else:
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
        kept = torch.minimum(unclipped, clipped)
        kept = torch.where(advantages < 0, torch.maximum(kept, ratio_cap * advantages), kept)
        surrogate = kept
    per_token = -surrogate  # [N]
    stats = {}
    if logp_ref is not None and beta > 0:
        delta = (logp_ref - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl_ref = torch.exp(delta) - delta - 1.0  # [N]
        per_token = per_token + beta * kl_ref
        stats["kl_ref"] = float((kl_ref.detach() * token_weights).sum())
    loss = (per_token * token_weights).sum()
    with torch.no_grad():
        total = token_weights.sum().clamp(min=1e-12)
        is_clipped = (kept != unclipped).float()
        stats["clip_frac"] = float((is_clipped * token_weights).sum() / total)
        # k3 estimate of KL(mu || pi_theta): how far the sampler's policy is from the trained one
        stats["kl_behaviour"] = float(((ratio - 1.0 - log_ratio) * token_weights).sum() / total)
        stats["ratio_mean"] = float((ratio * token_weights).sum() / total)
    return loss, stats
