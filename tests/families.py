"""Tiny random models of every family echo-rl trains, built from transformers' own config classes (nothing
downloaded) with the tiny byte-level tokenizer, or with a released family's own tokenizer (REAL_TOKENIZERS),
saved as a user's HF folder would be."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

SHARE = Path(__file__).resolve().parent.parent / ".venv" / "share" / "tokenizers"  # unpacked by scripts/setup.sh

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


def save_family(name: str, folder: Path, seed: int = 0, tokenizer: str = "tiny", **config: object) -> Path:
    """A random `name` model (see FAMILIES) with the tiny tokenizer or one of REAL_TOKENIZERS, saved to
    `folder` as an HF folder; `config`: fields set on its config."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.train.models import tiny_tokenizer

    tok = tiny_tokenizer() if tokenizer == "tiny" else REAL_TOKENIZERS[tokenizer]()
    vocab = max(len(tok), REAL_VOCAB.get(tokenizer, 0))
    configs = family_configs(vocab, tok.bos_token_id or tok.eos_token_id, tok.eos_token_id, tok.pad_token_id)
    for key, value in config.items():
        setattr(configs[name], key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[name]).float()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if tokenizer == "mistral":  # as released: the SentencePiece model beside tokenizer.json
        shutil.copy(SHARE / "mistral-v1.model", folder / "tokenizer.model")
    return folder


# Qwen's pre-tokenizer (its released tokenizer.json; dashscope's qwen_tokenizer.py): digits one at a time
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens from id 151643 in order; all but the first three are plain text, <think> included
QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
               "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"]  # fmt: skip
# ChatML as Qwen3 renders a user turn: the model thinks first unless enable_thinking=False closes an empty block
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_TEMPLATE = (  # Mistral 7B Instruct v0.1: [INST] turns, </s> after each answer
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
REAL_VOCAB = {"qwen3": 151936}  # Qwen3's embedding rows (the tokenizer's 151669 padded)


@functools.cache
def qwen3_tokenizer():
    """Qwen3's tokenizer: Qwen's released BPE ranks (151643 tokens), its pre-tokenizer and added tokens."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(str(SHARE / "qwen.tiktoken"), pattern=QWEN_SPLIT).converted()
    backend.add_tokens([AddedToken(t, normalized=False, special=i < 3) for i, t in enumerate(QWEN3_ADDED)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=QWEN3_TEMPLATE)  # fmt: skip


@functools.cache
def mistral_tokenizer():
    """Mistral 7B's SentencePiece tokenizer (32000 pieces, byte fallback), read from its tokenizer.model."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(SHARE / "mistral-v1.model", Path(tmp) / "tokenizer.model")
        tok = AutoTokenizer.from_pretrained(tmp, tokenizer_class="LlamaTokenizer", legacy=True,
                                            bos_token="<s>", eos_token="</s>", unk_token="<unk>")  # fmt: skip
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


REAL_TOKENIZERS = {"qwen3": qwen3_tokenizer, "mistral": mistral_tokenizer}
