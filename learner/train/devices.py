"""Where the learner's tensors live, and in what precision its forward passes run.

    --device auto | cpu | cuda | cuda:N     auto: cuda when torch sees a GPU, else cpu
    --precision fp32 | bf16                  bf16: matmuls in bfloat16, master weights and AdamW in float32
    --grad-checkpointing                     keep only each decoder layer's input; recompute the rest backward

Under torchrun every rank takes the GPU of its LOCAL_RANK (auto or cuda), so `cuda:N` is for one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

from learner.config import DEVICE_NAMES
from p2p.config import ConfigError


def resolve_device(name: str, ranks: int = 1) -> torch.device:
    """The torch device `name` means on this process; a one-line ConfigError if it is not here."""
    if not DEVICE_NAMES.fullmatch(name):
        raise ConfigError(f"--device {name!r}: choose auto, cpu, cuda or cuda:N")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}); use --device cpu, or install a CUDA build of torch"
        )
    if ":" in name and ranks > 1:
        raise ConfigError(f"--device {name} with {ranks} ranks: use --device cuda (each rank takes its LOCAL_RANK GPU)")
    index = int(name.split(":")[1]) if ":" in name else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16: torch.autocast runs matmuls in bfloat16 (weights stay float32); fp32: nothing changes."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def enable_grad_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant: works with frozen
    weights under LoRA and with FSDP2) instead of keeping them from the forward pass."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def grad_checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether `model` recomputes its layers' activations (transformers renamed the flag in 5.x)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else (
        "is_gradient_checkpointing")  # fmt: skip
    return bool(getattr(model, name, False))


def describe_device(device: torch.device) -> str:
    """`cpu (N threads)` or `cuda:0 NVIDIA H100 80GB HBM3 (79.1 GiB)` for the log and the metrics."""
    if device.type != "cuda":
        return f"cpu ({torch.get_num_threads()} threads)"
    props = torch.cuda.get_device_properties(device)
    return f"{device} {props.name} ({props.total_memory / 2**30:.1f} GiB)"


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Measure the peak memory of a block: {"peak_gib": ...}, filled in when the block ends.

    CUDA: torch's allocator peak on the device. CPU: the process's peak resident set (VmHWM), reset
    at the start of the block where Linux allows it (/proc/self/clear_refs), so the figure is the
    block's own peak and not the process's earlier high-water mark."""
    result: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the process's peak so far
    yield result
    result["peak_gib"] = process_peak_gib()


def give_back_freed_memory() -> None:
    """Return the heap that freed tensors leave behind to the operating system (glibc's malloc_trim).

    glibc keeps freed blocks for reuse: after a training step the process stays at about its peak
    (SmolLM2, 2 CPU threads: 7.3 GiB resident after a step, 1.9 GiB after trimming), so a sampler or
    verifier running next would add its memory on top of the step's. A no-op off glibc; CUDA memory is
    torch's caching allocator's business."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def bound_heap_growth(saving_memory: bool = False) -> None:
    """Serve large allocations (activations, gradients of big layers) by mmap, so that they go back to
    the OS when freed. glibc's default threshold rises to 32 MiB after the first large free, and the
    backward pass's freed activations then stay in a fragmented heap.

    Measured on a co-located SmolLM2 step with gradient checkpointing (docs/benchmarks.md): glibc's
    default 4.3 GiB peak; 8 MiB and up mapped 3.8 GiB at the same speed; 2 MiB and up 2.8 GiB, 12%
    slower (small blocks' pages are faulted in afresh). `saving_memory` (--grad-checkpointing: the user
    already trades compute for memory) takes 2 MiB, else 8 MiB."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, (2 if saving_memory else 8) << 20)  # M_MMAP_THRESHOLD, bytes


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return None


def current_gib() -> float:
    """This process's resident memory now (Linux VmRSS), GiB; 0 where /proc is missing."""
    return _proc_status_gib("VmRSS:") or 0.0


def _proc_status_gib(key: str) -> float | None:
    """A memory line of /proc/self/status (VmRSS:, VmHWM:) in GiB; None off Linux."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def training_state_gib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """What the policy's training state holds, GiB: weights, gradients (while a step runs: zeroed to None
    after it) and the optimizer's state (AdamW: two moments per trainable weight)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if t.ndim)
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
        "grads": sum(p.numel() * p.element_size() for p in trainable) / 2**30,
        "optimizer": opt / 2**30,
    }


def process_peak_gib() -> float:
    """This process's peak resident memory (Linux VmHWM; ru_maxrss elsewhere), GiB."""
    peak = _proc_status_gib("VmHWM:")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
