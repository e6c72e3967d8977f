"""`echo-rl eval` and `echo-rl export`: what a researcher does with a run's checkpoints."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import typer
from rich.table import Table

from echo_cli.config import build_config, parse_key_values
from echo_cli.terminal import console, fail, setup_logging, user_errors

log = logging.getLogger(__name__)

TARGET_HELP = "A run directory (its newest checkpoint, or --step) or a checkpoints/step-N folder."


def checkpoint_config(target: Path, step: int | None, overrides: dict) -> tuple[Path, object]:
    """The checkpoint `target` names and its run's LearnerConfig (as saved with it), with `overrides`."""
    from learner.config import LearnerConfig
    from learner.train.checkpoint import find_checkpoint

    checkpoint = find_checkpoint(target, step)
    state_path = checkpoint / "state.json"
    saved = json.loads(state_path.read_text()).get("config", {})
    return checkpoint, build_config(LearnerConfig, saved, overrides, state_path)


def eval_command(
    target: Path = typer.Argument(..., help=TARGET_HELP),
    step: int | None = typer.Option(None, "--step", help="The checkpoint of this step (default: the newest)."),
    eval_task: str | None = typer.Option(None, "--eval-task", help="Task to evaluate on (default: the run's)."),
    eval_task_args: list[str] | None = typer.Option(None, "--eval-task-args", help="KEY=VALUE knobs of --eval-task."),
    eval_prompts: int | None = typer.Option(None, "--eval-prompts", help="Held-out prompts (default: the run's)."),
    eval_samples: int | None = typer.Option(None, "--eval-samples", help="k of pass@k (default: the run's)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of prompts and draws (default: the run's)."),
    engine: str | None = typer.Option(None, "--engine", help="llamacpp or transformers (default: the run's)."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads for generation."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Greedy accuracy and pass@k of a checkpoint on held-out prompts, as `--eval-every` measures them in a run."""
    setup_logging()
    from learner.run import evaluate_checkpoint
    from worker.engines import sampler_engine

    overrides = {
        "eval_task": eval_task, "eval_prompts": eval_prompts, "eval_samples": eval_samples, "seed": seed,
        "engine": engine, "threads": threads,
        "eval_task_args": parse_key_values(eval_task_args, "--eval-task-args") if eval_task_args else None,
    }  # fmt: skip
    try:
        checkpoint, cfg = checkpoint_config(target, step, overrides)
        with tempfile.TemporaryDirectory(prefix="echo-rl-eval-") as work_dir:
            generator = sampler_engine(cfg.sampler, cfg.model.device, work_dir)
            result = {"checkpoint": str(checkpoint), **evaluate_checkpoint(cfg, checkpoint, generator)}
            if hasattr(generator, "close"):
                generator.close()  # before its GGUF's folder goes
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if json_out:
        print(json.dumps(result))
        return
    table = Table(show_header=False, box=None, padding=(0, 2))
    for key in ("checkpoint", "step", "task", "prompts", "accuracy", "pass_at_k", "reward_mean", "seconds"):
        value = result[key]
        label = f"pass@{result['k']}" if key == "pass_at_k" else key
        table.add_row(label, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)


def export_command(
    target: Path = typer.Argument(..., help=TARGET_HELP),
    fmt: str = typer.Option(..., "--format", help="hf (a transformers folder) or gguf (an F16 GGUF for llama.cpp)."),
    step: int | None = typer.Option(None, "--step", help="The checkpoint of this step (default: the newest)."),
    out: Path | None = typer.Option(None, "--out", help="Folder to create (default: RUN_DIR/export/step-N-FORMAT)."),
    adapters: bool = typer.Option(
        False, "--adapters", help="LoRA runs: the base model and the adapters (peft folder or GGUF LoRA), not merged."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write a checkpoint's policy as a folder that transformers' from_pretrained or llama.cpp loads."""
    setup_logging()
    if fmt not in ("hf", "gguf"):
        raise fail(f"--format must be hf or gguf, got {fmt!r}")
    try:
        checkpoint, cfg = checkpoint_config(target, step, {})
        if adapters and not cfg.model.lora_rank:
            raise fail(f"--adapters: {checkpoint} trained all weights (lora_rank 0); export without --adapters")
        name = f"{checkpoint.name}-{fmt}{'-adapters' if adapters else ''}"
        out = out or checkpoint.parent.parent / "export" / name
        if out.exists():
            raise fail(f"{out} already exists: remove it or pass another --out")
        files = export_checkpoint(cfg, checkpoint, fmt, adapters, out)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if json_out:
        print(json.dumps({"checkpoint": str(checkpoint), "format": fmt, "out": str(out), "files": files}))
        return
    console.print(f"exported {checkpoint} to {out}: {', '.join(files)}", highlight=False)


def gguf_tokenizer(policy: object) -> list | None:
    """The policy's tokenizer as llama.cpp's converter writes it, so that llama.cpp tokenizes text with the
    exported GGUF as the model does; None, said in a warning, where the converter does not know it."""
    from learner.train.gguf_recipe import RecipeError, tokenizer_metadata

    try:
        return tokenizer_metadata(policy.model, policy.tokenizer)
    except RecipeError as exc:
        log.warning("%s: the GGUF holds the vocabulary as byte-level BPE with llama.cpp's default pre-tokenizer "
                    "(token ids as the model's; llama.cpp's own tokenization of text may differ)", exc)  # fmt: skip
        return None


def export_checkpoint(cfg: object, checkpoint: Path, fmt: str, adapters: bool, out: Path) -> list[str]:
    """Load `checkpoint` and write it to `out` (built beside it, renamed into place: never half a folder).

    hf: a transformers folder (`--adapters`: the base, and the adapters in out/adapter as peft saves them).
    gguf: out/model.gguf, F16 as the workers write it (`--adapters`: the base and out/adapter.gguf, a GGUF LoRA)."""
    import shutil

    from learner.train.checkpoint import load_weights
    from learner.train.export import merge_adapters, save_hf, save_peft_adapters
    from learner.train.models import load_run_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.config import ConfigError
    from p2p.messages import is_adapter
    from worker.gguf_writer import unsupported_by_llama_layout, unsupported_by_writer, write_gguf, write_lora_gguf

    policy = load_run_policy(cfg.model, cfg.run.seed)
    spec = model_spec(policy)
    if fmt == "gguf" and (reason := unsupported_by_writer(spec)):
        raise ConfigError(f"--format gguf does not write this model ({reason}): export --format hf")
    if fmt == "gguf" and adapters and (layout := unsupported_by_llama_layout(spec)):
        raise ConfigError(
            f"--format gguf --adapters writes llama-layout adapters only (this model: {layout}): export the merged "
            "model without --adapters, or --format hf --adapters for peft adapters"
        )
    load_weights(checkpoint, policy.model)
    if policy.lora_rank and not adapters:
        merge_adapters(policy)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "hf":
            save_hf(policy, tmp)
            if adapters:
                save_peft_adapters(policy, tmp / "adapter", out)
        else:
            tensors = wire_tensors(policy.model)
            base = {n: a for n, a in tensors.items() if not is_adapter(n)}
            write_gguf(tmp / "model.gguf", spec, base, tokenizer_kv=gguf_tokenizer(policy))
            if adapters:
                write_lora_gguf(tmp / "adapter.gguf", spec, {n: a for n, a in tensors.items() if is_adapter(n)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(out)
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
