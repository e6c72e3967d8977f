"""Tiny random models of every family echo-rl trains, built from transformers' own config classes (nothing
downloaded) with the tiny byte-level tokenizer, saved as a user's HF folder would be."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip


def family_configs(vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """Config of each family by its name here: what a user brings as --model. Where a config class's defaults
    differ from the family's released models in what llama.cpp assumes, the released value is set: Qwen3-MoE
    normalises its top-k routing weights, Gemma 3 scales queries by head_dim and has one global layer in six."""
    import transformers as tf

    ids = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    return {
        "llama": tf.LlamaConfig(**COMMON, **ids),
        "llama3": tf.LlamaConfig(**COMMON, **ids, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
        "qwen2": tf.Qwen2Config(**COMMON, **ids),
        "qwen3": tf.Qwen3Config(**COMMON, **ids, head_dim=16),
        "qwen3_moe": tf.Qwen3MoeConfig(**COMMON, **ids, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True),
        "mistral": tf.MistralConfig(**COMMON, **ids, head_dim=16, sliding_window=None),
        "gemma3": tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, **ids, head_dim=16, sliding_window=8,
                                      query_pre_attn_scalar=16, layer_types=GEMMA3_LAYERS),
        "phi3": tf.Phi3Config(**COMMON, **ids),
        "olmo2": tf.Olmo2Config(**COMMON, **ids),
    }  # fmt: skip


GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # released Gemma 3s: one global layer in six
FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3", "olmo2"]


def save_family(name: str, folder: Path, seed: int = 0) -> Path:
    """A random `name` model (see FAMILIES) with the tiny tokenizer, saved to `folder` as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.train.models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = family_configs(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config[name]).float()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
