"""Wire weights as engines and the verifier use them: float32 arrays, LoRA adapters merged.

A version's tensors arrive as bf16 bit patterns (uint16), f16 or float32 (p2p.versions.tensors_of);
a LoRA version carries `<weight>.lora_A.weight` [r, in] and `<weight>.lora_B.weight` [out, r] for
some weights, which add scale * B A to them (scale = lora_alpha / r).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from p2p.codec import bf16_to_f32


def to_float32(array: np.ndarray) -> np.ndarray:
    """A wire tensor as float32: uint16 arrays are bf16 bit patterns, f16 and f32 are widened as they are."""
    if array.dtype == np.uint16:
        return bf16_to_f32(array)
    out = np.asarray(array, dtype=np.float32)  # f16 is widened (a new array); float32 is used as it is
    return out if out.flags.writeable else out.copy()  # read-only wire buffers: torch.from_numpy needs writable


def lora_deltas(adapters: Mapping[str, np.ndarray], scale: float) -> Iterator[tuple[str, np.ndarray]]:
    """(weight name, scale * B A in float32) for every adapter pair: merged, W' = W + scale * B A."""
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            stem = name.removesuffix(".lora_A.weight")
            b = to_float32(adapters[stem + ".lora_B.weight"])  # [out, r]
            yield stem + ".weight", scale * (b @ to_float32(a))  # [out, in]
