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
HEADROOM = 1.1  # on the learner's estimates of weights and KV cache (worker_memory)
PROCESS = 128 << 20  # the worker's Python with numpy and llama.cpp loaded (measured: 124 MB resident)
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


def memory_budget(memory_gib: float, offload: dict) -> tuple[int, str]:
    """(bytes, what they are) that `--quant auto` fits a worker in: --memory-gib, else the GPU's memory when
    layers are offloaded (`offload`: the engine's backend(); nvidia-smi's figure), else this machine's available
    RAM (MemAvailable, else all of it)."""
    if memory_gib > 0:
        return int(memory_gib * GIB), f"--memory-gib {memory_gib:g}"
    if offload.get("backend", "cpu") != "cpu":
        if not offload.get("gpu_mem_mb"):
            raise ConfigError(f"--quant auto: how much memory the {offload['backend']} GPU has is unknown here (no "
                              "nvidia-smi): say it with --memory-gib")  # fmt: skip
        return int(offload["gpu_mem_mb"]) << 20, "the GPU's memory"
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        return kib << 10, "this machine's available RAM"
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def worker_memory(reply: SpecReply, fmt: str, max_batch: int, on_gpu: bool) -> int:
    """Bytes a worker running `fmt` holds at its peak, from the learner's sizes (SpecReply, learner.train.fit):

        HEADROOM x (models x weights[fmt] + sequences x kv)  + raw + staging  + PROCESS + 512 x vocab x 4
        models     2, the live model and the next version staged beside it (1: LoRA adapters hot-swapped)
        sequences  max_batch (F16), or G (quantized workers draw each group alone)
        raw        the fetcher's 16-bit version, twice while a delta rebuilds (LoRA: the base once)
        staging    a version's float32 copy while its F16 GGUF is written (2 x F16's size), and that file
                   again while llama.cpp quantizes it (quantized formats)
        PROCESS    the worker's Python, and llama.cpp's compute buffer: a 512-token prefill's logits
    raw and staging are RAM, not counted against a GPU's memory. Against the peak resident memory of SmolLM2
    LoRA workers in a swarm: docs/benchmarks.md."""
    lora = reply.spec.lora_rank > 0
    models = 1 if lora and not unsupported_by_llama_layout(reply.spec) else 2
    sequences = max_batch if fmt == "f16" else min(max_batch, reply.group_size)
    f16 = reply.weights_bytes.get("f16", 0)
    in_ram = 0 if on_gpu else f16 * ((1 if lora else 2) + 2 + (fmt != "f16"))
    loaded = HEADROOM * (models * reply.weights_bytes[fmt] + sequences * reply.kv_bytes)
    return int(loaded) + in_ram + PROCESS + 512 * reply.spec.vocab_size * 4


def auto_weights(reply: SpecReply, build: str, max_batch: int, budget: int, where: str) -> str:
    """`worker join --quant auto`: the largest format (LARGEST_FIRST) the learner takes (the keys of its
    weights_bytes) whose worker_memory fits `budget` bytes; quantized ones only where the learner replays them
    (its llama.cpp build is `build`, and the run is single-turn). A ConfigError saying what each needs when
    none fits."""
    if not reply.weights_bytes:
        raise ConfigError("--quant auto: the learner does not say how large its model is (an older "
                          "echo-rl there): choose --quant f16, q8_0, q4_k_m or q4_0 yourself")  # fmt: skip
    on_gpu = "-gpu-" in build
    need = {fmt: worker_memory(reply, fmt, max_batch, on_gpu) for fmt in LARGEST_FIRST if fmt in reply.weights_bytes}
    out = ""
    if reply.env is not None:
        out = "multi-turn episodes are verified on 16-bit weights only"
    elif not reply.quant_build:
        out = "this learner does not verify quantized workers"
    elif reply.quant_build != build:
        out = f"the learner replays them on llama.cpp build {reply.quant_build}, this worker runs {build}"
    fits = [fmt for fmt in need if need[fmt] <= budget and (fmt == "f16" or not out)]
    sizes = ", ".join(f"{fmt} {size_text(need[fmt])}" for fmt in need)
    if not fits:
        why = f"; quantized formats are out ({out})" if out else ""
        fix = ("--gpu-layers 0 (quantized workers run on the CPU), or on a GPU with more memory" if on_gpu and out
               else f"--max-batch {reply.group_size} (the least KV cache), or on a larger machine"
               if max_batch > reply.group_size else "a larger --memory-gib" if where.startswith("--memory-gib")
               else "more memory free")  # fmt: skip
        raise ConfigError(f"--quant auto: no weight format fits {where} ({size_text(budget)}; a worker needs "
                          f"{sizes}){why}: join with {fix}")  # fmt: skip
    log.info("--quant auto: %s fits %s (%s; a worker needs %s)%s", fits[0], where, size_text(budget), sizes,
             f"; quantized formats are out: {out}" if out else "")  # fmt: skip
    return fits[0]


def size_text(nbytes: float) -> str:
    """1.23 GiB, 45.6 MiB or 7.8 KiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
