"""Inference engines. Each has `load_policy(spec, tensors)` and `generate(requests, params)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_engine(name: str, work_dir: str | Path, threads: int, max_batch: int) -> Any:
    """Build the engine called `name` (llamacpp or transformers); imports only what it needs."""
    if name == "llamacpp":
        from worker.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(work_dir, threads=threads, max_batch=max_batch)
    if name == "transformers":
        from worker.engines.hf import TransformersEngine

        return TransformersEngine(threads=threads)
    raise ValueError(f"unknown engine {name!r}; choose llamacpp or transformers")
