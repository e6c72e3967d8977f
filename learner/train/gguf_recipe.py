"""A model's GGUF recipe: how llama.cpp's own converter lays out its tensors, worked out once on the learner
and carried to workers in ModelSpec.gguf_recipe, so that a worker without torch writes any family's GGUF.

The converter (convert_hf_to_gguf.py's model classes, unpacked by scripts/setup.sh from the llama-cpp-python
sdist the worker's llama.cpp is built from) runs on meta tensors, shapes without data, under a torch function
mode that records every operation: each GGUF tensor becomes a short program of layout operations (reshape,
swapaxes, stack, slices, adding a constant) on named wire tensors, which worker.gguf_writer.recipe_arrays
replays with numpy. transformers' revert of its load-time conversions (fused MoE experts back to one tensor
per expert, as checkpoints store them and the converter reads them) is traced the same way. The metadata is
the converter's own (set_gguf_parameters); tensors it computes from hyperparameters (generate_extra_tensors,
e.g. Llama 3's rope frequencies) travel as values.

    recipe = {"arch": str, "kv": [[key, value, gguf value type, array item type | None], ...],
              "nodes": [[op, args, kwargs], ...], "tensors": [[gguf name, node], ...]}
    a node's args refer to earlier nodes as {"n": i}; ["w", name] is the wire tensor `name`, ["v", data,
    shape] a literal float32 array, ["item", i, k] the k-th tensor of node i's result.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

CONVERTER = Path(sys.prefix) / "share" / "llama.cpp-convert"  # scripts/setup.sh unpacks it here
# what worker.gguf_writer.replay can do with numpy; an operation outside it makes the family unsupported
LAYOUT_OPS = {
    "reshape", "view", "swapaxes", "transpose", "swapdims", "permute", "T", "contiguous", "float", "to", "clone",
    "detach", "stack", "cat", "concat", "concatenate", "__getitem__", "add", "__add__", "__radd__", "sub",
    "__sub__", "mul", "__mul__", "__rmul__", "__truediv__", "__neg__", "neg", "chunk", "split", "unbind",
    "squeeze", "unsqueeze", "flatten", "narrow",
}  # fmt: skip
# llama.cpp architectures whose loader wants output.weight even where the model ties it to the embedding
# (measured: a tied OLMo 2 does not load without it; Qwen3, Gemma 3 and the others fall back to token_embd, so
# storing it again would only grow their files by vocabulary x hidden)
STORES_TIED_OUTPUT = {"OLMO2"}
IGNORED = {"size", "dim", "numel", "__len__", "shape", "dtype", "device", "is_floating_point", "ndim", "element_size"}


class RecipeError(RuntimeError):
    """The converter cannot lay this model out (no converter class, or an operation we cannot replay)."""


class _Tracer(TorchFunctionMode):
    """Records the operations on traced tensors as recipe nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[list] = []
        self.node_of: dict[int, int] = {}  # id(tensor) -> node
        self.alive: list[torch.Tensor] = []  # keeps traced tensors alive, so that their ids stay theirs

    def add(self, node: list, tensor: torch.Tensor) -> None:
        self.nodes.append(node)
        self.node_of[id(tensor)] = len(self.nodes) - 1
        self.alive.append(tensor)

    def encode(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in self.node_of:
                raise RecipeError("the converter made a tensor from data (not a layout of the weights)")
            return {"n": self.node_of[id(value)]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, slice):
            return {"slice": [self.encode(value.start), self.encode(value.stop), self.encode(value.step)]}
        if value is Ellipsis:
            return {"ellipsis": True}
        if isinstance(value, list | tuple | torch.Size):
            return [self.encode(v) for v in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise RecipeError(f"the converter passed a {type(value).__name__} ({str(value)[:80]}) to a tensor operation")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = getattr(func, "__name__", "")
        if op == "__get__":  # a property: Tensor.T, .shape
            op = getattr(getattr(func, "__self__", None), "__name__", op)
        results = list(out) if isinstance(out, list | tuple) else [out]
        if op in IGNORED or not any(isinstance(r, torch.Tensor) for r in results):
            return out
        if op not in LAYOUT_OPS:
            raise RecipeError(f"the converter uses torch's {op!r}, which workers do not replay")
        node = [op, self.encode(args), {key: self.encode(v) for key, v in kwargs.items()}]
        if isinstance(out, torch.Tensor):
            self.add(node, out)
        else:
            self.nodes.append(node)
            parent = len(self.nodes) - 1
            for k, r in enumerate(results):
                self.add(["item", parent, k], r)
        return out


def gguf_recipe(model: torch.nn.Module, tokenizer: Any, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The recipe of `model` (its config, and `shapes`: its wire tensors' names and shapes, LoRA adapters
    excluded); RecipeError if the converter cannot lay it out."""
    import gguf
    from transformers.core_model_loading import revert_weight_conversion

    tracer = _Tracer()
    with tempfile.TemporaryDirectory(prefix="echo-rl-recipe-") as tmp:
        leaves = {name: torch.empty(shape, dtype=torch.float32, device="meta") for name, shape in shapes.items()}
        for name, leaf in leaves.items():
            tracer.add(["w", name], leaf)
        base = _converter_class(model, tokenizer, Path(tmp))
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        tied = "lm_head.weight" not in shapes and embed and getattr(model.config, "tie_word_embeddings", False)
        if tied and base.model_arch.name in STORES_TIED_OUTPUT:  # the embedding, stored again as the output layer
            leaves["lm_head.weight"] = torch.empty(shapes[embed], dtype=torch.float32, device="meta")
            tracer.add(["w", embed], leaves["lm_head.weight"])
        with tracer:
            files = revert_weight_conversion(model, leaves)  # checkpoint names, as the converter reads them
        converter = _instantiate(base, Path(tmp), files)
        tensors: list[list] = []
        with torch.no_grad():
            for name, array in converter.generate_extra_tensors():  # values from hyperparameters
                tracer.nodes.append(["v", array.float().flatten().tolist(), list(array.shape)])
                tensors.append([name, len(tracer.nodes) - 1])
            with tracer:
                for name, meta in converter.get_tensors():
                    bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
                    for gguf_name, out in converter.modify_tensors(meta, name, bid):
                        if id(out) not in tracer.node_of:
                            raise RecipeError(f"the converter's {gguf_name} is not a layout of the weights")
                        tensors.append([gguf_name, tracer.node_of[id(out)]])
        converter.set_gguf_parameters()
    kv = _metadata(converter, lambda key: not key.startswith(("tokenizer.", "general.name")))
    return {"arch": gguf.MODEL_ARCH_NAMES[converter.model_arch], "kv": kv, "nodes": tracer.nodes, "tensors": tensors}


def tokenizer_metadata(model: torch.nn.Module, tokenizer: Any) -> list[list]:
    """The tokenizer as llama.cpp's converter writes it (the tokenizer.* keys: vocabulary kind, tokens,
    scores or merges, its pre-tokenizer's name, special ids, chat template), in gguf_recipe's kv form: what
    an exported GGUF needs for llama.cpp to tokenize text as the model's own tokenizer does. RecipeError
    where the converter does not know the tokenizer (e.g. a pre-tokenizer missing from its table)."""
    with tempfile.TemporaryDirectory(prefix="echo-rl-vocab-") as tmp:
        converter = _instantiate(_converter_class(model, tokenizer, Path(tmp)), Path(tmp), {})
        try:
            converter.set_vocab()
        except Exception as exc:  # noqa: BLE001 - the converter's NotImplementedError, KeyError, ...
            raise RecipeError(f"llama.cpp's converter does not know this tokenizer ({str(exc)[:200]})") from None
    return _metadata(converter, lambda key: key.startswith("tokenizer."))


def _converter_class(model: torch.nn.Module, tokenizer: Any, folder: Path) -> Any:
    """llama.cpp's converter class for `model`'s architecture; its config and tokenizer are saved in `folder`."""
    if not (CONVERTER / "conversion").is_dir():
        raise RecipeError(f"llama.cpp's converter is not unpacked in {CONVERTER}: run ./scripts/setup.sh")
    if str(CONVERTER) not in sys.path:
        sys.path.insert(0, str(CONVERTER))
    os.environ.setdefault("NO_LOCAL_GGUF", "1")  # the installed gguf is the converter's (scripts/setup.sh)
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    for name in ("hf-to-gguf", "gguf.gguf_writer"):  # the converter's own chatter ("Duplicated key name")
        logging.getLogger(name).setLevel(logging.ERROR)
    config = copy.deepcopy(model.config)
    config.architectures = config.architectures or [type(model).__name__]  # a config built in code has none
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    spm = Path(getattr(tokenizer, "vocab_file", None) or "")  # a SentencePiece model the folder shipped
    if spm.suffix == ".model" and spm.is_file():  # its scores: llama.cpp then splits text as sentencepiece does
        shutil.copy(spm, folder / "tokenizer.model")
    hparams = ModelBase.load_hparams(folder, False)
    try:
        return get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise RecipeError(f"llama.cpp has no converter for {model.config.model_type!r} ({exc})") from None


def _instantiate(base: Any, folder: Path, files: dict[str, torch.Tensor]) -> Any:
    """The converter `base` on `folder`, reading the tensors `files` (checkpoint names) instead of the folder's
    safetensors."""
    import gguf

    class Traced(base):
        model_arch = base.model_arch

        def index_tensors(self, remote_hf_model_id: str | None = None) -> dict:
            return {name: (lambda t=t: t) for name, t in files.items()}

    return Traced(folder, gguf.LlamaFileType.MOSTLY_F16, folder / "unused.gguf", model_name="policy")


def _metadata(converter: Any, wanted: Any) -> list[list]:
    """The converter's metadata whose keys `wanted` accepts, as [key, value, value type, item type]."""
    return [
        [key, _plain(v.value), int(v.type), None if v.sub_type is None else int(v.sub_type)]
        for part in converter.gguf_writer.kv_data for key, v in part.items() if wanted(key)
    ]  # fmt: skip


def _plain(value: Any) -> Any:
    """A metadata value as msgpack/JSON carries it (numpy scalars and arrays as Python numbers and lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def recipe_json(model: torch.nn.Module, tokenizer: Any, shapes: dict[str, tuple[int, ...]]) -> str:
    """gguf_recipe as JSON text, or {"unsupported": why} where the converter cannot lay the model out: the
    llama.cpp engine then names the reason, and the transformers engine still runs the model."""
    try:
        return json.dumps(gguf_recipe(model, tokenizer, shapes), separators=(",", ":"))
    except RecipeError as exc:
        why = str(exc)
    except Exception as exc:  # noqa: BLE001 - llama.cpp's converter refusing a config it does not know
        why = f"llama.cpp's converter failed on this model ({type(exc).__name__}: {str(exc)[:200]})"
    log.info("no GGUF recipe for %s: %s", type(model).__name__, why)
    return json.dumps({"unsupported": why})
