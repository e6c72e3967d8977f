"""One computation of a sample's logprobs for `echo-rl serve --sample-seed N`: every sample scored alone.

The logprobs a sample is drawn with depend, in their last bits, on the batch it shared: the local sampler's
waves hold the requests queued at that moment, a worker's replay pads its lease's group to the group's longest.
Which batch a request lands in, and whether a worker or this machine draws it, depends on timing (another
tenant's requests change both), and the last bits reach the importance-sampling loss and the adapters. So
with a sample seed every sample a request gets back, drawn here or by a worker, has its logprobs recomputed in
one pass over its own prompt and tokens alone (learner.orchestrate.replay_torch.replay_sampling on a batch of one):

    logprobs = log mu(token | prompt, tokens before it)   mu = softmax(logits / T) on the top-p nucleus

a function of the sampler's weights, the request's temperature and top_p and the sample's tokens, whatever
else ran beside it. Greedy samples keep their logprob 0. The cost: a float32 copy of each sampled base model,
one forward pass per sample (docs/tinker.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from learner.orchestrate.replay_torch import merged_weights, replay_sampling
from learner.orchestrate.rollouts import Rollout
from learner.serve.sampler import Drawn, SamplerWeights, workers_adapters
from learner.train.models import load_policy
from learner.train.wire_weights import wire_name, wire_tensors
from p2p.messages import Completion


def untied_replay(
    model: torch.nn.Module, tensors: dict[str, np.ndarray]
) -> tuple[Callable[[], torch.nn.Module], dict[str, np.ndarray]]:
    """A maker of an untied float32 copy of `model`'s architecture, and `tensors` (wire names) with the output
    layer's weight added where `model` ties it to the embedding: a LoRA adapter of the head then applies to
    the head alone, as the workers apply it."""
    replayed = dict(tensors)
    if (name := tied_embedding(model)) is not None:
        replayed["lm_head.weight"] = tensors[name]
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    return (lambda: AutoModelForCausalLM.from_config(config)), replayed


def tied_embedding(model: torch.nn.Module) -> str | None:
    """The wire name of `model`'s input embedding where its output layer is tied to it, else None."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    embedding = model.get_input_embeddings().weight
    return next(wire_name(n) for n, p in model.named_parameters() if p is embedding)


class SampleScorer:
    """Scores samples alone (module docstring), on the serve's model thread: one replay model per base model,
    holding the adapters of the sampler it scored last."""

    def __init__(self, cache_dir: str, as_workers: frozenset[str], device: str = "cpu") -> None:
        """`as_workers`: base models swarm workers sample, whose weights and adapters are rounded to 16 bits
        (as learner.serve.sampler.LocalSampler holds them)."""
        self.cache_dir, self.as_workers, self.device = cache_dir, as_workers, torch.device(device)
        self.bases: dict[str, tuple[torch.nn.Module, dict[str, np.ndarray], str | None]] = {}  # base -> (model,
        # its tensors, the embedding's name where the output layer is tied to it)
        self.current: dict[str, SamplerWeights] = {}  # base model -> the sampler its model holds now

    def score(
        self, weights: SamplerWeights, prompt: list[int], drawn: Drawn, temperature: float, top_p: float
    ) -> Drawn:
        """`drawn` with each sample's logprobs recomputed alone under `weights`."""
        if temperature <= 0.0 or not drawn.samples:
            return drawn
        model = self._load(weights)
        samples = []
        with torch.no_grad():
            for sample in drawn.samples:
                if not sample.tokens:
                    samples.append(sample)
                    continue
                rows, _ = replay_sampling(model, [Rollout(prompt, list(sample.tokens), [], 0.0)], temperature, top_p)
                strict, wider = rows[0], rows[-1]  # [N] each: the nucleus, and one token wider (verify.py)
                logprobs = torch.where(torch.isfinite(strict), strict, wider)
                # a token outside even the wider nucleus cannot come from the sampler: it keeps its own value
                own = torch.tensor(sample.logprobs, dtype=torch.float64)  # [N]
                logprobs = torch.where(torch.isfinite(logprobs), logprobs, own)
                samples.append(Completion(sample.tokens, logprobs.tolist(), sample.finish_reason))
        return Drawn(samples, drawn.prompt_logprobs)

    def _load(self, weights: SamplerWeights) -> torch.nn.Module:
        sixteen = weights.base_model in self.as_workers
        if weights.base_model not in self.bases:
            policy = load_policy(weights.base_model, self.cache_dir)
            make_model, tensors = untied_replay(policy.model, wire_tensors(policy.model, "f16" if sixteen else "f32"))
            model = make_model().float().to(self.device).eval().requires_grad_(False)
            self.bases[weights.base_model] = (model, tensors, tied_embedding(policy.model))
        model, tensors, tied = self.bases[weights.base_model]
        if self.current.get(weights.base_model) is weights:
            return model
        if weights.full:  # every weight, float32 as the local sampler draws them (workers never do)
            state = dict(weights.adapters) | ({"lm_head.weight": weights.adapters[tied]} if tied else {})
            state = merged_weights(state, None, 0.0)
        else:
            adapters = weights.adapters
            if sixteen:  # (unless beyond f16's range: such a sampler is drawn here alone, in float32)
                adapters = workers_adapters(adapters) or adapters
            state = merged_weights(tensors, adapters, 1.0)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or missing:
            raise RuntimeError(f"the scorer's weights do not fit the model: {unexpected[:3]} {missing[:3]}")
        self.current[weights.base_model] = weights
        return model
