"""Sampling for `echo-rl serve`: weights saved for sampling, and the samples `asample` draws from them.

    save_weights_for_sampler  ->  SamplerWeights: a copy of the training client's LoRA adapters
    asample                   ->  LocalSampler.sample, on the model thread: one engine per base model holds
                                  the base weights once and takes each sampler's adapters in turn

The engine is a worker's (injected by echo_cli: learner code never imports worker), so tokens are drawn as a
worker draws them (worker.sampling.generate_waves): a sample's logprobs are those of the distribution it was
drawn from, temperature and top_p applied (temperature 0: greedy, logprob 0), each request's draws keyed by its
draw id (learner.serve.draw_ids) whatever batch it is drawn in. Stop token ids end a sample in
the engine, as the model's end-of-turn tokens do; a stop string ends it once the text of its last tokens holds
one, and the sample is cut after the token that completed it. Prompt logprobs are the model's own
(temperature 1), from one pass over the prompt. What one request may cost is bounded (MAX_REQUEST_TOKENS):
each runs whole on the model thread, the keys taking turns between requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tinker import types

from learner.serve.draw_ids import DRAW_SEED
from learner.serve.wire import RequestError
from learner.train.models import load_policy, model_spec
from learner.train.wire_weights import wire_tensors
from p2p.messages import Completion, Engine, GenerationRequest, ModelSpec, SamplingParams, subnormal
from p2p.weights import to_float32

MAX_SAMPLES = 256  # num_samples of one request
MAX_NEW_TOKENS = 8192  # max_tokens of one request
MAX_REQUEST_TOKENS = 1 << 16  # num_samples x (prompt + max_tokens) of one request: its KV cache and its time
MAX_PROMPT_LOGITS = 1 << 27  # prompt tokens x vocabulary scored for prompt logprobs (512 MiB of float32 logits)


@dataclass(frozen=True)
class SamplerWeights:
    """What a sampler samples: a base model, with a training client's adapters as they were when saved."""

    base_model: str
    rank: int  # the adapters' rank (their scale is 1: alpha = rank, as learner.serve.trained_model makes them)
    adapters: dict[str, np.ndarray]  # wire names -> float32; {} is the base model itself
    full: bool = False  # `adapters` holds every weight (a full fine-tuning client's), not LoRA adapters


@dataclass
class Loaded:
    """A base model in its engine, and the weights whose adapters the engine holds now."""

    engine: Engine
    spec: ModelSpec
    tokenizer: Any
    vocab: int
    context: int
    current: SamplerWeights | None = None
    base: dict[str, np.ndarray] | None = None  # the base's weights, loaded again after a full sampler (once one came)


@dataclass
class Drawn:
    """What one asample request gives back: its samples (in order) and, if asked, the prompt's logprobs."""

    samples: list[Completion]
    prompt_logprobs: list[float] | None  # NaN where not scored (the first token, or before the last n)


class LocalSampler:
    """Samples on this machine with engines from `make_engine` (worker.engines), one per base model."""

    def __init__(self, make_engine: Callable[[], Engine], cache_dir: str, as_workers: frozenset[str] = frozenset()):
        """`as_workers`: base models swarm workers sample too (learner.serve.swarm): their weights and adapters
        are rounded to the 16 bits the workers hold, so that a request draws from the same weights here."""
        self.make_engine, self.cache_dir, self.as_workers = make_engine, cache_dir, as_workers
        self.loaded: dict[str, Loaded] = {}

    def sample(self, weights: SamplerWeights, req: types.SampleRequest, draw: int = 0) -> Drawn:
        """Draw `req.num_samples` completions of `req.prompt` from `weights` with draw id `draw` (on the model
        thread)."""
        drawn = self.sample_batch(weights, [req], [draw])[0]
        if isinstance(drawn, RequestError):
            raise drawn
        return drawn

    def sample_batch(
        self, weights: SamplerWeights, reqs: list[types.SampleRequest], draws: list[int]
    ) -> list[Drawn | RequestError]:
        """Draw several requests at once, in the engine's waves (each request its own draws: group = its draw id
        in `draws`): requests batchable() says go together, with the first one's sampling params; a request
        refused is its RequestError in the list, the others are drawn."""
        loaded = self._load(weights)
        out: list[Drawn | RequestError] = []
        todo: list[tuple[int, list[int]]] = []  # (index, prompt)
        for i, req in enumerate(reqs):
            prompt = req.prompt.to_ints()
            try:
                check_prompt_logprobs(req, loaded.vocab)
                params, stop_strings = request_params(req, prompt, loaded.context, loaded.vocab, loaded.tokenizer)
            except RequestError as exc:
                out.append(exc)
                continue
            out.append(Drawn([], None))
            todo.append((i, prompt))
            if len(todo) == 1:
                first = (params, stop_strings)
        if not todo:
            return out
        params, stop_strings = first
        batch = int(getattr(loaded.engine, "max_batch", 1))
        requests, owner = [], []
        for i, prompt in todo:
            n = reqs[i].num_samples
            for start in range(0, n, batch):
                requests.append(GenerationRequest(prompt, min(batch, n - start), group=draws[i], completion=start))
                owner.append(i)
        for i, group in zip(owner, loaded.engine.generate(requests, params), strict=True):
            samples = [cut_at_stop(c, stop_strings, loaded.tokenizer) for c in group] if stop_strings else group
            out[i].samples += samples
        for i, prompt in todo:
            if reqs[i].prompt_logprobs:
                out[i].prompt_logprobs = self._prompt_logprobs(loaded, prompt, reqs[i])
        return out

    def _load(self, weights: SamplerWeights) -> Loaded:
        loaded = self.loaded.get(weights.base_model)
        if loaded is None:
            policy = load_policy(weights.base_model, self.cache_dir)
            spec = replace(model_spec(policy), lora_rank=1, lora_alpha=1.0)  # a rank: the engine keeps its base
            engine = self.make_engine()
            engine.load_policy(spec, self._base(policy.model, weights.base_model))
            cfg = policy.model.config
            context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
            loaded = Loaded(engine, spec, policy.tokenizer, int(cfg.vocab_size), context)
            self.loaded[weights.base_model] = loaded
        if loaded.current is not weights and weights.full:  # every weight: they take the base's place
            if loaded.base is None:  # (kept from the first full sampler on, to put the base back after one)
                loaded.base = self._base(load_policy(weights.base_model, self.cache_dir).model, weights.base_model)
            loaded.engine.load_policy(loaded.spec, weights.adapters)
            loaded.current = weights
        elif loaded.current is not weights:
            if loaded.current is not None and loaded.current.full:
                loaded.engine.load_policy(loaded.spec, loaded.base)  # the base back
            rank = max(weights.rank, 1)
            adapters = weights.adapters
            if weights.base_model in self.as_workers:  # (unless beyond f16's range: those are never published)
                rounded = workers_adapters(adapters)
                if rounded is not None:
                    adapters = {name: a.astype(np.float32) for name, a in rounded.items()}
            loaded.engine.load_adapters(replace(loaded.spec, lora_rank=rank, lora_alpha=float(rank)), adapters)
            loaded.current = weights
        return loaded

    def _base(self, model: Any, base_model: str) -> dict[str, np.ndarray]:
        """A base model's weights as the engine takes them: float32, rounded to f16 first where workers sample it."""
        tensors = wire_tensors(model, "f16" if base_model in self.as_workers else "f32")
        return {name: to_float32(a) for name, a in tensors.items()}

    @staticmethod
    def _prompt_logprobs(loaded: Loaded, prompt: list[int], req: types.SampleRequest) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 (NaN at 0, and before the last `prompt_logprobs_last_n`)."""
        logits = loaded.engine.logits(prompt)  # [P, V]; position i predicts token i + 1
        out = [math.nan]
        for start in range(0, len(prompt) - 1, 64):  # 64 rows at a time in float64 (a copy of all would be 2x)
            z = logits[start : min(start + 64, len(prompt) - 1)].astype(np.float64)  # [n, V]
            z -= z.max(axis=1, keepdims=True)
            targets = prompt[start + 1 : start + 1 + len(z)]
            out += (z[np.arange(len(z)), targets] - np.log(np.exp(z).sum(axis=1))).tolist()
        n = req.prompt_logprobs_last_n
        return out if n is None else [math.nan] * (len(out) - n) + out[len(out) - n :]


def workers_adapters(adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """`adapters` in f16, as swarm workers hold them (learner.serve.swarm publishes them so), or None where one
    exceeds f16's range (such a sampler is drawn here alone, in float32)."""
    rounded = {name: a.astype(np.float16) for name, a in adapters.items()}
    return rounded if all(np.isfinite(a).all() for a in rounded.values()) else None


def request_params(
    req: types.SampleRequest, prompt: list[int], context: int, vocab: int, tokenizer: Any
) -> tuple[SamplingParams, list[str]]:
    """What the engine draws `req` with, and its stop strings (cut_at_stop), checked against a model whose
    context and vocabulary are `context` and `vocab` tokens."""
    p = req.sampling_params
    if any(not 0 <= t < vocab for t in prompt):
        raise RequestError(f"asample: the prompt holds a token outside the vocabulary (0 to {vocab - 1})")
    room = context - len(prompt)
    most = min(MAX_NEW_TOKENS, room, MAX_REQUEST_TOKENS // req.num_samples - len(prompt))
    max_tokens = most if p.max_tokens is None else p.max_tokens
    if not 1 <= max_tokens <= most:
        raise RequestError(f"asample: max_tokens {max_tokens} must be 1 to {most} (the model's context "
                           f"is {context} tokens, the prompt {len(prompt)})")  # fmt: skip
    stop, stop_ids, stop_strings = p.stop, None, []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif stop is not None and all(isinstance(s, str) for s in stop):
        stop_strings = list(stop)  # (an empty list lands in the next case: no stop at all, not even EOS)
    if stop is not None and all(isinstance(s, int) for s in stop) and not isinstance(stop, str):
        if any(not 0 <= s < vocab for s in stop):
            raise RequestError(f"asample: a stop token is outside the vocabulary (0 to {vocab - 1})")
        stop_ids = frozenset(stop)
    if any(not s for s in stop_strings):
        raise RequestError("asample: an empty stop string")
    stop_when = stop_text_check(stop_strings, tokenizer) if stop_strings else None
    return SamplingParams(p.temperature, p.top_p, max_tokens, DRAW_SEED, stop_ids, stop_when), stop_strings


def check_request(req: types.SampleRequest) -> None:
    """What `asample` refuses before queueing: what echo-rl does not compute, and values out of range."""
    p = req.sampling_params
    if req.topk_prompt_logprobs or req.topk_sample_logprobs or req.prompt_alt_tokens_k:
        raise RequestError("asample: top-k logprobs and prompt alt tokens are not served by echo-rl; send 0")
    if req.target_prompt_logprobs is not None or req.record_stability_info:
        raise RequestError("asample: target_prompt_logprobs and record_stability_info are not served by echo-rl "
                           "(use loss_fn=importance_sampling, ppo or cispo instead of stable_reinforce)")  # fmt: skip
    if any(c.type != "encoded_text" for c in req.prompt.chunks):
        raise RequestError("asample: only text prompts (encoded_text chunks) are sampled")
    n_prompt = req.prompt.length
    if not 1 <= n_prompt <= 1 << 20:
        raise RequestError(f"asample: the prompt has {n_prompt} tokens; send 1 or more")
    if not 1 <= req.num_samples <= MAX_SAMPLES:
        raise RequestError(f"asample: num_samples {req.num_samples} must be 1 to {MAX_SAMPLES}")
    # (from the bits first: under the learner's flush-to-zero a subnormal temperature compares equal to 0)
    temperature_ok = not subnormal(p.temperature) and (
        p.temperature == 0 or (math.isfinite(p.temperature) and 1e-6 <= p.temperature <= 100))  # fmt: skip
    if not (temperature_ok and math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise RequestError(f"asample: temperature must be 0 (greedy) or 1e-6 to 100, top_p in (0, 1]; got "
                           f"{p.temperature}, {p.top_p}")  # fmt: skip
    if p.max_tokens is not None and not 1 <= p.max_tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"asample: max_tokens {p.max_tokens} must be 1 to {MAX_NEW_TOKENS}")
    if request_tokens(req) > MAX_REQUEST_TOKENS:
        raise RequestError(f"asample: num_samples x (prompt + max_tokens) must stay within {MAX_REQUEST_TOKENS} "
                           "tokens; send fewer samples per request")  # fmt: skip
    if not all(0 <= t < 1 << 31 for c in req.prompt.chunks for t in c.tokens):  # (each model's vocabulary later)
        raise RequestError("asample: a prompt token id is outside 0 to 2**31 - 1")
    if p.top_k not in (-1, 0):
        raise RequestError(f"asample: top_k {p.top_k}: echo-rl samples with top_p only; send top_k=-1")
    if p.seed is not None and not 0 <= p.seed < 1 << 63:
        raise RequestError(f"asample: seed {p.seed} must be 0 to 2**63 - 1")
    if isinstance(p.stop, list) and len(p.stop) > 64:
        raise RequestError(f"asample: {len(p.stop)} stop sequences; send at most 64")
    if isinstance(p.stop, list) and sum(len(s) for s in p.stop if isinstance(s, str)) > 4096:
        raise RequestError("asample: the stop strings are too long (4096 characters in all)")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not (req.prompt_logprobs and 1 <= last_n <= n_prompt - 1):
        raise RequestError(f"asample: prompt_logprobs_last_n {last_n} needs prompt_logprobs and 1 to len(prompt) - 1")


def batchable(first: types.SampleRequest, other: types.SampleRequest, tokens: int) -> bool:
    """Whether `other` may be drawn in `first`'s batch (`tokens`: what the batch costs so far): the same
    sampling params with max_tokens set and no seed (a seeded request is drawn alone, so that it repeats bit for
    bit), no prompt logprobs, within MAX_REQUEST_TOKENS."""
    p = first.sampling_params
    if p.seed is not None or p.max_tokens is None or first.prompt_logprobs or other.prompt_logprobs:
        return False
    return other.sampling_params == p and tokens + request_tokens(other) <= MAX_REQUEST_TOKENS


def request_tokens(req: types.SampleRequest) -> int:
    """What a request costs: num_samples x (prompt + max_tokens)."""
    return req.num_samples * (req.prompt.length + (req.sampling_params.max_tokens or 1))


def check_prompt_logprobs(req: types.SampleRequest, vocab: int) -> None:
    """Prompt logprobs score every prompt position against the whole vocabulary: bound that work."""
    if req.prompt_logprobs and req.prompt.length * vocab > MAX_PROMPT_LOGITS:
        raise RequestError(f"asample: prompt logprobs of {req.prompt.length} tokens: at most "
                           f"{MAX_PROMPT_LOGITS // vocab} with this model's vocabulary of {vocab}")  # fmt: skip


def stop_text_check(stops: list[str], tokenizer: Any) -> Callable[[list[int]], bool]:
    """Whether a completion's text has just completed a stop string: its last tokens are decoded each step (as
    many as the longest stop string has characters, and a few more: a token is at least one character, or
    part of one), so the engine stops drawing there; cut_at_stop then cuts exactly."""
    window = max(len(s) for s in stops) + 4

    def stopped(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens[-window:])
        return any(s in text for s in stops)

    return stopped


def cut_at_stop(sample: Completion, stops: list[str], tokenizer: Any) -> Completion:
    """`sample` cut after its first token whose text completes a stop string (finish "stop"), or as it was.

    The shortest prefix whose decoded text holds a stop string, found by bisection: whether a prefix holds
    one only grows with its length."""
    def holds(n: int) -> bool:
        text = tokenizer.decode(sample.tokens[:n])
        return any(s in text for s in stops)

    if not sample.tokens or not holds(len(sample.tokens)):
        return sample
    low, high = 1, len(sample.tokens)  # holds(high) is true
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return Completion(sample.tokens[:high], sample.logprobs[:high], "stop")
