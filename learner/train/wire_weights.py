"""The learner's weights in wire form: names as workers know them, 16-bit or float32 numpy arrays.

The one path from a torch model to what leaves the learner: the publisher's versions, the co-located
sampler's weights (`send_to_sampler`) and the benchmarks all go through `wire_tensors`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from p2p.config import ConfigError
from p2p.messages import Engine, ModelSpec, is_adapter


def wire_name(name: str) -> str:
    """A parameter's name as workers know it: peft's LoRA wrapping (`.base_layer.`, `.lora_A.default.`) removed."""
    name = name.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.")
    return name.replace(".lora_B.default.", ".lora_B.")


def wire_state(
    model: torch.nn.Module, adapter_only: bool = False, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors (or `state`, its gathered state dict when sharded) under their wire names
    (see the module docstring); the tied lm_head once."""
    out = {}
    for name, t in (model.state_dict() if state is None else state).items():
        if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
            continue
        name = wire_name(name)
        if not adapter_only or is_adapter(name):
            out[name] = t.detach()
    return out


def wire_tensors(
    model: torch.nn.Module,
    dtype: Literal["f32", "f16", "bf16"] = "f32",
    adapter_only: bool = False,
    state: dict[str, torch.Tensor] | None = None,
) -> dict[str, np.ndarray]:
    """The model's weights under their wire names as numpy arrays: always a copy (float32 tensors too),
    so training may go on while a version is encoded and verified from them in the background.

    f32: every tensor as float32 (an engine in this process, the co-located sampler). f16/bf16 (what a
    version carries): matrices as f16 or bf16 bit patterns (uint16); vectors (norms, a few KB) as
    float32, as the worker's GGUF keeps them. torch rounds to nearest even like numpy, 10x faster on the
    learner's thread (0.03-0.08 s against 0.5-0.7 s for SmolLM2's f16). `state`: the gathered weights of
    a sharded model (learner.train.data_parallel.full_state).
    """
    tensors = {}
    for name, t in wire_state(model, adapter_only, state).items():
        if t.ndim < 2 or dtype == "f32":
            # .float() of a float32 parameter is the parameter itself: its numpy view would change
            # under the next optimizer step while the publisher still encodes this version
            tensors[name] = t.to("cpu", torch.float32, copy=True).numpy()
        elif dtype == "bf16":
            tensors[name] = t.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
        else:
            tensors[name] = t.to(torch.float16).cpu().numpy()  # rounded where the model is: half the copy
            if not np.isfinite(tensors[name]).all():
                raise ConfigError(f"weight {name} exceeds the f16 range: publish with --wire-dtype bf16")
    return tensors


def wire_dtypes(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """The dtype names a version's manifest gives its tensors where numpy cannot say: uint16 arrays are bf16."""
    return {name: "bf16" for name, a in tensors.items() if a.dtype == np.uint16}


def send_to_sampler(engine: Engine, spec: ModelSpec, model: torch.nn.Module, adapters_only: bool = False) -> None:
    """Load `model`'s weights into an engine in this process (float32, as trained): the whole policy, or with
    `adapters_only` (a LoRA run after its first load) only the adapters, hot-swapped on the loaded base."""
    if adapters_only:
        engine.load_adapters(spec, wire_tensors(model, adapter_only=True))
    else:
        engine.load_policy(spec, wire_tensors(model))
