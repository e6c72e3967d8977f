"""The llama.cpp engine: many sequences per decode call, sampling in our code.

llama-cpp-python's high-level API decodes one sequence at a time and its logprobs path is slow. Here
the low-level API decodes every live sequence of a wave in one `llama_decode` call: the G completions
of a prompt share the prompt's KV cells (`llama_memory_seq_cp`). The engine gives next-token logits to
worker.sampling.generate_waves, which draws every token from the lease's counter-based stream (p2p.draws)
with its exact behaviour logprob.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from p2p.config import ConfigError
from p2p.messages import Completion, GenerationRequest, ModelSpec, SamplingParams, is_adapter
from p2p.weights import lora_deltas, to_float32
from worker.gguf_writer import (
    GGUFLayout,
    gguf_arrays,
    unsupported_by_llama_layout,
    unsupported_by_writer,
    write_gguf,
    write_lora_gguf,
)
from worker.quantize import QUANT_TYPES, llamacpp_build, quantize_gguf
from worker.sampling import WaveReplay, generate_waves, replay_wave

log = logging.getLogger(__name__)


@llama_cpp.llama_log_callback
def _route_llamacpp_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Send llama.cpp's own messages to our logger: errors as errors, the rest (its warnings too: the one it
    always prints here says our unified KV cache is longer than the model's context, as intended) as debug."""
    message = text.decode("utf-8", errors="replace").rstrip()
    if message:  # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation
        log.log(logging.ERROR if level == 4 else logging.DEBUG, "llama.cpp: %s", message)


llama_cpp.llama_log_set(_route_llamacpp_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()

GPU_ALL_LAYERS = 999  # llama.cpp offloads min(n_gpu_layers, the model's layers + output)


def llamacpp_backends() -> list[str]:
    """The compute backends this llama.cpp build registered, e.g. ["CUDA", "CPU"], from its system info
    ("CUDA : ARCHS = 890 | ... | CPU : SSE3 = 1 | ..."): every segment naming a backend has " : "."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return [seg.split(" : ")[0].strip() for seg in info.split(" | ") if " : " in seg]


def gpu_backend() -> str:
    """The GPU backend llama.cpp was built with ("CUDA", "Metal", "Vulkan", ...), or "" for a CPU build."""
    if not llama_cpp.llama_supports_gpu_offload():
        return ""
    return next((b for b in llamacpp_backends() if b not in ("CPU", "BLAS")), "GPU")


def gpu_device() -> dict[str, str | int]:
    """Name and memory of the NVIDIA GPU llama.cpp offloads to first (nvidia-smi: llama-cpp-python hides ggml's
    devices); {} for none, a MIG slice (not its GPU's memory) or no nvidia-smi (Metal, Vulkan of other vendors)."""
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()  # `--gpu N` sets it (PCI order)
    if not index or index.startswith("MIG-"):
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=name,memory.total", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()[0]
        name, mem = out.rsplit(",", 1)
        return {"gpu": name.strip(), "gpu_mem_mb": int(mem)}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


@dataclass
class StagedLlama:
    """A version loaded beside the live one, waiting for install()."""

    model: llama_cpp.llama_model_p | None  # a new model, or None: the adapters go on the loaded one
    adapter: llama_cpp.llama_adapter_lora_p | None
    eos_ids: set[int]
    base: dict[str, np.ndarray] | None = None  # with a new model: the base later adapters merge onto


class LlamaCppEngine:
    """Generates groups of completions with llama.cpp from a GGUF file.

    Waves: at most `max_batch` sequences are alive at once, so a wave holds floor(max_batch / G) prompt
    groups. A wave prefills its prompts, copies each prompt's cache to its G sequences, then decodes one
    token for every live sequence per call until all have stopped.
    """

    def __init__(
        self, work_dir: str | Path, threads: int = 2, max_batch: int = 32, gpu_layers: int = -1, quant: str = "f16"
    ) -> None:
        if quant != "f16" and quant not in QUANT_TYPES:
            raise ConfigError(f"unknown weight format {quant!r}: choose f16 or {', '.join(QUANT_TYPES)}")
        if gpu_layers > 0 and not gpu_backend():  # before any state: nothing to free
            raise ConfigError(
                f"--gpu-layers {gpu_layers}: this llama-cpp-python was built for the CPU only; rebuild it with "
                "ECHO_RL_GPU=cuda ./scripts/setup.sh (or metal, vulkan), or use --gpu-layers 0"
            )
        # -1: every layer on the GPU when this build of llama.cpp has a GPU backend (CUDA, Metal, Vulkan...)
        self.gpu_layers = (GPU_ALL_LAYERS if gpu_backend() else 0) if gpu_layers < 0 else gpu_layers
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.threads = threads
        self.max_batch = max_batch
        self.quant = quant  # f16, or llama.cpp's quantization of each version's F16 GGUF (worker.quantize)
        self.n_batch = 512  # tokens per llama_decode call during prefill
        self.model: llama_cpp.llama_model_p | None = None
        self.ctx: llama_cpp.llama_context_p | None = None
        self.n_ctx = 0
        self.n_vocab = 0
        self.eos_ids: set[int] = set()
        self.adapter: llama_cpp.llama_adapter_lora_p | None = None  # LoRA adapters on the model, if any
        self.base: dict[str, np.ndarray] = {}  # outside the llama layout, a LoRA run's base (adapters merged)
        self._layout: tuple[ModelSpec, GGUFLayout] | None = None  # of the last GGUF written, to reuse
        self._next_pos: list[int] = []  # per sequence of the wave being generated: its next token's position

    # -- weights --------------------------------------------------------------------------------
    # Staging runs on the worker's fetcher thread while generate() runs on the main thread with the loaded
    # model: it writes the GGUF and loads a second model (or adapters) beside the live one. install()
    # swaps between leases and frees the old model; only the fetcher stages, one version at a time.

    def stage(
        self, spec: ModelSpec, weights: Mapping[str, np.ndarray] | None, adapters: Mapping[str, np.ndarray] | None
    ) -> StagedLlama:
        """Load `weights` (None: keep the loaded model) and `adapters` on top, ready for install().
        Wire tensors as they are (f16 goes into the F16 GGUF without a float32 round trip) or floats.

        Adapters in the llama layout are a GGUF LoRA llama.cpp hot-swaps. Other layouts have no adapter
        writer (llama.cpp's converter maps base tensors, not adapters), so the engine keeps the base weights
        and merges, W = W_base + (alpha / r) B A, into a new model file: the adapters still travel alone,
        but every version is a full rewrite and the worker holds the base beside llama.cpp's copy."""
        if reason := self.unsupported(spec):
            raise ConfigError(reason)
        merge = bool(spec.lora_rank) and unsupported_by_llama_layout(spec) is not None
        model, base = None, None
        if weights is not None:
            weights = {name: a if a.dtype == np.float16 else to_float32(a) for name, a in weights.items()}
            base = weights if merge else None
            if not (merge and adapters):  # else the merged weights are the ones loaded
                model = self._load_model(self._model_file(spec, weights))
        adapter = None
        if adapters and merge:
            kept = base if base is not None else self.base
            if not kept:
                raise RuntimeError("no base weights kept: stage weights before adapters")
            merged = dict(kept)
            for name, delta in lora_deltas(adapters, spec.lora_alpha / spec.lora_rank):
                merged[name] = to_float32(kept[name]) + delta
            model, base = self._load_model(self._model_file(spec, merged)), kept
        elif adapters:
            target = model or self.model
            if target is None:
                raise RuntimeError("no policy loaded: stage weights before adapters")
            adapters = {name: to_float32(a) for name, a in adapters.items()}
            path = write_lora_gguf(self.work_dir / "adapters.gguf", spec, adapters)
            adapter = llama_cpp.llama_adapter_lora_init(target, str(path).encode())
            if not adapter:
                if model is not None:
                    llama_cpp.llama_model_free(model)
                raise RuntimeError(f"llama.cpp could not load the LoRA adapter {path}")
        return StagedLlama(model, adapter, set(spec.eos_ids), base)

    def install(self, staged: StagedLlama) -> None:
        """Swap a staged model and/or adapters in (between leases): the KV cache held the old policy."""
        if staged.model is not None:
            self.close()
            self.model = staged.model
            self.base = staged.base or {}
            self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(staged.model))
            self.eos_ids = staged.eos_ids
        if staged.adapter is not None:
            old, self.adapter = self.adapter, staged.adapter
            if self.ctx is not None:
                self._set_adapter()
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
            if old is not None:
                llama_cpp.llama_adapter_lora_free(old)

    def discard(self, staged: StagedLlama) -> None:
        """Free a staged version that will not be installed."""
        if staged.adapter is not None:
            llama_cpp.llama_adapter_lora_free(staged.adapter)
        if staged.model is not None:
            llama_cpp.llama_model_free(staged.model)

    def _write(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> Path:
        """The weights as an F16 GGUF, renamed into place (the live model's mmap keeps the file it was
        loaded from): the first time whole, then into the same layout with the metadata copied."""
        path = self.work_dir / "policy.gguf"
        arrays = gguf_arrays(spec, weights)
        if self._layout is not None and self._layout[0] == spec and self._layout[1].fits(arrays):
            return self._layout[1].write(path, arrays)
        path = write_gguf(path, spec, weights, name="echo-rl policy")  # prompts arrive as token ids
        self._layout = (spec, GGUFLayout.of(path))
        return path

    def _model_file(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> Path:
        """The GGUF llama.cpp loads: the F16 one, or (--quant) llama.cpp's quantization of it, renamed into place."""
        path = self._write(spec, weights)
        if self.quant == "f16":
            return path
        quantized = self.work_dir / f"policy.{self.quant}.gguf"
        quantize_gguf(path, quantized.with_suffix(".tmp"), self.quant, self.threads)
        os.replace(quantized.with_suffix(".tmp"), quantized)
        return quantized

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """Convert float weights to an F16 GGUF in the work dir and load it; LoRA adapters among the
        tensors (a LoRA run's full snapshot) go on top."""
        base = {name: a for name, a in tensors.items() if not is_adapter(name)}
        adapters = {name: a for name, a in tensors.items() if is_adapter(name)}
        self.install(self.stage(spec, base, adapters or None))

    def load_adapters(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None:
        """LoRA adapters onto the loaded model: hot-swapped in the llama layout, else merged (see stage)."""
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        self.install(self.stage(spec, None, tensors))

    def _set_adapter(self) -> None:
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self.adapter)
        scales = (ctypes.c_float * 1)(1.0)  # llama.cpp multiplies by the file's alpha / rank itself
        if llama_cpp.llama_set_adapters_lora(self.ctx, adapters, 1, scales) != 0:
            raise RuntimeError("llama.cpp refused to set the LoRA adapter on its context")

    def load_gguf(self, path: str | Path, eos_ids: Sequence[int]) -> None:
        self.install(StagedLlama(self._load_model(path), None, set(eos_ids)))

    def _load_model(self, path: str | Path) -> llama_cpp.llama_model_p:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = self.gpu_layers
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}: is it a valid GGUF of a llama model?")
        return model

    @property
    def model_bytes(self) -> int:
        """Bytes of the loaded model's tensors (what its file maps into memory)."""
        return int(llama_cpp.llama_model_size(self.model)) if self.model is not None else 0

    def unsupported(self, spec: ModelSpec) -> str | None:
        """Why this engine cannot run `spec`'s model: one worker.gguf_writer cannot write."""
        if reason := unsupported_by_writer(spec):
            return f"the llama.cpp engine does not run this model ({reason}): use --engine transformers"
        return None

    def backend(self) -> dict[str, str | int]:
        """What this engine computes on, for the heartbeat: the GPU backend when layers are offloaded, and the
        weight format (with the build a verifier must share to replay quantized weights)."""
        weights = {"weights": self.quant} | ({"build": self.build} if self.quant != "f16" else {})
        return self._offload() | weights

    def _offload(self) -> dict[str, str | int]:
        if not self.gpu_layers:
            return {"backend": "cpu"}
        return {"backend": gpu_backend().lower(), "gpu_layers": self.gpu_layers, **gpu_device()}

    @property
    def build(self) -> str:
        """The llama.cpp build this engine decodes on, as a verifier must share it (worker.quantize)."""
        return llamacpp_build(str(self._offload()) if self.gpu_layers else "")

    def close(self) -> None:
        self._free_context()
        self.discard(StagedLlama(self.model, self.adapter, set()))  # the live model and adapters
        self.model = self.adapter = None

    def __del__(self) -> None:
        # a constructor that raised has nothing to free; at interpreter exit llama_cpp may be torn down already
        if hasattr(self, "ctx") and not sys.is_finalizing():
            self.close()

    def _free_context(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
            self.n_ctx = 0

    def _ensure_context(self, n_ctx: int) -> None:
        """(Re)create the context if the wave needs more KV cells than it has."""
        if self.ctx is not None and self.n_ctx >= n_ctx:
            return
        self._free_context()
        n_ctx = max(n_ctx, 512)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = self.max_batch
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.kv_unified = True  # one cache for all sequences, so a prompt's cells are shared, not copied
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.ctx, self.n_ctx = ctx, n_ctx
        if self.adapter is not None:
            self._set_adapter()

    # -- generation -----------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        """Complete every request `group_size` times; returns one list of completions per request."""
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        if too_big := [r.group_size for r in requests if r.group_size > self.max_batch]:
            raise ConfigError(f"group size {too_big[0]} exceeds max_batch {self.max_batch}")
        return generate_waves(self, requests, params, self.eos_ids, self.max_batch)

    def replay(
        self, request: GenerationRequest, completions: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[WaveReplay]:
        """A group drawn alone fed back in its wave's layout (worker.sampling.replay_wave): the learner's replay of
        a quantized worker on this build."""
        if self.model is None:
            raise RuntimeError("no policy loaded: call load_policy() first")
        return replay_wave(self, request, completions, params)

    # -- next-token logits for worker.sampling.generate_waves (LogitsBackend) --------------------

    def prefill(self, wave: Sequence[GenerationRequest], max_new_tokens: int) -> np.ndarray:
        """Request k's prompt goes to its first sequence, whose cells its G - 1 siblings then share
        (llama_memory_seq_cp on a unified cache): the prompt is read once per group."""
        n_seqs = sum(r.group_size for r in wave)
        self._ensure_context(sum(len(r.prompt_ids) for r in wave) + n_seqs * max_new_tokens + 16)
        memory = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_clear(memory, True)
        first_seq = np.cumsum([0] + [r.group_size for r in wave[:-1]]).tolist()
        flat = [  # keep the logits of each prompt's last token only
            (tok, pos, first_seq[k], pos == len(r.prompt_ids) - 1)
            for k, r in enumerate(wave)
            for pos, tok in enumerate(r.prompt_ids)
        ]
        prompt_logits = np.concatenate(
            [self._decode(flat[start : start + self.n_batch]) for start in range(0, len(flat), self.n_batch)]
        )  # [len(wave), V] in request order
        for k, r in enumerate(wave):
            for j in range(1, r.group_size):
                llama_cpp.llama_memory_seq_cp(memory, first_seq[k], first_seq[k] + j, -1, -1)
        self._next_pos = [len(r.prompt_ids) for r in wave for _ in range(r.group_size)]  # per sequence
        return np.repeat(prompt_logits, [r.group_size for r in wave], axis=0)  # [n_seqs, V]

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token for each live sequence, all in one llama_decode call."""
        logits = self._decode([(tok, self._next_pos[s], s, True) for s, tok in zip(seqs, tokens, strict=True)])
        for s in seqs:
            self._next_pos[s] += 1
        return logits  # [len(seqs), V]

    def release(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), seq, -1, -1)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits [T, V] at every position of one sequence (for checks against torch)."""
        self._ensure_context(len(tokens) + 16)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        entries = [(tok, pos, 0, True) for pos, tok in enumerate(tokens)]
        return np.concatenate(
            [self._decode(entries[s : s + self.n_batch]) for s in range(0, len(entries), self.n_batch)]
        )

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, position, sequence, wants_logits) entries in one call; return their logits."""
        n = len(entries)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            n_out = 0
            for i, (tok, pos, seq, want) in enumerate(entries):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
                n_out += want
            batch.n_tokens = n
            rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} (KV cache of {self.n_ctx} too small?)")
            if n_out == 0:
                return np.zeros((0, self.n_vocab), dtype=np.float32)
            ptr = llama_cpp.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_out, self.n_vocab)).copy()
        finally:
            llama_cpp.llama_batch_free(batch)
