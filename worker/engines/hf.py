"""The transformers engine: the reference sampler, same interface as the llama.cpp engine.

Slower, but it runs the exact float weights with torch, so it is the ground truth to compare
llama.cpp against. It needs torch and transformers (the one worker path that does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from p2p.draws import uniforms
from p2p.messages import Completion, GenerationRequest, ModelSpec, SamplingParams, is_adapter
from p2p.weights import lora_deltas, to_float32
from worker.sampling import sample_next


def llama_config(spec: ModelSpec) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=spec.bos_id,
        eos_token_id=spec.eos_ids[0],
    )


class TransformersEngine:
    """Generates a prompt's G completions as one batch of G identical prompts, with a KV cache."""

    def __init__(self, threads: int = 2) -> None:
        self.threads = threads
        self.model: LlamaForCausalLM | None = None
        self.eos_ids: set[int] = set()
        self.base: dict[str, torch.Tensor] = {}  # the weights as loaded, before LoRA adapters

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """Load float weights; LoRA adapters among them (a LoRA run's full snapshot) are merged in."""
        if self.model is None or self.model.config.to_dict() != llama_config(spec).to_dict():
            self.model = LlamaForCausalLM(llama_config(spec)).eval()
        base = {name: torch.from_numpy(to_float32(a)) for name, a in tensors.items() if not is_adapter(name)}
        self.model.load_state_dict(base, strict=False)
        self.base = base if spec.lora_rank else {}  # kept only where adapters will be merged onto it
        if spec.tie_embeddings:
            self.model.tie_weights()
        self.eos_ids = set(spec.eos_ids)
        adapters = {name: a for name, a in tensors.items() if is_adapter(name)}
        if adapters:
            self.load_adapters(spec, adapters)

    @torch.no_grad()
    def load_adapters(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """Merge LoRA adapters into the loaded base: W = W_base + (alpha / r) * B A."""
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        params = dict(self.model.named_parameters())
        for name, delta in lora_deltas(tensors, spec.lora_alpha / spec.lora_rank):
            params[name].copy_(self.base[name] + torch.from_numpy(delta))

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        torch.set_num_threads(self.threads)
        return [self._generate_group(r, params) for r in requests]

    def _generate_group(self, request: GenerationRequest, params: SamplingParams) -> list[Completion]:
        g = request.group_size
        ids = torch.tensor([request.prompt_ids] * g)  # [G, T]
        cache = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        seqs = [Completion(tokens=[], logprobs=[], finish_reason="length") for _ in range(g)]
        alive = np.ones(g, dtype=bool)
        for position in range(params.max_new_tokens):
            logits = out.logits[:, -1, :].float().numpy()  # [G, V]
            u = uniforms(params.seed, [(request.group, j, position) for j in range(g)])  # p2p.draws
            tokens, logprobs = sample_next(logits, params.temperature, params.top_p, u)
            for i in np.nonzero(alive)[0]:
                seqs[i].tokens.append(int(tokens[i]))
                seqs[i].logprobs.append(float(logprobs[i]))
                if int(tokens[i]) in self.eos_ids:
                    seqs[i].finish_reason = "stop"
                    alive[i] = False
            if not alive.any():
                break
            # finished rows keep decoding a dummy token; their output is ignored
            out = self.model(input_ids=torch.from_numpy(tokens)[:, None], past_key_values=cache, use_cache=True)
        return seqs
