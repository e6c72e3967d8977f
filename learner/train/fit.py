"""Will a run fit? Memory of the learner per component and of a worker's model file, from the config alone.

The model is built on torch's meta device (shapes, no data) from its config.json, so a 30B model is sized
in a second. The figures follow what the learner holds (all float32, fp32 and bf16 precision alike):

    P parameters, T trainable ones (P, or the LoRA adapters: r (in + out) per adapted linear layer)
    weights      4 P            gradients    4 T            AdamW        8 T (two moments)
    KL reference 4 P            (grpo.beta > 0: a frozen copy)
    activations  of one micro-batch of N = grpo.micro_batch_tokens tokens, what autograd keeps per decoder
                 layer and token: 4 h + 5 q + 4 i floats (h hidden, q = heads x head_dim, i the MLP width;
                 a MoE: top-k experts' widths): the norms' inputs and outputs, attention's q, k, v (expanded
                 to q's heads) and output, the MLP's gate, up, activation and product; with gradient
                 checkpointing h per layer plus one layer's worth; LoRA adds the adapted layers' inputs
                 and outputs (measured: peft's layers keep about that much more, scripts/bench_fit.py)
    output layer 3 N V floats: logits, their log-softmax and its gradient (V the vocabulary)
    verifier     (swarm runs) a float32 replay model, 4 P, and the wire tensors of the versions it keeps
                 (staleness + publish_every + 1; LoRA: the base once and every version's adapters)
    sampler      (co-located runs) llama.cpp's F16 file 2 P, or transformers' float32 copy 4 P, and its KV cache

A worker's weights per format (`worker join --quant`, worker.quantize): every matrix in the format's blocks
(gguf's GGML_QUANT_SIZES), vectors in F32, as llama.cpp's quantizer lays them out in outline: F16 and Q8_0
all through; Q4_0 with the output matrix (the head, or the tied embedding) at Q6_K, or Q8_0 where its rows do
not split into Q6_K's 256-blocks; Q4_K_M counted at 5.5 bits a weight (Q5_0's size: its Q4_K and Q6_K mix, or
the Q5_0 llama.cpp falls back to on such rows), its output matrix as Q4_0's. An estimate: measured against
llama.cpp's files in tests/test_quantized_workers.py and docs/benchmarks.md.
Its KV cache in F16: 2 (keys, values) x layers x kv_heads x head_dim x 2 bytes per token of context.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM

from learner.train.lora import lora_targets

WORKER_BLOCKS = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q5_0"}  # p2p.messages.WEIGHT_FORMATS
PROMPT_TOKENS = 256  # a lease's prompt length assumed for the KV cache of a wave


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, read from a model built on the meta device."""

    model_type: str
    parameters: int  # P, tied weights once
    lora_parameters: int  # r = 1 adapter parameters: r (in + out) summed over the adapted layers, at r = 1
    layers: int
    hidden: int
    q_width: int  # heads x head_dim
    mlp_width: int  # the MLP's intermediate size; a MoE's top-k experts' together
    vocab: int
    kv_per_token: int  # kv_heads x head_dim x layers: K and V entries per token, each
    matrices: list[int]  # element counts of 2-D (and 3-D expert) weights as a GGUF stores them
    output: int  # elements of the output matrix (the head, or the embedding it is tied to)
    tied: bool  # the output matrix is the embedding
    vectors: int  # elements of 1-D weights (norms, biases)


def model_shape(config: object) -> ModelShape:
    """Build `config`'s model on the meta device and measure it."""

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = getattr(config, "text_config", None) or config
    params = {id(p): p for p in model.parameters()}  # tied weights once
    targets = set(lora_targets(model))
    head = model.get_output_embeddings()
    lora = sum(
        m.in_features + m.out_features
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and name.rpartition(".")[2] in targets
    )
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    experts = getattr(text, "num_experts_per_tok", None)
    expert_width = getattr(text, "moe_intermediate_size", None)
    mlp = experts * expert_width if experts and expert_width else text.intermediate_size
    return ModelShape(
        model_type=text.model_type,
        parameters=sum(p.numel() for p in params.values()),
        lora_parameters=lora,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        q_width=heads * head_dim,
        mlp_width=mlp,
        vocab=text.vocab_size,
        kv_per_token=kv_heads * head_dim * text.num_hidden_layers,
        matrices=[p.numel() for p in params.values() if p.dim() >= 2],
        output=head.weight.numel(),
        tied=head.weight is model.get_input_embeddings().weight,
        vectors=sum(p.numel() for p in params.values() if p.dim() < 2),
    )


@dataclass(frozen=True)
class RunShape:
    """The parts of a learner's config memory depends on (learner.config.LearnerConfig)."""

    lora_rank: int = 0
    micro_batch_tokens: int = 4096
    grad_checkpointing: bool = False
    beta: float = 0.0
    colocated: bool = False
    engine: str = "llamacpp"  # the co-located sampler
    versions_kept: int = 4  # verifier: staleness + publish_every + 1
    wire_bytes: int = 2  # bytes per parameter of a published version (f16 / bf16 2, f32 4)
    max_batch: int = 32  # sequences a worker generates at once
    max_new_tokens: int = 256


def learner_memory(shape: ModelShape, run: RunShape) -> dict[str, int]:
    """Bytes per component of the learner (the module docstring's formulas); 0 where a part is absent."""
    p = shape.parameters
    trained = shape.lora_parameters * run.lora_rank if run.lora_rank else p
    n = run.micro_batch_tokens
    layer = 4 * shape.hidden + 5 * shape.q_width + 4 * shape.mlp_width  # floats per token of one layer
    if run.grad_checkpointing:
        activations = 4 * n * (shape.layers * shape.hidden + layer)
    else:
        activations = 4 * n * shape.layers * layer
    if run.lora_rank:  # peft's adapted layers keep about their inputs and outputs again (measured)
        activations += 4 * n * shape.lora_parameters
    kept = run.versions_kept * (trained if run.lora_rank else p) * run.wire_bytes
    if run.lora_rank:
        kept += p * run.wire_bytes  # the base the adapters apply to
    sampler = 0
    if run.colocated:
        sampler = (2 if run.engine == "llamacpp" else 4) * p + kv_cache(shape, run)
    return {
        "weights": 4 * p,
        "gradients": 4 * trained,
        "optimizer": 8 * trained,
        "activations": activations,
        "output layer": 3 * 4 * n * shape.vocab,
        "KL reference": 4 * p if run.beta > 0 else 0,
        "verifier": 0 if run.colocated else 4 * p + kept,
        "sampler": sampler,
    }


def kv_cache(shape: ModelShape, run: RunShape) -> int:
    """Bytes of an F16 KV cache for a wave: max_batch sequences of PROMPT_TOKENS + max_new_tokens."""
    return 2 * 2 * shape.kv_per_token * run.max_batch * (PROMPT_TOKENS + run.max_new_tokens)


def worker_weights(shape: ModelShape, output_copied: bool = False) -> dict[str, int]:
    """Bytes of a worker's weights per format (p2p.messages.WEIGHT_FORMATS; the module docstring's layout).
    `output_copied`: the GGUF stores a tied output matrix a second time (llama.cpp's OLMo2 layout does)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def size(elements: int, quant: str) -> int:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[quant]]
        return -(-elements // block) * nbytes

    head = "Q6_K" if shape.hidden % 256 == 0 else "Q8_0"  # the output matrix of the 4-bit formats
    out = {}
    for fmt, quant in WORKER_BLOCKS.items():
        body = sum(size(m, quant) for m in shape.matrices) + (size(shape.output, quant) if output_copied else 0)
        if fmt.startswith("q4"):  # the output matrix (one of them where the embedding is separate) kept larger
            body += size(shape.output, head) - size(shape.output, quant)
        out[fmt] = body + 4 * shape.vectors
    return out


def fit_report(shape: ModelShape, run: RunShape) -> dict:
    """Everything `echo-rl fit` prints, as plain data."""
    learner = learner_memory(shape, run)
    return {
        "model": asdict(shape) | {"matrices": len(shape.matrices)},
        "learner": learner,
        "learner_total": sum(learner.values()),
        "worker_file": worker_weights(shape),
        "worker_kv_cache": kv_cache(shape, run),
    }


def worker_sizes(
    config: object, max_new_tokens: int, recipe: str = "", formats: tuple[str, ...] = tuple(WORKER_BLOCKS)
) -> tuple[dict[str, int], int]:
    """What a worker's `--quant auto` weighs (SpecReply): its weights in each of `formats`, and one sequence's KV
    cache (a prompt of PROMPT_TOKENS and the token budget). `recipe`: the model's GGUF recipe (ModelSpec.gguf_recipe,
    learner.train.gguf_recipe), which says whether a tied output matrix is stored twice."""
    shape = model_shape(copy.deepcopy(config))  # building a model sets fields on its config: not the live one's
    names = {name for name, _ in json.loads(recipe).get("tensors", [])} if recipe else set()  # none: unsupported
    copied = shape.tied and {"output.weight", "token_embd.weight"} <= names
    sizes = worker_weights(shape, copied)
    return {fmt: sizes[fmt] for fmt in formats}, kv_cache(shape, RunShape(max_batch=1, max_new_tokens=max_new_tokens))
