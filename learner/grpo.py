"""The GRPO objective (design.md §4) as pure tensor functions, so it can be checked by hand."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    rewards: [P, G] (P prompts, G completions each); std is the population std (ddof 0).
    A group whose rewards are all equal gets A = 0 exactly, so it contributes no policy gradient.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # [P, 1]
    return (rewards - mean) / (std + eps)  # [P, G]


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
    decoupled: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate against the behaviour policy mu with a truncated importance ratio.

    All inputs are flat over completion tokens: [N].
        ratio   = exp(logp - logp_mu)                                  (pi_theta / mu per token)
        surr    = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        surr    = max(surr, ratio_cap * A)  where A < 0                (the ratio is truncated at the cap)
        kl      = exp(logp_ref - logp) - (logp_ref - logp) - 1          (k3 estimator, only when beta > 0)
        loss    = sum_tokens w * (-surr + beta * kl)
    `token_weights` w sets the normalisation: 1/total_tokens (token-level) or 1/(len_i * n_seqs)
    (sequence-level). With A > 0 the clip at 1 + eps_high already bounds the ratio; with A < 0 the
    truncation at ratio_cap keeps one stale, unlikely token from dominating the batch (as in TIS and
    dual-clip PPO). Tokens whose term is clipped carry no gradient.

    decoupled=True (decoupled PPO, as in AReaL): the clip is taken against the proximal policy
    pi_prox = the learner's weights before this step, and the behaviour policy only enters through a
    truncated importance weight:
        ratio   = exp(logp - logp_prox)                                (1 at the start of the step)
        iw      = min(exp(logp_prox - logp_mu), ratio_cap)
        surr    = iw * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    so stale rollouts are re-weighted instead of clipped away.
    """
    log_ratio = logp - logp_behaviour  # [N]
    ratio = torch.exp(log_ratio)
    if decoupled:
        proximal = logp.detach()
        importance = torch.exp(proximal - logp_behaviour).clamp(max=ratio_cap)  # [N]
        prox_ratio = torch.exp(logp - proximal)  # [N], 1 with the gradient of logp
        unclipped = prox_ratio * advantages
        clipped = torch.clamp(prox_ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
        surrogate = importance * torch.minimum(unclipped, clipped)
    else:
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
        surrogate = torch.minimum(unclipped, clipped)
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, ratio_cap * advantages), surrogate)
    per_token = -surrogate  # [N]
    stats = {}
    if logp_ref is not None and beta > 0:
        delta = logp_ref - logp
        kl_ref = torch.exp(delta) - delta - 1.0  # [N]
        per_token = per_token + beta * kl_ref
        stats["kl_ref"] = float((kl_ref.detach() * token_weights).sum())
    loss = (per_token * token_weights).sum()
    with torch.no_grad():
        is_clipped = (
            (torch.minimum(unclipped, clipped) != unclipped).float() if decoupled else (surrogate != unclipped).float()
        )
        stats["clip_frac"] = float((is_clipped * token_weights).sum() / token_weights.sum().clamp(min=1e-12))
        # k3 estimate of KL(mu || pi_theta): how far the sampler's policy is from the trained one
        stats["kl_behaviour"] = float(((ratio - 1.0 - log_ratio) * token_weights).sum() / token_weights.sum())
        stats["ratio_mean"] = float((ratio * token_weights).sum() / token_weights.sum())
    return loss, stats
