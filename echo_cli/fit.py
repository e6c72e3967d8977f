"""`echo-rl fit`: will a run fit on this device? (learner/train/fit.py has the formulas)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from learner.config import LearnerConfig
from learner.train.fit import RunShape, fit_report, model_shape

GIB = 1 << 30


def run_shape(cfg: LearnerConfig, colocated: bool) -> RunShape:
    """The parts of a learner config memory depends on."""
    return RunShape(
        lora_rank=cfg.model.lora_rank,
        micro_batch_tokens=cfg.grpo.micro_batch_tokens,
        grad_checkpointing=cfg.model.grad_checkpointing,
        beta=cfg.grpo.beta,
        colocated=colocated,
        engine=cfg.sampler.engine,
        versions_kept=cfg.swarm.staleness + cfg.swarm.publish_every + 1,
        wire_bytes=2,  # f16 and bf16 versions alike
        max_batch=cfg.sampler.max_batch,
        max_new_tokens=cfg.sampler.max_new_tokens,
    )


def device_memory(device: str) -> tuple[str, int]:
    """(what, bytes) of the memory the learner would use: the CUDA device's total, or the machine's RAM."""
    import torch

    from learner.train.devices import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return f"{torch.cuda.get_device_name(resolved)}", torch.cuda.get_device_properties(resolved).total_memory
    import os

    return "this machine's RAM", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def show_fit(cfg: LearnerConfig, colocated: bool, memory_gib: float | None, json_out: bool) -> bool:
    """Print the figures; whether the learner fits."""
    from learner.train.models import load_model_config

    shape = model_shape(load_model_config(cfg.model.model, cfg.model.cache_dir))
    report = fit_report(shape, run_shape(cfg, colocated))
    if memory_gib is None:
        where, memory = device_memory(cfg.model.device)
    else:
        where, memory = f"{memory_gib:g} GiB (--memory-gib)", int(memory_gib * GIB)
    report["device"] = {"name": where, "bytes": memory, "fits": report["learner_total"] <= memory}
    if json_out:
        print(json.dumps(report))
        return report["device"]["fits"]
    console = Console()  # the figures on stdout
    m = report["model"]
    console.print(
        f"{cfg.model.model}: {m['model_type']}, {m['parameters'] / 1e9:.3g}B parameters, {m['layers']} layers, "
        f"hidden {m['hidden']}, vocabulary {m['vocab']}"
    )
    table = Table("learner (float32)", "GiB", title=None)
    for part, size in report["learner"].items():
        if size:
            table.add_row(part, f"{size / GIB:.2f}")
    table.add_row("[bold]total[/]", f"[bold]{report['learner_total'] / GIB:.2f}[/]")
    console.print(table)
    verdict = "fits" if report["device"]["fits"] else "[red]does not fit[/]"
    console.print(f"on {where} ({memory / GIB:.1f} GiB): {verdict}")
    if not report["device"]["fits"]:
        console.print("  less memory: --lora-rank 16, --grad-checkpointing, a smaller --micro-batch-tokens, "
                      "or several GPUs under torchrun (FSDP2 shards weights, gradients and AdamW)")  # fmt: skip
    files = Table("worker file", "GiB")
    for quant, size in report["worker_file"].items():
        files.add_row(quant, f"{size / GIB:.2f}")
    console.print(files)
    kv = report["worker_kv_cache"] / GIB
    console.print(f"worker KV cache (F16) for {cfg.sampler.max_batch} sequences of 256 + "
                  f"{cfg.sampler.max_new_tokens} tokens: {kv:.2f} GiB")  # fmt: skip
    return report["device"]["fits"]
