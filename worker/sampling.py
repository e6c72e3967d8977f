"""Sampling in our own code, so that every sampled token comes with its exact behaviour logprob."""

from __future__ import annotations

import numpy as np


def sample_next(
    logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draw one token per row of `logits` [n, V]; return (tokens [n], logprobs [n]).

    The distribution is p = softmax(logits / temperature), restricted to the smallest set of most
    likely tokens whose mass reaches top_p and renormalised. The returned logprob is log p(token)
    under that final distribution.
    """
    z = logits.astype(np.float64, copy=False) / temperature  # [n, V]
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))  # [n, V] log-softmax
    probs = np.exp(logp)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=1)  # [n, V] most likely first
        sorted_p = np.take_along_axis(probs, order, axis=1)
        # keep a token if the mass before it is still below top_p (so the first token always stays)
        keep_sorted = (np.cumsum(sorted_p, axis=1) - sorted_p) < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        probs = np.where(keep, probs, 0.0)
        kept_mass = probs.sum(axis=1, keepdims=True)
        probs = probs / kept_mass
        logp = np.where(keep, logp - np.log(kept_mass), -np.inf)
    cdf = np.cumsum(probs, axis=1)  # [n, V]
    u = rng.random(len(cdf)) * cdf[:, -1]
    tokens = (cdf < u[:, None]).sum(axis=1)
    tokens = np.minimum(tokens, logits.shape[1] - 1)
    # a token of probability 0 can never be drawn: step back onto the last kept one if rounding put us there
    chosen = logp[np.arange(len(tokens)), tokens]
    for i in np.nonzero(~np.isfinite(chosen))[0]:
        tokens[i] = int(np.nonzero(probs[i] > 0)[0][-1])
        chosen[i] = logp[i, tokens[i]]
    return tokens.astype(np.int64), chosen.astype(np.float64)
