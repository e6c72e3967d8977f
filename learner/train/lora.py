"""LoRA training with peft: the base stays frozen, only low-rank adapters train, a version ships only them.

    W' x = W x + (alpha / r) * B (A x),    A: [r, in] (random),  B: [out, r] (zero at start)

so a fresh adapter leaves the policy unchanged. Tensors leave the learner under HF names: the frozen
base as `...q_proj.weight`, the adapter as `...q_proj.lora_A.weight` and `...q_proj.lora_B.weight`
(peft's `base_layer.` and adapter name `default` removed), which is what workers turn into a GGUF
LoRA adapter or merge into their weights.
"""

from __future__ import annotations

import torch


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The projections that get adapters: every linear layer of the decoder, by its name in the layer (llama:
    q, k, v, o, gate, up and down_proj; Phi-3: qkv_proj and gate_up_proj), the output layer not. A MoE's
    experts are fused 3-D parameters in transformers 5, not linear layers: there only attention gets them."""
    head = model.get_output_embeddings()
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return sorted({name.rpartition(".")[2] for name in linear})


def add_lora(
    model: torch.nn.Module, rank: int, alpha: float, head: bool = False, name: str = "default",
    targets: list[str] | None = None,
) -> None:  # fmt: skip
    """Inject rank-`rank` adapters into every attention and MLP projection (and the output layer: `head`,
    which `echo-rl serve` offers; workers' GGUF adapters have none) and freeze everything else. `name`: the
    adapter's peft name; `targets`: lora_targets of the model before any adapter (`echo-rl serve` gives each
    training client on a shared base model an adapter of its own, where peft's layers hide the linear ones)."""
    from peft import LoraConfig, inject_adapter_in_model  # only LoRA runs pay for importing peft

    targets = list(targets) if targets is not None else lora_targets(model)
    if head:
        out = model.get_output_embeddings()
        targets += [name.rpartition(".")[2] for name, m in model.named_modules() if m is out]
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, model, adapter_name=name)
