"""Write a policy's float weights as an F16 GGUF file that llama.cpp loads (numpy only, no torch)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
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


def unsupported_by_writer(spec: ModelSpec) -> str | None:
    """What of `spec`'s model this writer cannot write as a llama GGUF (None: nothing): another family, or a
    llama variant whose extra tensors or rope scaling it does not carry."""
    config = spec.config()
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    variant = [
        f"{spec.model_type} architecture" if spec.model_type not in ("llama", "mistral") else "",
        f"{rope.get('rope_type')} rope scaling" if rope.get("rope_type", "default") != "default" else "",
        "attention biases" if config.get("attention_bias") else "",
        "MLP biases" if config.get("mlp_bias") else "",
        "sliding-window attention" if config.get("sliding_window") else "",
    ]
    return ", ".join(v for v in variant if v) or None


@functools.cache
def _name_map(num_layers: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)


def llamacpp_name(hf_name: str, spec: ModelSpec) -> str:
    """The GGUF name of an HF llama weight: model.layers.0.self_attn.q_proj.weight -> blk.0.attn_q.weight."""
    name = _name_map(spec.num_layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"tensor {hf_name!r} has no llama.cpp name: is this a llama-architecture model?")
    return name


def for_llamacpp(hf_name: str, array: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Rows of Q and K projections (and of LoRA B matrices feeding them) in llama.cpp's RoPE layout."""
    if ".self_attn.q_proj." in hf_name and not hf_name.endswith(".lora_A.weight"):
        return permute_for_llamacpp(array, spec.num_heads)
    if ".self_attn.k_proj." in hf_name and not hf_name.endswith(".lora_A.weight"):
        return permute_for_llamacpp(array, spec.num_kv_heads)
    return array


def write_lora_gguf(path: str | Path, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> Path:
    """Write LoRA adapters (`<weight>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], float arrays)
    as a GGUF LoRA adapter for llama.cpp: matrices in F16, scale alpha / r, written then renamed into place."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(spec.lora_alpha))
    for hf_name, array in tensors.items():
        weight, _, kind = hf_name.rpartition(".lora_")  # kind: "A.weight" or "B.weight"
        suffix = {"A.weight": ".lora_a", "B.weight": ".lora_b"}[kind]
        array = for_llamacpp(hf_name, array, spec)
        writer.add_tensor(llamacpp_name(weight + ".weight", spec) + suffix, np.ascontiguousarray(array, np.float16))
    return _finish(writer, tmp, path)


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

    for name, array in gguf_arrays(spec, tensors):
        writer.add_tensor(name, array)
    return _finish(writer, tmp, path)


def gguf_arrays(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array as the file stores it) in file order: matrices F16 in llama.cpp's Q/K row order,
    vectors F32; a tied output layer is not stored."""
    out = []
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight" and spec.tie_embeddings:
            continue
        array = for_llamacpp(hf_name, array, spec)
        dtype = np.float16 if array.ndim == 2 else np.float32
        out.append((llamacpp_name(hf_name, spec), np.ascontiguousarray(array, dtype=dtype)))
    return out


@dataclass(frozen=True)
class GGUFLayout:
    """Where a GGUF file's tensors lie: the bytes before the first tensor (header, metadata with the
    tokenizer, tensor infos) and each tensor's (name, offset, size). A new version of the same model has
    the same layout, so its file is that prefix and the new tensor bytes, with no metadata packing (half
    a second per version for SmolLM2's 49k-token vocabulary, on the worker's CPU)."""

    prefix: bytes
    tensors: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, path: str | Path) -> GGUFLayout:
        reader = gguf.GGUFReader(path)
        with open(path, "rb") as f:
            prefix = f.read(reader.data_offset)
        return cls(prefix, tuple((t.name, t.data_offset, t.n_bytes) for t in reader.tensors))

    def fits(self, arrays: list[tuple[str, np.ndarray]]) -> bool:
        return [(n, size) for n, _, size in self.tensors] == [(n, a.nbytes) for n, a in arrays]

    def write(self, path: str | Path, arrays: list[tuple[str, np.ndarray]]) -> Path:
        """Write `arrays` (gguf_arrays of the same model) into a new file of this layout, renamed into place."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(self.prefix)
            for (_, offset, _), (_, array) in zip(self.tensors, arrays, strict=True):
                f.write(b"\0" * (offset - f.tell()))  # alignment padding
                array.tofile(f)
        os.replace(tmp, path)
        return path


def _finish(writer: gguf.GGUFWriter, tmp: Path, path: Path) -> Path:
    """Write the file out next to `path`, then rename it into place: a reader never sees half a file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
