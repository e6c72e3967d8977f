"""Tasks from a JSONL file of {"prompt": ..., "answer": ...} records, with a named or custom reward."""

from __future__ import annotations

import importlib
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.tasks import Problem, TaskError, last_integer

log = logging.getLogger(__name__)


def exact_int(completion: str, answer: Any) -> float:
    """1 if the last integer in the completion equals int(answer)."""
    try:
        return 1.0 if last_integer(completion) == int(answer) else 0.0
    except (TypeError, ValueError):
        return 0.0


def exact_string(completion: str, answer: Any) -> float:
    """1 if the completion's last non-empty line, stripped, equals str(answer) stripped."""
    lines = [ln.strip() for ln in completion.splitlines() if ln.strip()]
    return 1.0 if lines and lines[-1] == str(answer).strip() else 0.0


REWARDS: dict[str, Callable[[str, Any], float]] = {"exact_int": exact_int, "exact_string": exact_string}


class JsonlTask:
    """Problems drawn uniformly (seeded) from a JSONL file.

    `reward` is `exact_int`, `exact_string` or `module:function` taking (completion, answer) and
    returning a number; a custom function that raises or returns a non-number scores 0 (and is logged).
    """

    def __init__(self, path: str, reward: str = "exact_int") -> None:
        self.name = f"jsonl:{path}"
        self.records = load_records(Path(path))
        self._reward = _resolve_reward(reward)

    def sample(self, rng: random.Random) -> Problem:
        record = rng.choice(self.records)
        return Problem(record["prompt"], record["answer"])

    def reward(self, completion: str, answer: Any) -> float:
        try:
            value = float(self._reward(completion, answer))
        except Exception as exc:  # noqa: BLE001 - a user's reward must not stop training
            log.warning("reward function failed (%s: %s); scoring 0", type(exc).__name__, exc)
            return 0.0
        return value  # made finite and bounded where every reward is (learner.orchestrate.rollouts.score_groups)


def load_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise TaskError(f"jsonl task file {str(path)!r} does not exist")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or "answer" not in record:
                raise TaskError(f'{path}:{lineno}: each line must be an object with a "prompt" string and an "answer"')
            records.append(record)
    if not records:
        raise TaskError(f"jsonl task file {path} holds no records")
    return records


def _resolve_reward(spec: str) -> Callable[[str, Any], float]:
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise TaskError(f"unknown reward {spec!r}; use exact_int, exact_string or module:function")
    module_name, func_name = spec.split(":", 1)
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise TaskError(f"cannot load reward {spec!r}: {exc}") from None
    if not callable(func):
        raise TaskError(f"reward {spec!r} is not callable")
    return func
