"""The transformers engine: the reference sampler, same interface as the llama.cpp engine.

Slower, but it runs the exact float weights with torch, so it is the ground truth to compare
llama.cpp against. It needs torch and transformers (the one worker path that does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel

from p2p.config import ConfigError
from p2p.messages import Completion, GenerationRequest, ModelSpec, SamplingParams, is_adapter
from p2p.weights import lora_deltas, to_float32
from worker.sampling import generate_waves


def model_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config `spec` describes: its config.json (any family), or the llama fields of a spec
    from a learner that sends none."""
    config = dict(spec.config())  # a copy: the parsed config is shared
    if config:
        config.pop("transformers_version", None)
        return AutoConfig.for_model(config.pop("model_type"), **config)
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


@dataclass
class StagedWeights:
    """A version's tensors on the engine's device, waiting for install()."""

    spec: ModelSpec
    params: dict[str, torch.Tensor]  # parameter name -> its new value
    base: dict[str, torch.Tensor]  # a LoRA run's base weights, kept to merge later adapters onto
    new_base: bool  # whether these are new base weights (else adapters merged on the loaded base)
    merged: set[str]  # the weights holding an adapter's delta once installed


class TransformersEngine:
    """Generates groups of completions with torch on the CPU or a GPU, many prompts per forward pass.

    Waves, as the llama.cpp engine: floor(max_batch / G) prompt groups at once (at least one), every
    prompt repeated G times, left-padded to the wave's longest prompt (masked, positions counted from
    each prompt's first token), one KV cache. The engine gives next-token logits to
    worker.sampling.generate_waves, which draws each token from the lease's draws with its behaviour logprob.
    """

    def __init__(self, threads: int = 2, max_batch: int = 32, device: str = "auto") -> None:
        self.threads = threads
        self.max_batch = max_batch
        self.device = engine_device(device)
        self.model: PreTrainedModel | None = None
        self.hf_config: str | None = None  # the spec the model was built from
        self.eos_ids: set[int] = set()
        self.base: dict[str, torch.Tensor] = {}  # the weights as loaded, before LoRA adapters
        self.merged: set[str] = set()  # the weights an adapter's delta is merged into
        self.tied: tuple[str, str] | None = None  # a tied model's (output, input) embedding weight names
        # the wave being generated (prefill, decode): attention mask [R, P + t], KV cache, next positions [R, 1]
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._cache = DynamicCache()
        self._next_position = torch.zeros(0, 1, dtype=torch.long)

    # Staging (the worker's fetcher thread) converts weights to tensors on the device while generate() runs;
    # install() copies them into the model between leases.

    @torch.no_grad()
    def stage(
        self, spec: ModelSpec, weights: Mapping[str, np.ndarray] | None, adapters: Mapping[str, np.ndarray] | None
    ) -> StagedWeights:
        """Tensors for every parameter that changes: `weights` (None: keep the loaded base) with LoRA
        `adapters` merged on top, W = W_base + (alpha / r) * B A. Adapters replace the loaded ones: a weight
        they leave alone that the last ones changed goes back to its base value (several tenants' adapters
        take turns on one base, as `echo-rl serve` does)."""
        base = self.base
        if weights is not None:
            base = {name: torch.from_numpy(to_float32(a)).to(self.device) for name, a in weights.items()}
        elif self.model is None:
            raise RuntimeError("no policy loaded: stage weights before adapters")
        params = dict(base) if weights is not None else {}
        merged: set[str] = set()
        if adapters is not None:
            merged = {n.removesuffix(".lora_A.weight") + ".weight" for n in adapters if n.endswith(".lora_A.weight")}
            if weights is None:
                params.update({name: self._base_of(base, name) for name in self.merged - merged})
            for name, delta in lora_deltas(adapters, spec.lora_alpha / spec.lora_rank) if adapters else ():
                params[name] = self._base_of(base, name) + torch.from_numpy(delta).to(self.device)  # one at a time
        return StagedWeights(spec, params, base if spec.lora_rank else {}, weights is not None, merged)

    def _base_of(self, base: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """Weight `name` as loaded; a tied output layer's is the input embedding's (wire weights hold it once)."""
        if name not in base and self.tied is not None and name == self.tied[0]:
            name = self.tied[1]
        if name not in base:
            raise RuntimeError(f"an adapter for {name}, which the loaded model does not have")
        return base[name]

    @torch.no_grad()
    def install(self, staged: StagedWeights) -> None:
        spec = staged.spec
        if self.model is None or self.hf_config != spec.hf_config:
            if not staged.new_base:
                raise RuntimeError("adapters for another model than the loaded one: stage its weights first")
            model = AutoModelForCausalLM.from_config(model_config(spec), dtype=torch.float32)
            self.model, self.hf_config = model.to(self.device).eval(), spec.hf_config
        model = self.model
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
        if staged.new_base and spec.tie_embeddings:
            outputs.weight = inputs.weight  # tied again, should an output adapter have untied them
            names = {id(m): n for n, m in model.named_modules()}
            self.tied = (f"{names[id(outputs)]}.weight", f"{names[id(inputs)]}.weight")
        elif staged.new_base:
            self.tied = None
        if self.tied is not None and self.tied[0] in staged.params and outputs.weight is inputs.weight:
            # an adapter on the output layer changes it alone (as the trainer's peft adapter does): untie
            outputs.weight = torch.nn.Parameter(inputs.weight.detach().clone(), requires_grad=False)
        missing, unexpected = model.load_state_dict(staged.params, strict=False)
        if staged.new_base and spec.tie_embeddings:
            missing = [n for n in missing if n != self.tied[0]]
        if unexpected or (staged.new_base and missing):
            raise RuntimeError(f"the weights do not fit the {spec.model_type} model: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")  # fmt: skip
        if staged.new_base:
            self.base = staged.base  # kept only where adapters will be merged onto it
        self.merged = staged.merged
        self.eos_ids = set(spec.eos_ids)

    def discard(self, staged: StagedWeights) -> None:
        """Nothing to free by hand: the staged tensors go with their last reference."""

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """Load float weights; LoRA adapters among them (a LoRA run's full snapshot) are merged in."""
        base = {name: a for name, a in tensors.items() if not is_adapter(name)}
        adapters = {name: a for name, a in tensors.items() if is_adapter(name)}
        self.install(self.stage(spec, base, adapters or None))

    def load_adapters(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """Merge LoRA adapters into the loaded base."""
        self.install(self.stage(spec, None, tensors))

    def unsupported(self, spec: ModelSpec) -> str | None:
        """Why this engine cannot run `spec`'s model: one transformers does not know as a causal LM."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if spec.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return f"the learner's model is a {spec.model_type!r}, which this worker's transformers cannot build"
        return None

    def backend(self) -> dict[str, str | int]:
        """What this engine computes on, for the heartbeat (worker.hardware)."""
        return torch_backend(self.device)

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        threads = torch.get_num_threads()  # (a per-thread setting: the caller's thread may train next)
        torch.set_num_threads(self.threads)
        try:
            return generate_waves(self, requests, params, self.eos_ids, self.max_batch)
        finally:
            torch.set_num_threads(threads)

    @torch.no_grad()
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits [T, V] at every position of one sequence (prompt logprobs, checks)."""
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
        return self.model(input_ids=ids).logits[0].float().cpu().numpy()

    # -- next-token logits for worker.sampling.generate_waves (LogitsBackend) --------------------

    @torch.no_grad()
    def prefill(self, wave: Sequence[GenerationRequest], max_new_tokens: int) -> np.ndarray:
        """Every prompt repeated G times, left-padded to the wave's longest (masked, positions counted from
        each prompt's first token), in one forward pass that fills the wave's KV cache."""
        rows = [r.prompt_ids for r in wave for _ in range(r.group_size)]
        width = max(len(p) for p in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [R, P] left-padded prompts
        mask = torch.zeros(len(rows), width, dtype=torch.long)  # [R, P]
        for i, prompt in enumerate(rows):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        self._mask = mask.to(self.device)
        positions = (self._mask.cumsum(1) - 1).clamp(min=0)  # [R, P] each prompt's tokens from position 0
        self._cache = DynamicCache()
        out = self.model(input_ids=ids.to(self.device), attention_mask=self._mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        self._next_position = positions[:, -1:] + 1  # [R, 1]
        return out.logits[:, -1, :].float().cpu().numpy()  # [R, V]

    @torch.no_grad()
    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for every row of the wave: stopped rows decode a dummy token, their logits unused."""
        step = torch.zeros(len(self._mask), 1, dtype=torch.long)  # [R, 1]
        step[list(seqs), 0] = torch.tensor(tokens)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)  # [R, P + t + 1]
        out = self.model(input_ids=step.to(self.device), attention_mask=self._mask,
                         position_ids=self._next_position, past_key_values=self._cache, use_cache=True)  # fmt: skip
        self._next_position = self._next_position + 1
        return out.logits[list(seqs), -1, :].float().cpu().numpy()  # [len(seqs), V]

    def release(self, seq: int) -> None:
        """Rows stay in the batch until the wave ends (the cache is one tensor per layer)."""


def engine_device(name: str) -> torch.device:
    """auto: the first CUDA GPU when torch sees one, else the CPU; or cpu, cuda, cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device; use --device cpu or a CUDA build of torch")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: choose auto, cpu, cuda or cuda:N") from None


def torch_backend(device: torch.device) -> dict[str, str | int]:
    """{"backend": "cpu"} or {"backend": "cuda", "gpu": name, "gpu_mem_mb": total memory}."""
    if device.type != "cuda":
        return {"backend": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {"backend": "cuda", "gpu": props.name, "gpu_mem_mb": props.total_memory >> 20}
