"""Inference engines, each keeping p2p.messages.Engine: `generate(requests, params)`, `backend()` (what it
computes on, for the heartbeat) and two ways to change its weights:

- `stage(spec, weights, adapters)` prepares a version beside the live one (safe while generate() runs on
  another thread), `install(staged)` swaps it in between leases, `discard(staged)` frees one not used;
- `load_policy(spec, tensors)` and `load_adapters(spec, tensors)` do both at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from p2p.config import ConfigError


def make_engine(
    name: str, work_dir: str | Path, threads: int, max_batch: int, gpu_layers: int = -1, device: str = "auto",
    quant: str = "f16",
) -> Any:
    """Build the engine called `name` (llamacpp or transformers); imports only what it needs.

    `gpu_layers` (llama.cpp): layers offloaded to the GPU, -1 all when the build has a GPU backend.
    `device` (transformers): auto, cpu, cuda or cuda:N. `quant` (llama.cpp): the weight format it runs."""
    if name == "llamacpp":
        from worker.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(work_dir, threads=threads, max_batch=max_batch, gpu_layers=gpu_layers, quant=quant)
    if name == "transformers":
        if quant != "f16":
            raise ConfigError(f"--quant {quant} needs --engine llamacpp: the transformers engine runs 16-bit weights")
        from worker.engines.hf import TransformersEngine

        return TransformersEngine(threads=threads, max_batch=max_batch, device=device)
    raise ValueError(f"unknown engine {name!r}; choose llamacpp or transformers")


def sampler_engine(sampler: Any, device: str, work_dir: str | Path) -> Any:
    """The engine a co-located run, the Python API or `echo-rl eval` samples with: a learner's [sampler]
    section (engine, threads, max_batch, gpu_layers) on the learner's `device` (llama.cpp offloads its
    layers to a GPU when built with one, transformers runs on `device`)."""
    return make_engine(sampler.engine, work_dir, sampler.threads, sampler.max_batch, sampler.gpu_layers, device)
