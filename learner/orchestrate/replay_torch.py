"""The torch replays behind verification (learner.orchestrate.verify, whose docstring gives the measures): a
version's weights as float32 torch tensors, and for every completion token its recomputed logprob and draw
miss (sampled groups) or its greedy gap (held-out evaluation)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from learner.orchestrate.rollouts import Rollout
from learner.train.trainer import head_logits, model_device, nucleus_masks, pack_completions
from p2p.messages import is_adapter
from p2p.weights import lora_deltas, to_float32


def merged_weights(
    base: Mapping[str, np.ndarray], adapters: Mapping[str, np.ndarray] | None, scale: float
) -> dict[str, torch.Tensor]:
    """Full float32 weights under HF names; LoRA adapters merged: W + scale * B A (p2p.weights)."""
    weights = {name: torch.from_numpy(to_float32(a)) for name, a in base.items() if not is_adapter(name)}
    for name, delta in lora_deltas(adapters or {}, scale):
        weights[name] = weights[name] + torch.from_numpy(delta)
    return weights


ROWS_PER_BLOCK = 256  # completion positions whose [rows, V] distributions are held at once (float64)


def replay_sampling(
    model: torch.nn.Module, batch: list[Rollout], temperature: float, top_p: float, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every completion token of `batch`: log mu(token) and, given its draw u [N], the distance of u
    from the token's inverse-CDF interval. Returns (logprobs [K, N], misses [K, N]; misses are 0 when u
    is None), K = 1 (top_p = 1) or 2 (top_p < 1: row 0 the strict nucleus, row 1 one token wider).

    mu = softmax(logits / T) restricted to the top-p nucleus and renormalised, as worker.sampling draws
    it (-inf outside), in float64.
    """
    ids, mask, rows_t, cols_t = pack_completions(batch, model_device(model))  # [B, T], [B, T], [N], [N]
    # the output layer only at completion positions (as learner.train.trainer.completion_logprobs)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][rows_t, cols_t]  # [N, H]
    targets = ids[rows_t, cols_t + 1]  # [N]
    logprobs, misses = [], []
    for start in range(0, len(targets), ROWS_PER_BLOCK):  # bounded memory for long completions
        block = slice(start, start + ROWS_PER_BLOCK)
        logp = torch.log_softmax(head_logits(model, hidden[block]).double() / temperature, dim=-1)  # [n, V]
        nuclei = [None] if top_p >= 1.0 else list(nucleus_masks(logp, top_p))
        t = targets[block][:, None]  # [n, 1]
        lp_rows, miss_rows = [], []
        for keep in nuclei:
            lp = logp if keep is None else logp.masked_fill(~keep, -torch.inf)
            lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)  # [n, V] renormalised over the nucleus
            lp_rows.append(lp.gather(1, t)[:, 0])
            if u is None:
                miss_rows.append(torch.zeros(len(t), dtype=torch.float64, device=ids.device))
                continue
            probs = lp.exp()
            high = probs.cumsum(-1).gather(1, t)[:, 0]  # C(t)
            low = high - probs.gather(1, t)[:, 0]  # C(t - 1)
            ub = u[block].to(ids.device, torch.float64) * probs.sum(-1)  # the sampler scales u by its row's total
            miss_rows.append(torch.clamp(torch.maximum(low - ub, ub - high), min=0.0))
        logprobs.append(torch.stack(lp_rows))
        misses.append(torch.stack(miss_rows))
    return torch.cat(logprobs, dim=1).cpu(), torch.cat(misses, dim=1).cpu()  # [K, N] each


def greedy_gaps(model: torch.nn.Module, batch: list[Rollout]) -> torch.Tensor:
    """For every completion token of `batch`: how far its logit lies below the most likely token's: [N]."""
    ids, mask, rows_t, cols_t = pack_completions(batch, model_device(model))  # [B, T], [B, T], [N], [N]
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][rows_t, cols_t]  # [N, H]
    targets = ids[rows_t, cols_t + 1]  # [N]
    gaps = []
    for start in range(0, len(targets), ROWS_PER_BLOCK):
        block = slice(start, start + ROWS_PER_BLOCK)
        logits = head_logits(model, hidden[block]).double()  # [n, V]
        gaps.append(logits.max(dim=-1).values - logits.gather(1, targets[block][:, None])[:, 0])
    return torch.cat(gaps).cpu()  # [N]
