"""Quantized GGUFs made by llama.cpp's own quantizer from a version's F16 GGUF, their weights read back, and the
llama.cpp build a quantized worker declares.

The quantizer is llama.cpp's (llama_model_quantize: which tensor gets which type is its rule, e.g. Q4_K_M
keeps some tensors at Q6_K and Q5_0); gguf-py's reference dequantizers read the blocks back. A float replay of
those weights is not exact (SmolLM2, docs/security.md: llama.cpp's quantized decoding depends on the decode
batch's layout and on the build's kernels); llama.cpp on the same build, fed a group back in the wave it was
drawn in, is (worker.sampling.replay_wave): that is how the learner verifies `worker join --quant`."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from p2p.config import ConfigError
from p2p.messages import ModelSpec
from worker.gguf_writer import llamacpp_name, unpermute_from_llamacpp, unsupported_by_llama_layout

QUANT_TYPES = {
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}
"""Weight formats a worker's llama.cpp can run besides F16, by the name users give them."""


def llamacpp_build(offload: str = "") -> str:
    """Which llama.cpp computes here, as far as its bits go: llama-cpp-python's version and a hash of the build's
    features (CPU instruction sets, GPU architectures) and of `offload` (the GPU layers go to; "" CPU only).
    Quantized decoding repeats bit for bit on one build (worker.sampling.replay_wave), not across builds: SmolLM2
    q8_0 waves drawn with AVX2 replay 0.068 nats/token away on the same llama.cpp built without AVX2
    (docs/security.md)."""
    what = llama_cpp.llama_print_system_info().decode(errors="replace") + offload
    where = "gpu" if offload else "cpu"
    return f"{llama_cpp.__version__}-{where}-{hashlib.sha256(what.encode()).hexdigest()[:8]}"[:32]


def quantize_gguf(src: str | Path, dst: str | Path, fmt: str, threads: int = 2) -> float:
    """Write `src` (an F16 GGUF) quantized to `fmt` at `dst` with llama.cpp's quantizer; returns the seconds."""
    if fmt not in QUANT_TYPES:
        raise ConfigError(f"unknown weight format {fmt!r}: choose one of {', '.join(QUANT_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[fmt]
    params.nthread = threads
    start = time.perf_counter()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {fmt}")
    return time.perf_counter() - start


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF holds, e.g. {'Q4_K': 16, 'Q5_0': 166, 'F32': 61}."""
    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def dequantized_weights(path: str | Path, spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """The float32 weights a GGUF of the llama layout holds, under HF names (`shapes`: HF name -> shape), in
    HF's Q/K row order: what llama.cpp multiplies by, dequantized by gguf-py's reference code."""
    if reason := unsupported_by_llama_layout(spec):
        raise ConfigError(f"reading quantized weights back needs the llama layout, not {reason}")
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    out = {}
    for hf_name, shape in shapes.items():
        if hf_name == "lm_head.weight" and spec.tie_embeddings:
            continue
        t = stored[llamacpp_name(hf_name, spec)]
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        out[hf_name] = unpermute_from_llamacpp(hf_name, array, spec)
    return out
