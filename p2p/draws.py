"""Sampling proofs: every random draw of a completion comes from a counter-based stream.

A worker does not choose its randomness. The uniform behind token `position` of completion `completion`
of prompt group `group` in a lease seeded `seed` is

    u(seed, group, completion, position) = (int(BLAKE2b-64(seed, group, completion, position)) >> 11 + 1/2) / 2^53

(the four numbers packed little-endian as u64, u64, u32, u32), a value in (0, 1) that depends on nothing
else: not on batching, waves, threads or the engine. The token is then drawn by inverse CDF in token-id
order: with p the sampling distribution (softmax(logits / T), nucleus-restricted and renormalised),

    token = the t with C(t - 1) < u <= C(t),   C(t) = sum_{v <= t} p(v).

So given the lease's seed and the claimed policy version, a completion is determined: the learner
replays each token's u and checks that it falls inside the token's CDF interval [C(t - 1), C(t)]
(learner.orchestrate.verify), up to float noise between the worker's engine and the learner's. A worker that
submits text it did not sample this way (its own text, another seed, unsampled tokens with exact
logprobs) lands outside the intervals.

BLAKE2b is used as a keyed pseudo-random function (a counter-based generator in the sense of Salmon
et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"); hashlib has it everywhere, numpy-free.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

_KEY = struct.Struct("<QQII")
_MASK64 = (1 << 64) - 1


def uniform(seed: int, group: int, completion: int, position: int) -> float:
    """The draw for one token, in (0, 1) (never exactly 0 or 1)."""
    key = _KEY.pack(seed & _MASK64, group & _MASK64, completion & 0xFFFFFFFF, position & 0xFFFFFFFF)
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11  # 53 bits
    return (bits + 0.5) / 2**53


def uniforms(seed: int, keys: list[tuple[int, int, int]]) -> np.ndarray:
    """Draws for (group, completion, position) keys: [n] float64."""
    return np.array([uniform(seed, g, c, p) for g, c, p in keys], dtype=np.float64)


def inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Tokens [n] drawn from the rows of `probs` [n, V] (each summing to about 1) by their uniforms u [n]:
    the first token whose cumulative mass in token-id order reaches u times the row's total."""
    cdf = np.cumsum(probs, axis=1)  # [n, V]
    tokens = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.minimum(tokens, probs.shape[1] - 1)
