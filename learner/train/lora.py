"""LoRA training with peft: the base stays frozen, only low-rank adapters train, a version ships only them.

    W' x = W x + (alpha / r) * B (A x),    A: [r, in] (random),  B: [out, r] (zero at start)

so a fresh adapter leaves the policy unchanged. Tensors leave the learner under HF names: the frozen
base as `...q_proj.weight`, the adapter as `...q_proj.lora_A.weight` and `...q_proj.lora_B.weight`
(peft's `base_layer.` and adapter name `default` removed), which is what workers turn into a GGUF
LoRA adapter or merge into their weights.
"""

from __future__ import annotations

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(model: torch.nn.Module, rank: int, alpha: float) -> None:
    """Inject rank-`rank` adapters into every attention and MLP projection and freeze everything else."""
    from peft import LoraConfig, inject_adapter_in_model  # only LoRA runs pay for importing peft

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, model)
