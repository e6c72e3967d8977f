"""Sampling in our own code, so that every sampled token comes with its exact behaviour logprob and is
drawn from the lease's counter-based stream (p2p.draws), which the learner can replay.

generate_waves is the one sampling loop (waves, draws, top-p, stop tokens, regrouping); an engine only
gives it next-token logits (LogitsBackend), so engines that compute the same logits draw the same tokens.
replay_wave feeds a group's tokens back through an engine in the layout generate_waves drew them in.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from p2p.draws import inverse_cdf, uniforms
from p2p.messages import Completion, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from envs.episode import Generate


def sample_next(logits: np.ndarray, temperature: float, top_p: float, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Draw one token per row of `logits` [n, V] with the uniforms `u` [n]; return (tokens [n], logprobs [n]).

    The distribution is p = softmax(logits / temperature), restricted to the smallest set of most
    likely tokens whose mass reaches top_p and renormalised. The token is p's inverse CDF at u in
    token-id order (p2p.draws); the returned logprob is log p(token) under that final distribution.
    temperature 0 is greedy decoding (evaluation): the most likely token, logprob 0 (it had probability 1).
    """
    if temperature == 0:
        return logits.argmax(axis=1).astype(np.int64), np.zeros(len(logits))
    return draw_tokens(*policy_distribution(logits, temperature, top_p), u)


def draw_tokens(probs: np.ndarray, logp: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens [n] the draws u [n] pick from policy_distribution's (probs, logp) [n, V], and their logprobs."""
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


class LogitsBackend(Protocol):
    """What the sampling loop asks an engine for: next-token logits of the sequences of one wave.

    A wave's sequences are numbered 0..n-1 in request order, request k's G completions consecutive."""

    def prefill(self, wave: Sequence[GenerationRequest], max_new_tokens: int) -> np.ndarray:
        """Read every prompt of `wave` (forgetting earlier waves), with room for `max_new_tokens` more per
        sequence; the logits [n, V] after each sequence's prompt."""
        ...

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append tokens[i] to sequence seqs[i] (the live ones, ascending); their next logits [len(seqs), V]."""
        ...

    def release(self, seq: int) -> None:
        """Sequence `seq` has stopped: what it holds may be freed."""
        ...


def generate_waves(
    backend: LogitsBackend,
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    eos_ids: Container[int],
    max_batch: int,
) -> list[list[Completion]]:
    """Complete every request `group_size` times, one list of completions per request, in order.

    Waves: consecutive requests while their sequences fit in `max_batch` (at least one request). In a wave
    every live sequence gets one token per decode call: token t of completion c of group g is p's inverse
    CDF at the lease's draw (seed, (g, c, position + t)) (p2p.draws), p = sample_next's distribution, so
    any engine that computes the same logits draws the same tokens, and the learner can replay them. A
    sequence stops at an end-of-turn token or one of params.stop_ids ("stop"; an empty stop_ids: none stops),
    when params.stop_when says so of its tokens ("stop"), or after max_new_tokens ("length")."""
    if params.stop_ids is not None:  # the request's stop tokens besides end of turn; none at all if empty
        eos_ids = set(eos_ids) | params.stop_ids if params.stop_ids else frozenset()
    out: list[list[Completion]] = []
    wave: list[GenerationRequest] = []
    for request in requests:
        if wave and sum(r.group_size for r in wave) + request.group_size > max_batch:
            out += _generate_wave(backend, wave, params, eos_ids)
            wave = []
        wave.append(request)
    return out + (_generate_wave(backend, wave, params, eos_ids) if wave else [])


def _generate_wave(
    backend: LogitsBackend, wave: Sequence[GenerationRequest], params: SamplingParams, eos_ids: Container[int]
) -> list[list[Completion]]:
    keys = [(r.group, r.completion + j, r.position) for r in wave for j in range(r.group_size)]  # per sequence
    seqs = [Completion(tokens=[], logprobs=[], finish_reason="length") for _ in keys]
    logits = backend.prefill(wave, params.max_new_tokens)  # [n, V]
    alive = list(range(len(seqs)))
    for t in range(params.max_new_tokens):
        u = uniforms(params.seed, [(g, c, position + t) for g, c, position in (keys[s] for s in alive)])
        tokens, logprobs = sample_next(logits, params.temperature, params.top_p, u)
        still = []
        for s, token, logprob in zip(alive, tokens.tolist(), logprobs.tolist(), strict=True):
            seqs[s].tokens.append(token)
            seqs[s].logprobs.append(logprob)
            if token in eos_ids or (params.stop_when is not None and params.stop_when(seqs[s].tokens)):
                seqs[s].finish_reason = "stop"
            elif t + 1 < params.max_new_tokens:
                still.append(s)
                continue
            backend.release(s)
        alive = still
        if not alive:
            break
        logits = backend.decode(alive, [seqs[s].tokens[-1] for s in alive])  # [len(alive), V]
    starts = np.cumsum([0] + [r.group_size for r in wave]).tolist()
    return [seqs[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


@dataclass
class WaveReplay:
    """One completion replayed by replay_wave, per token: the token its draw picks under the replayed logits, the
    replayed logprob of the worker's token (-inf outside the nucleus) and how far the draw lies outside that
    token's inverse-CDF interval (probability mass; 0 inside: learner.orchestrate.verify's m and o)."""

    drawn: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    misses: list[float] = field(default_factory=list)


def replay_wave(
    backend: LogitsBackend, request: GenerationRequest, completions: Sequence[Sequence[int]], params: SamplingParams
) -> list[WaveReplay]:
    """The worker's `completions` of `request` fed back, teacher-forced, in the very layout _generate_wave decodes
    one request's wave in: its prompt read once, then every live sequence one token per decode call, each
    released after its last token. On the same engine build, kernels and (quantized) file this repeats a wave
    drawn alone bit for bit, which llama.cpp's quantized decoding did in no other layout tried
    (docs/security.md). It mirrors _generate_wave step for step (tests/test_sampling.py compares their calls,
    tests/test_engines.py their bits).

    Raises ValueError for completions no honest worker sends in that layout: empty, longer than
    params.max_new_tokens, a token id outside the vocabulary, or more than `backend.max_batch` of them. Where
    each must stop (its stop tokens, its budget) is the caller's to check, as for any replay."""
    n_max = int(getattr(backend, "max_batch", len(completions)))
    if not 1 <= len(completions) <= n_max:
        raise ValueError(f"{len(completions)} completions for a wave of at most {n_max}")
    if any(not 1 <= len(tokens) <= params.max_new_tokens for tokens in completions):
        raise ValueError(f"a completion is empty or longer than max_new_tokens {params.max_new_tokens}")
    keys = [(request.group, request.completion + j, request.position) for j in range(len(completions))]
    out = [WaveReplay() for _ in completions]
    logits = backend.prefill([replace(request, group_size=len(completions))], params.max_new_tokens)  # [n, V]
    if any(not isinstance(t, int | np.integer) or not 0 <= t < logits.shape[1] for c in completions for t in c):
        raise ValueError(f"a token id lies outside the vocabulary of {logits.shape[1]}")
    alive = list(range(len(completions)))
    for t in range(params.max_new_tokens):
        u = uniforms(params.seed, [(g, c, position + t) for g, c, position in (keys[s] for s in alive)])  # [n]
        theirs = np.array([completions[s][t] for s in alive])  # [n]
        rows = np.arange(len(alive))
        if params.temperature == 0:  # greedy: the most likely token, logprob 0; any other is off by all its mass
            drawn = logits.argmax(axis=1)
            logprobs = np.where(drawn == theirs, 0.0, -np.inf)
            misses = np.where(drawn == theirs, 0.0, 1.0)
        else:
            probs, logp = policy_distribution(logits, params.temperature, params.top_p)  # [n, V] each
            drawn, _ = draw_tokens(probs, logp, u)  # (as sample_next draws)
            cdf = np.cumsum(probs, axis=1)  # [n, V]
            high = cdf[rows, theirs]  # C(t)
            low = high - probs[rows, theirs]  # C(t - 1)
            scaled = u * cdf[:, -1]  # (as inverse_cdf scales u by its row's total)
            logprobs, misses = logp[rows, theirs], np.maximum(np.maximum(low - scaled, scaled - high), 0.0)
        for i, s in enumerate(alive):
            out[s].drawn.append(int(drawn[i]))
            out[s].logprobs.append(float(logprobs[i]))
            out[s].misses.append(float(misses[i]))
        still = [s for s in alive if len(completions[s]) > t + 1]
        for s in alive:
            if s not in still:
                backend.release(s)
        alive = still
        if not alive:
            break
        logits = backend.decode(alive, [completions[s][t] for s in alive])  # [len(alive), V]
    return out


def generate_alone(
    generate: Generate, requests: Sequence[GenerationRequest], params: SamplingParams
) -> list[list[Completion]]:
    """`generate` (an engine's) once per prompt group id: the requests sharing a group id (one asample request
    split into groups of G) in a call of their own, results in request order. An engine's logits move in their
    last bits with its batch's layout (llama.cpp on SmolLM2: by ~5e-3 nats, enough to change tokens at T 1), so
    this keeps a group's tokens independent of whatever else a lease holds (`echo-rl serve --sample-seed`)."""
    by_group: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        by_group.setdefault(request.group, []).append(i)
    out: list[list[Completion]] = [[] for _ in requests]
    for indices in by_group.values():
        for i, group in zip(indices, generate([requests[i] for i in indices], params), strict=True):
            out[i] = group
    return out
