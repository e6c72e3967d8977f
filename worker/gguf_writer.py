"""Write a policy's float weights as an F16 GGUF file that llama.cpp loads (numpy only, no torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from p2p.messages import ModelSpec


def permute_for_llamacpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder Q/K projection rows from HF's rotate-half layout to llama.cpp's interleaved RoPE layout.

    HF stores each head's rotary pairs as (first half, second half); llama.cpp expects them adjacent.
    Row index (h, half, i) becomes (h, i, half).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str | Path, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> Path:
    """Write `tensors` (HF llama names, float arrays) to `path` as GGUF; matrices in F16, vectors in F32.

    The file is written next to its destination and renamed into place, so a reader never sees half a
    file.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    writer.add_name(spec.name)
    writer.add_context_length(spec.max_position)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.tokenizer_pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    writer.add_bos_token_id(spec.bos_id)
    writer.add_eos_token_id(spec.eos_ids[0])
    writer.add_add_bos_token(False)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, spec.num_layers)
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight" and spec.tie_embeddings:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"tensor {hf_name!r} has no llama.cpp name: is this a llama-architecture model?")
        if hf_name.endswith("self_attn.q_proj.weight"):
            array = permute_for_llamacpp(array, spec.num_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            array = permute_for_llamacpp(array, spec.num_kv_heads)
        dtype = np.float16 if array.ndim == 2 else np.float32
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=dtype))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
