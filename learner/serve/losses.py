"""The losses a Tinker client names in forward_backward, on the flat tokens of a batch of datums.

Every loss is a sum over the target tokens of all datums (Tinker's convention: the client's weights and
advantages carry any normalisation), given
    logp = log pi_theta(target_tokens[i] | model_input[: i + 1])   [N], with gradient,
and the datums' loss_fn_inputs flattened the same way, with x["datum"] the index of each token's datum (a
sequence-level loss groups by it). Adding a loss is one function here: the registry says which inputs it
reads, and `echo-rl serve` offers every name in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learner.train.grpo import LOG_RATIO_LIMIT, clipped_surrogate, exp_ratio


@dataclass(frozen=True)
class Loss:
    """A named loss: the per-token inputs it reads besides target_tokens, the numbers its config may set
    (with their defaults), and fn(logp [N], inputs {name: [N]}, config) -> the loss, a scalar to minimise;
    `absent`: what an input is when a datum does not send it, a value at every token or one computed from the
    datum's other inputs."""

    inputs: tuple[str, ...]
    config: dict[str, float]
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]
    absent: dict[str, float | Callable[[dict[str, np.ndarray]], np.ndarray]]


LOSSES: dict[str, Loss] = {}
"""Tinker's loss_fn name -> its Loss."""

RL_INPUTS = ("logprobs", "advantages")  # log q of each target token under the sampler, and its advantage A
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker's defaults for ppo and cispo
REQUIRED = float("nan")  # a config value the client must send (Tinker's own default is not in its docs)


def loss(
    name: str, inputs: tuple[str, ...], config: dict[str, float] | None = None, absent: dict[str, Any] | None = None
) -> Callable:
    def register(fn: Callable) -> Callable:
        LOSSES[name] = Loss(inputs, dict(config or {}), fn, dict(absent or {}))
        return fn

    return register


@loss("cross_entropy", ("weights",), absent={"weights": 1.0})
def cross_entropy(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """Weighted negative log-likelihood:  L = -sum_i w_i log pi_theta(y_i), w = 1 where a datum sends none.
    Any real weights (the SDK's forward_backward_custom sends the gradient of the user's own loss with
    respect to logp as -w)."""
    return -(x["weights"] * logp).sum()


@loss("importance_sampling", RL_INPUTS)
def importance_sampling(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """REINFORCE with an importance weight to the sampler q:  L = -sum_i (pi_theta(y_i) / q(y_i)) A_i
    (the log-ratio clamped to +-LOG_RATIO_LIMIT: a lying q cannot make it overflow)."""
    return -(exp_ratio(logp - x["logprobs"]) * x["advantages"]).sum()


@loss("ppo", RL_INPUTS, CLIP)
def ppo(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """PPO's clipped objective against the sampler, r_i = pi_theta(y_i) / q(y_i):
    L = -sum_i min(r_i A_i, clip(r_i, clip_low_threshold, clip_high_threshold) A_i)."""
    ratio = exp_ratio(logp - x["logprobs"])
    kept, _ = clipped_surrogate(ratio, x["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -kept.sum()


@loss("cispo", RL_INPUTS, CLIP)
def cispo(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """CISPO: the importance weight clipped and held constant, the gradient through log pi_theta,
    L = -sum_i sg(clip(r_i, clip_low_threshold, clip_high_threshold)) A_i log pi_theta(y_i)."""
    ratio = exp_ratio(logp.detach() - x["logprobs"])
    weight = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(weight * x["advantages"] * logp).sum()


def _advantaged(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """gspo's sequence_ratio_mask where a datum sends none (the cookbook's main loop does not): the tokens with an
    advantage, i.e. the sampled ones (Tinker's own default is not documented)."""
    return (inputs["advantages"] != 0).astype(np.float32) if "advantages" in inputs else np.zeros(0, np.float32)


@loss("gspo", (*RL_INPUTS, "sequence_ratio_mask"), CLIP, absent={"sequence_ratio_mask": _advantaged})
def gspo(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """GSPO, token form: every token of a datum carries its sequence's ratio, the geometric mean of the token
    ratios over the tokens `sequence_ratio_mask` marks (M), with the gradient of its own log-probability,
        s = exp(mean_{t in M} (log pi_theta(y_t) - log q(y_t))),   s_i = sg(s) pi_theta(y_i) / sg(pi_theta(y_i)),
        L = -sum_i min(s_i A_i, clip(s_i, clip_low_threshold, clip_high_threshold) A_i)."""
    datum, marked = x["datum"], (x["sequence_ratio_mask"] != 0).float()  # [N] each
    n = int(datum.max()) + 1
    sums = torch.zeros(n, device=logp.device).index_add_(0, datum, (logp.detach() - x["logprobs"]) * marked)
    counts = torch.zeros(n, device=logp.device).index_add_(0, datum, marked).clamp(min=1.0)
    ratio = exp_ratio((sums / counts)[datum] + logp - logp.detach())  # [N]
    kept, _ = clipped_surrogate(ratio, x["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -kept.sum()


@loss("dro", RL_INPUTS, {"beta": REQUIRED})
def dro(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """DRO (Richemond et al. 2024): REINFORCE with a quadratic penalty on the log-ratio to the sampler q,
    L = -sum_i (A_i log pi_theta(y_i) - beta / 2 (log pi_theta(y_i) - log q(y_i))^2)
    (the log-ratio clamped to +-LOG_RATIO_LIMIT, as the ratio losses clamp it: a lying q gets no gradient)."""
    log_ratio = (logp - x["logprobs"]).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return -(x["advantages"] * logp - 0.5 * cfg["beta"] * log_ratio**2).sum()
