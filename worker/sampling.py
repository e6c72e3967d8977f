"""Sampling in our own code, so that every sampled token comes with its exact behaviour logprob and is
drawn from the lease's counter-based stream (p2p.draws), which the learner can replay."""

from __future__ import annotations

import numpy as np

from p2p.draws import inverse_cdf


def sample_next(logits: np.ndarray, temperature: float, top_p: float, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Draw one token per row of `logits` [n, V] with the uniforms `u` [n]; return (tokens [n], logprobs [n]).

    The distribution is p = softmax(logits / temperature), restricted to the smallest set of most
    likely tokens whose mass reaches top_p and renormalised. The token is p's inverse CDF at u in
    token-id order (p2p.draws); the returned logprob is log p(token) under that final distribution.
    temperature 0 is greedy decoding (evaluation): the most likely token, logprob 0 (it had probability 1).
    """
    if temperature == 0:
        return logits.argmax(axis=1).astype(np.int64), np.zeros(len(logits))
    probs, logp = policy_distribution(logits, temperature, top_p)
    tokens = inverse_cdf(probs, u)
    # a token of probability 0 can never be drawn: step back onto the last kept one if rounding put us there
    chosen = logp[np.arange(len(tokens)), tokens]
    for i in np.nonzero(~np.isfinite(chosen))[0]:
        tokens[i] = int(np.nonzero(probs[i] > 0)[0][-1])
        chosen[i] = logp[i, tokens[i]]
    return tokens.astype(np.int64), chosen.astype(np.float64)


def policy_distribution(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The distribution sample_next draws from, for rows of `logits` [n, V]: (probs [n, V], logprobs [n, V];
    -inf outside the nucleus), in float64."""
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
    return probs, logp
