"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and trackio, each optional.

Every tracker gets each step's numbers under metrics.jsonl's own names, nested keys joined by "/"
(`reward_mean`, `seconds/train`, `eval/accuracy`), at the step's number, so a run reads the same in all.

- TensorBoard (`--tensorboard`): RUN_DIR/tensorboard.
- W&B (`--wandb`, `pip install 'echo-rl[wandb]'`): online when the user is logged in (WANDB_API_KEY, or
  `wandb login`'s entry in ~/.netrc), else offline under RUN_DIR/wandb (`wandb sync` uploads it later);
  WANDB_MODE, when set, decides. A resumed run continues the same W&B run (its id comes from RUN_DIR).
- trackio (`--trackio`, `pip install 'echo-rl[trackio]'`): its local database (TRACKIO_DIR, by default
  ~/.cache/huggingface/trackio); `trackio show` opens the dashboard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import netrc
import os
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig
from p2p.config import ConfigError

log = logging.getLogger(__name__)


def scalar_metrics(record: dict, prefix: str = "") -> dict[str, float]:
    """A step record flattened to scalars: {"seconds": {"train": 1.2}} -> {"seconds/train": 1.2}."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            scalars |= scalar_metrics(value, name + "/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            scalars[name] = float(value)
    return scalars


def wandb_logged_in() -> bool:
    """Whether W&B has an API key: in the environment, or where `wandb login` keeps it (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Trackers:
    """The trackers a run's config turns on; `log(step, record)` sends a step to each, `close()` ends them."""

    def __init__(self, cfg: LearnerConfig, run_dir: Path) -> None:
        self.tensorboard: Any = None
        self.wandb: Any = None
        self.trackio: Any = None
        name = run_dir.resolve().name
        config = dataclasses.asdict(cfg)
        if cfg.run.tensorboard:
            SummaryWriter = _require("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.run.wandb:
            wandb = _require("wandb", "wandb", "wandb")
            mode = os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")
            run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]  # the same run on --resume
            self.wandb = wandb.init(
                project=cfg.run.project, name=name, id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                config=config,
            )  # fmt: skip
            log.info("W&B run %s (%s)", run_id, mode if mode != "offline" else f"offline: wandb sync {run_dir}/wandb")
        if cfg.run.trackio:
            self.trackio = _require("trackio", "trackio", "trackio")
            self.trackio.init(
                project=cfg.run.project, name=name, config=config, resume="allow", auto_log_cpu=False,
                auto_log_gpu=False,  # the step records carry what echo-rl measures
            )  # fmt: skip

    def log(self, step: int, record: dict) -> None:
        scalars = scalar_metrics(record)
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.trackio is not None:
            self.trackio.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.trackio is not None:
            self.trackio.finish()


def _require(module: str, package: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"run.{extra} needs the {package} package: pip install 'echo-rl[{extra}]' (or pip install {package})"
        ) from None
