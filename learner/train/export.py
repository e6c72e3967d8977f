"""A checkpoint's policy in the formats other tools load: a transformers folder, LoRA adapters as peft saves them.

A LoRA run exports either merged (each adapted weight becomes W + (alpha / r) B A, by peft's own merge)
or, with `adapters`, as its frozen base plus a peft adapter folder. The GGUF export lives beside the
workers' GGUF writer (echo_cli.research), since llama.cpp's format is the workers' business.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

from learner.train.models import Policy
from learner.train.wire_weights import wire_state
from p2p.messages import is_adapter


def merge_adapters(policy: Policy) -> None:
    """Fold every LoRA adapter into its base weight in place (peft's merge); the adapters then add nothing."""
    from peft.tuners.lora import LoraLayer

    for module in policy.model.modules():
        if isinstance(module, LoraLayer) and not module.merged:
            module.merge()


def base_state(policy: Policy) -> dict[str, torch.Tensor]:
    """The policy's weights under HF names without the adapters (merged into them if merge_adapters ran)."""
    return {name: t for name, t in wire_state(policy.model).items() if not is_adapter(name)}


def adapter_state(policy: Policy) -> dict[str, torch.Tensor]:
    """The LoRA adapters under their wire names (`...q_proj.lora_A.weight`); {} for a full-weight run."""
    return {name: t for name, t in wire_state(policy.model).items() if is_adapter(name)}


def plain_model(policy: Policy, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A plain transformers model of the policy's architecture holding `state` (no peft layers)."""
    model = type(policy.model)(copy.deepcopy(policy.model.config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(policy.model.config, "tie_word_embeddings", False)
    missing = [n for n in missing if not (tied and n == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model.eval()


def save_hf(policy: Policy, out: Path) -> None:
    """`out` as a transformers folder: config, safetensors weights, tokenizer with its chat template.
    A LoRA policy is saved as it is now: call merge_adapters first for the trained model, or not for its base."""
    plain_model(policy, base_state(policy)).save_pretrained(out)
    policy.tokenizer.save_pretrained(out)


def save_peft_adapters(policy: Policy, out: Path, base_path: Path) -> None:
    """The LoRA adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors) for the
    base model saved at `base_path`: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)`."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from learner.train.lora import lora_targets

    base = plain_model(policy, base_state(policy))
    config = LoraConfig(
        r=policy.lora_rank, lora_alpha=policy.lora_alpha, target_modules=lora_targets(base), lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    base.name_or_path = str(base_path)  # what peft writes as the adapters' base model
    wrapped = get_peft_model(base, config)
    trained = get_peft_model_state_dict(policy.model)  # names relative to the model: prefix them as peft saves
    result = set_peft_model_state_dict(wrapped, {f"base_model.model.{k}": v for k, v in trained.items()})
    if result.unexpected_keys:
        raise RuntimeError(f"export: peft did not take the adapters {result.unexpected_keys[:3]}")
    wrapped.save_pretrained(out, save_embedding_layers=False)  # only the adapters train
