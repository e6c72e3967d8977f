"""Checkpoints: weights (safetensors), optimizer and RNG state, step and config, written atomically.

RUN_DIR/checkpoints/step-000040/{model.safetensors, trainer.pt, state.json}. A checkpoint is written
to a temporary folder and renamed into place, so a crash mid-write never leaves a half checkpoint
that --resume would pick up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_file

from learner.train.data_parallel import World, full_optimizer_state, full_state, load_optimizer_state


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.glob("step-*") if p.is_dir() and (p / "state.json").exists() and not p.name.endswith(".tmp")
    )


class CheckpointError(Exception):
    """A checkpoint could not be written (the older ones are untouched) or found; the message says what to do."""


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    world: World = World(),
) -> Path | None:
    """Write a checkpoint; with several ranks every rank calls it (the weights and optimizer state are
    gathered to rank 0, which writes; the others return None). Optimizer state is keyed by parameter
    name, so a checkpoint resumes on any number of ranks."""
    weights = full_state(model, world)
    optimizer_state = full_optimizer_state(model, optimizer, world)
    if not world.leader:
        return None
    if getattr(model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # the embeddings' tensor; load_weights ties it again
    final = checkpoint_dir(run_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({name: t.contiguous().cpu() for name, t in weights.items()}, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer_state, "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    except (OSError, RuntimeError) as exc:  # torch reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(run_dir).free / 1e9
        raise CheckpointError(
            f"could not write checkpoint {final} ({exc}; {free:.1f} GB free): free disk space, then continue "
            f"with --resume from the last complete checkpoint"
        ) from None
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def find_checkpoint(target: Path, step: int | None = None) -> Path:
    """A checkpoint folder from a run directory (its newest, or the one of `step`) or a checkpoint folder."""
    if (target / "state.json").is_file() and (target / "model.safetensors").is_file():
        if step is not None and json.loads((target / "state.json").read_text())["step"] != step:
            raise CheckpointError(f"{target} is the checkpoint of another step: pass its run directory with --step")
        return target
    found = list_checkpoints(target)
    if not found:
        raise CheckpointError(f"{target} holds no checkpoint: pass a run directory or a checkpoints/step-N folder")
    if step is None:
        return found[-1]
    by_step = {int(p.name.removeprefix("step-")): p for p in found}
    if step not in by_step:
        raise CheckpointError(f"{target} has no checkpoint of step {step}; it keeps steps {sorted(by_step)}")
    return by_step[step]


def load_weights(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Restore the weights into an unsharded model (before learner.train.data_parallel.shard); return state.json."""
    load_model(model, str(path / "model.safetensors"))
    return json.loads((path / "state.json").read_text())


def load_trainer_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore optimizer (each rank keeps its shard) and RNG state."""
    # on the CPU first: a checkpoint written on a GPU resumes on any device (the optimizer moves its
    # state to its parameters' device as it loads it)
    trainer = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
    saved = trainer["optimizer"]
    if all(isinstance(k, int) for k in saved["state"]):  # written before checkpoints keyed state by name
        optimizer.load_state_dict(saved)
    else:
        load_optimizer_state(model, optimizer, saved)
    torch.set_rng_state(trainer["torch_rng"])


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore weights, optimizer and RNG state of a one-process run in place; return state.json."""
    state = load_weights(path, model)
    load_trainer_state(path, model, optimizer)
    return state
