"""Quantized GGUFs made by llama.cpp's own quantizer from a version's F16 GGUF, their weights read back, and the
llama.cpp build a quantized worker declares.

The quantizer is llama.cpp's (llama_model_quantize: which tensor gets which type is its rule, e.g. Q4_K_M
keeps some tensors at Q6_K and Q5_0); gguf-py's reference dequantizers read the blocks back. A float replay of
those weights is not exact (SmolLM2, docs/security.md: llama.cpp's quantized decoding depends on the decode
batch's layout and on the build's kernels); llama.cpp on the same build, fed a group back in the wave it was
drawn in, is (worker.sampling.replay_wave): that is how the learner verifies `worker join --quant`."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from p2p.config import ConfigError
from p2p.messages import ModelSpec, SpecReply
from worker.gguf_writer import llamacpp_name, unpermute_from_llamacpp, unsupported_by_llama_layout

QUANT_TYPES = {
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}
"""Weight formats a worker's llama.cpp can run besides F16, by the name users give them."""
LARGEST_FIRST = ("f16", "q8_0", "q4_k_m", "q4_0")  # what `--quant auto` tries, best kept weights first
HEADROOM = 1.1  # llama.cpp's compute buffers and the worker itself, beside the weights and the KV cache
GIB = 1 << 30

log = logging.getLogger(__name__)


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


def memory_budget(memory_gib: float, gpu_mem_mb: int) -> tuple[int, str]:
    """(bytes, what they are) that `--quant auto` fits the model in: --memory-gib, else the GPU's memory when
    layers are offloaded (`gpu_mem_mb` > 0), else this machine's available RAM (MemAvailable, else all)."""
    if memory_gib > 0:
        return int(memory_gib * GIB), f"--memory-gib {memory_gib:g}"
    if gpu_mem_mb > 0:
        return gpu_mem_mb << 20, "the GPU's memory"
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        return kib << 10, "this machine's available RAM"
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def auto_weights(reply: SpecReply, build: str, max_batch: int, budget: int, where: str) -> str:
    """`worker join --quant auto`: the largest format (LARGEST_FIRST) whose weights and a full wave's KV cache
    (max_batch sequences), times HEADROOM, fit `budget` bytes; quantized ones only where the learner replays
    them (its llama.cpp build is `build`, and the run is single-turn). Sizes: the learner's (SpecReply,
    learner.train.fit). A ConfigError saying what each format needs when none fits."""
    if not reply.weights_bytes:
        raise ConfigError("--quant auto: the learner does not say how large its model is (an older "
                          "echo-rl there): choose --quant f16, q8_0, q4_k_m or q4_0 yourself")  # fmt: skip
    need = {fmt: int(HEADROOM * (reply.weights_bytes[fmt] + max_batch * reply.kv_bytes))
            for fmt in LARGEST_FIRST if fmt in reply.weights_bytes}  # fmt: skip
    out = ""
    if reply.env is not None:
        out = "multi-turn episodes are verified on 16-bit weights only"
    elif reply.quant_build != build:
        out = f"the learner replays them on llama.cpp build {reply.quant_build or '(none)'}, this worker runs {build}"
    fits = [fmt for fmt in need if need[fmt] <= budget and (fmt == "f16" or not out)]
    sizes = ", ".join(f"{fmt} {size_text(need[fmt])}" for fmt in need)
    if not fits:
        why = f"; quantized formats are out ({out})" if out else ""
        raise ConfigError(f"--quant auto: no weight format fits {where} ({size_text(budget)}; with a wave's KV "
                          f"cache: {sizes}){why}: join with a smaller --max-batch, or on a larger machine")  # fmt: skip
    log.info("--quant auto: %s fits %s (%s; with a wave's KV cache: %s)%s", fits[0], where, size_text(budget),
             sizes, f"; quantized formats are out: {out}" if out else "")  # fmt: skip
    return fits[0]


def size_text(nbytes: float) -> str:
    """1.23 GiB, 45.6 MiB or 7.8 KiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
