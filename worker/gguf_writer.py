"""Write a policy's float weights as an F16 GGUF file that llama.cpp loads (numpy only, no torch).

Two ways to lay the tensors out: Llama and Mistral models are written here by name (llamacpp_name, the Q/K row
permutation), which also writes LoRA adapters llama.cpp hot-swaps; every other family follows the learner's
GGUF recipe (learner.train.gguf_recipe: llama.cpp's own converter, traced), replayed with numpy (replay).
"""

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


def unpermute_from_llamacpp(hf_name: str, array: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """for_llamacpp's inverse: Q/K rows from llama.cpp's interleaved RoPE layout back to HF's."""
    heads = {".self_attn.q_proj.": spec.num_heads, ".self_attn.k_proj.": spec.num_kv_heads}
    for part, n_heads in heads.items():
        if part in hf_name:
            rows = array.shape[0]
            return array.reshape(n_heads, rows // n_heads // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
    return array


def unsupported_by_writer(spec: ModelSpec) -> str | None:
    """What of `spec`'s model this writer cannot write (None: nothing): a model neither the llama layout nor
    the learner's recipe covers."""
    legacy = unsupported_by_llama_layout(spec)
    recipe = spec.recipe()
    if legacy is None or "arch" in recipe:
        return None
    return str(recipe.get("unsupported") or f"{legacy}; the learner sent no GGUF recipe")


def unsupported_by_llama_layout(spec: ModelSpec) -> str | None:
    """What of `spec`'s model the llama layout cannot write (None: nothing): another family, or a llama
    variant whose extra tensors or rope scaling it does not carry."""
    config = spec.config()
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {"rope_type": "unknown"}
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


def write_gguf(
    path: str | Path,
    spec: ModelSpec,
    tensors: Mapping[str, np.ndarray],
    name: str | None = None,
    tokenizer_kv: list | None = None,
) -> Path:
    """Write `tensors` (HF names, float arrays) to `path` as GGUF; matrices in F16, vectors and norms in F32.

    The file is written next to its destination and renamed into place, so a reader never sees half a
    file.

    `name` (general.name, default the spec's): llama.cpp keys token attributes on it (a name holding "phi3"
    wants Phi-3's special tokens), which matter where llama.cpp tokenizes text: an export keeps the model's
    name, a worker's sampler (prompts arrive as token ids) passes a neutral one.

    `tokenizer_kv` (learner.train.gguf_recipe.tokenizer_metadata: llama.cpp's converter's tokenizer.* keys, for
    an export that llama.cpp tokenizes text with) replaces the spec's vocabulary, written as byte-level BPE
    (enough for a worker: prompts arrive as token ids).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if unsupported_by_llama_layout(spec) is not None:
        return _write_by_recipe(tmp, path, spec, tensors, name or spec.name, tokenizer_kv)
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    writer.add_name(name or spec.name)
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
    _add_tokenizer(writer, spec, tokenizer_kv)
    for name, array in gguf_arrays(spec, tensors):
        writer.add_tensor(name, array)
    return _finish(writer, tmp, path)


def _write_by_recipe(
    tmp: Path, path: Path, spec: ModelSpec, tensors: Mapping[str, np.ndarray], name: str, tokenizer_kv: list | None
) -> Path:
    """The GGUF of a family the llama layout does not cover: the recipe's metadata and tensor programs."""
    recipe = spec.recipe()
    writer = gguf.GGUFWriter(str(tmp), arch=recipe["arch"])
    _add_kv(writer, recipe["kv"])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_tokenizer(writer, spec, tokenizer_kv)
    for tensor_name, array in gguf_arrays(spec, tensors):
        writer.add_tensor(tensor_name, array)
    return _finish(writer, tmp, path)


def _add_kv(writer: gguf.GGUFWriter, kv: list) -> None:
    """Metadata in the recipe's form, [key, value, value type, array item type | None]; the architecture and
    file type are the writer's own."""
    try:
        for key, value, vtype, sub_type in kv:
            if key not in ("general.architecture", "general.file_type"):
                sub = None if sub_type is None else gguf.GGUFValueType(sub_type)
                writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=sub)
    except (ValueError, TypeError) as exc:
        raise RuntimeError(f"the learner's GGUF recipe has unreadable metadata ({exc})") from None


def _add_tokenizer(writer: gguf.GGUFWriter, spec: ModelSpec, tokenizer_kv: list | None) -> None:
    """`tokenizer_kv` where given, else the spec's byte-level BPE vocabulary and special tokens."""
    if tokenizer_kv is not None:
        return _add_kv(writer, tokenizer_kv)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.tokenizer_pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    writer.add_bos_token_id(spec.bos_id)
    writer.add_eos_token_id(spec.eos_ids[0])
    writer.add_add_bos_token(False)


def gguf_arrays(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array as the file stores it) in file order: matrices F16 in llama.cpp's Q/K row order,
    vectors F32; a tied output layer is not stored. A family outside the llama layout: its recipe's."""
    if unsupported_by_llama_layout(spec) is not None:
        return recipe_arrays(spec.recipe(), tensors)
    out = []
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight" and spec.tie_embeddings:
            continue
        array = for_llamacpp(hf_name, array, spec)
        dtype = np.float16 if array.ndim == 2 else np.float32
        out.append((llamacpp_name(hf_name, spec), np.ascontiguousarray(array, dtype=dtype)))
    return out


def recipe_arrays(recipe: dict, tensors: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) of every tensor of `recipe` (learner.train.gguf_recipe) built from the wire
    `tensors`: matrices F16, vectors and norms F32, as llama.cpp's converter stores them."""
    values: list = []
    try:
        for node in recipe["nodes"]:
            values.append(replay(node, values, tensors))
        out = []
        for name, index in recipe["tensors"]:
            array = np.asarray(values[index])
            dtype = np.float32 if array.ndim <= 1 or name.endswith("_norm.weight") else np.float16
            out.append((str(name), np.ascontiguousarray(array, dtype=dtype)))
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise RuntimeError(f"the learner's GGUF recipe does not fit its weights ({why})") from None
    return out


def replay(node: list, values: list, tensors: Mapping[str, np.ndarray]) -> object:
    """One recipe node with numpy: a wire tensor, a literal, an item of an earlier result, or a torch layout
    operation (learner.train.gguf_recipe.LAYOUT_OPS) on earlier results, with torch's semantics."""
    kind = node[0]
    if kind == "w":
        return tensors[node[1]]
    if kind == "v":
        return np.asarray(node[1], dtype=np.float32).reshape(node[2])
    if kind == "item":
        return values[node[1]][node[2]]
    args, kwargs = _decode(node[1], values), {k: _decode(v, values) for k, v in node[2].items()}
    a = args[0]

    def arg(i: int, name: str, default: object = None) -> object:
        return args[i] if len(args) > i else kwargs.get(name, default)

    if kind in ("reshape", "view"):
        shape = args[1] if len(args) == 2 and isinstance(args[1], list) else args[1:] or kwargs["shape"]
        return np.reshape(a, shape)
    if kind in ("swapaxes", "transpose", "swapdims"):
        return np.swapaxes(a, arg(1, "dim0"), arg(2, "dim1"))
    if kind == "permute":
        return np.transpose(a, args[1] if len(args) == 2 and isinstance(args[1], list) else args[1:])
    if kind == "T":
        return a.T
    if kind in ("contiguous", "clone", "detach", "float"):
        return a
    if kind == "to":
        dtypes = [v for v in [*args[1:], kwargs.get("dtype")] if isinstance(v, str)]
        if any(d not in ("float32", "float16") for d in dtypes):
            raise ValueError(f"a cast to {dtypes} changes the values")
        return a
    if kind in ("stack", "cat", "concat", "concatenate"):
        join = np.stack if kind == "stack" else np.concatenate
        return join([np.asarray(t) for t in a], axis=arg(1, "dim", 0))
    if kind == "__getitem__":
        return a[tuple(args[1]) if isinstance(args[1], list) else args[1]]
    if kind in ("add", "__add__", "__radd__", "sub", "__sub__", "mul", "__mul__", "__rmul__", "__truediv__"):
        if "alpha" in kwargs:
            raise ValueError("add with alpha")
        b = arg(1, "other")
        op = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.divide}[
            kind.strip("_").removeprefix("r") if kind != "__truediv__" else "truediv"]  # fmt: skip
        return op(np.asarray(a, np.float32), b)
    if kind in ("neg", "__neg__"):
        return -np.asarray(a, np.float32)
    if kind in ("chunk", "split", "unbind", "narrow"):
        dim = arg(2, "dim", 0) if kind != "unbind" else arg(1, "dim", 0)
        n = a.shape[dim]
        if kind == "unbind":
            return [np.take(a, i, axis=dim) for i in range(n)]
        if kind == "narrow":
            start, length = arg(2, "start"), arg(3, "length")
            return np.take(a, range(start, start + length), axis=arg(1, "dim"))
        size = arg(1, "chunks" if kind == "chunk" else "split_size_or_sections")
        if kind == "chunk":
            size = -(-n // size)
        cuts = list(np.cumsum(size)[:-1]) if isinstance(size, list) else list(range(size, n, size))
        return np.split(a, cuts, axis=dim)
    if kind == "squeeze":
        dim = arg(1, "dim")
        return np.squeeze(a) if dim is None else (np.squeeze(a, axis=dim) if a.shape[dim] == 1 else a)
    if kind == "unsqueeze":
        return np.expand_dims(a, arg(1, "dim"))
    if kind == "flatten":
        start, end = arg(1, "start_dim", 0) % a.ndim, arg(2, "end_dim", -1) % a.ndim
        return np.reshape(a, (*a.shape[:start], -1, *a.shape[end + 1 :]))
    raise ValueError(f"operation {kind!r}")


def _decode(value: object, values: list) -> object:
    """A recipe argument: earlier results for {"n": i}, slices, Ellipsis, dtype names, lists, scalars."""
    if isinstance(value, dict):
        if "n" in value:
            return values[value["n"]]
        if "slice" in value:
            return slice(*(_decode(v, values) for v in value["slice"]))
        if "ellipsis" in value:
            return Ellipsis
        if "dtype" in value:
            return str(value["dtype"])
        raise ValueError(f"argument {value!r}")
    if isinstance(value, list):
        return [_decode(v, values) for v in value]
    return value


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
