"""Replaying a quantized worker: llama.cpp's quantization of the version it claims, on the learner's own build.

A worker that runs q8_0, q4_0 or q4_k_m weights (`worker join --quant`) quantizes each signed 16-bit version
itself with llama.cpp and draws every group in a wave of its own. Its logprobs lie as far from a float replay as
another policy's would (docs/security.md), but on one llama.cpp build the same F16 GGUF quantizes to the same
blocks, and a wave fed back teacher-forced in its own layout repeats the worker's decoding bit for bit
(worker.sampling.replay_wave; neither the context's size, its sequence slots, an earlier wave nor the thread
count moved a bit on SmolLM2). So the learner quantizes the version it keeps the same way, in an engine of its
own (injected by echo_cli: learner code never imports worker), and asks for exactness:

    d = mean over tokens of |log mu_worker - log mu_replayed|      must be 0 (EXACT)
    m = max over tokens of the draw's distance from its token's interval under the replayed weights (EXACT)

Another build lands ~0.07 nats/token away (AVX2 against the same llama.cpp built without it), so only workers
declaring the learner's build get leases (learner.orchestrate.handlers); they cannot lie about it usefully: a
worker of another build, or of another format, is caught by the replay like any forger.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from p2p.host import BadRequest
from p2p.messages import WEIGHT_FORMATS, GenerationRequest, ModelSpec, SamplingParams, is_adapter

EXACT = 1e-9  # d and m of an exact replay are 0; this only absorbs a float's round trip through the wire


def declared_weights(
    hardware: dict, quant_build: str, episodes: bool, verifying: bool, formats: Sequence[str] = WEIGHT_FORMATS
) -> str:
    """The weight format a heartbeat declares, refused (BadRequest, no penalty: a worker's setting) outside the
    learner's `formats` (swarm.quant_formats and f16) or where it cannot verify it: quantized weights need its
    own llama.cpp build (`quant_build`, "" none) and single-turn groups (`episodes`: the run's are multi-turn).
    Without verification (`verifying` false) every format it takes goes."""
    weights = hardware.get("weights", "f16")
    if weights not in WEIGHT_FORMATS:
        raise BadRequest(f"unknown weight format {weights!r}: one of {', '.join(WEIGHT_FORMATS)}")
    if weights not in formats:
        raise BadRequest(f"{weights} weights: this learner takes {', '.join(formats)} only (its swarm.quant_formats)")
    if weights == "f16" or not verifying:
        return weights
    if episodes:
        raise BadRequest(f"{weights} weights: multi-turn episodes are verified on 16-bit weights only")
    if not quant_build or hardware.get("build") != quant_build:
        raise BadRequest(f"{weights} weights on llama.cpp build {hardware.get('build')!r}: this learner verifies "
                         f"quantized workers on build {quant_build or 'none'} only")  # fmt: skip
    return weights


class WaveReplayer(Protocol):
    """What the learner needs of a worker's llama.cpp engine (worker.engines.llamacpp.LlamaCppEngine)."""

    model_bytes: int  # of the model it holds

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None: ...

    def load_adapters(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None: ...

    def replay(self, request: GenerationRequest, completions: Sequence[Sequence[int]], params: SamplingParams) -> list:
        """worker.sampling.WaveReplay per completion: .drawn, .logprobs, .misses per token."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class QuantEngines:
    """What echo_cli injects where llama-cpp-python is installed: `make(fmt)` builds a llama.cpp engine that
    quantizes what it loads to `fmt`, `build` names the llama.cpp it runs (worker.quantize.llamacpp_build), and
    `unsupported(spec)` says why llama.cpp cannot run a model (None: it can)."""

    make: Callable[[str], WaveReplayer]
    build: str
    unsupported: Callable[[ModelSpec], str | None]


class QuantizedReplay:
    """One llama.cpp engine per weight format, each holding the version it replayed last (not thread-safe: the
    verifier calls it under a lock of its own, so that torch replays of 16-bit workers do not wait for it)."""

    def __init__(self, engines: QuantEngines, spec: ModelSpec) -> None:
        self.make_engine = engines.make  # weight format -> an engine that quantizes what it loads to it
        self.build = engines.build  # quantized workers must run this build
        self.spec = spec
        self.engines: dict[str, tuple[WaveReplayer, int, int | None]] = {}  # fmt -> (engine, version, base held)
        self.sizes: dict[str, int] = {}  # fmt -> bytes of the model its engine holds (read without the lock)

    def load(
        self, fmt: str, version: int, tensors: Mapping[str, np.ndarray], base: int | None,
        base_tensors: Mapping[str, np.ndarray] | None,
    ) -> WaveReplayer:  # fmt: skip
        """The engine of `fmt` holding `version` (its wire tensors; a LoRA version's adapters on base version
        `base` and its tensors, as the worker installs them: adapters onto the base it holds, else the whole
        model quantized anew)."""
        engine, loaded, loaded_base = self.engines.get(fmt, (None, -1, None))
        if engine is None:
            engine = self.make_engine(fmt)
            self.engines[fmt] = (engine, -1, None)
        if loaded != version:
            adapters = {n: a for n, a in tensors.items() if is_adapter(n)}
            if base is not None and base == loaded_base:  # adapters onto the base this engine holds already
                engine.load_adapters(self.spec, adapters)
            elif base is not None:
                base_only = {n: a for n, a in (base_tensors or {}).items() if not is_adapter(n)}
                engine.load_policy(self.spec, base_only | adapters)
            else:
                engine.load_policy(self.spec, tensors)
            self.engines[fmt] = (engine, version, version if base is None else base)  # a full version: its own base
            self.sizes[fmt] = engine.model_bytes
        return engine

    def held_bytes(self) -> int:
        """Bytes of the quantized models the engines hold (llama.cpp maps each file whole)."""
        return sum(list(self.sizes.values()))

    def close(self) -> None:
        for engine, _, _ in self.engines.values():
            engine.close()
        self.engines.clear()
        self.sizes.clear()
