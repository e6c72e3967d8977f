"""`--task reasoning-gym:NAME`: one of reasoning-gym's procedural generators, scored by its own verifier.

reasoning-gym (https://github.com/open-thought/reasoning-gym) has ~100 generators (arithmetic, logic,
puzzles, games, graphs, codes...), each a dataset class whose item idx is drawn from Random(seed + idx) and
whose `score_answer(answer, entry)` is the task's verifier. Each problem here is item 0 of the generator
seeded from the step's rng, so a step's prompts are a function of its seed like every built-in task's, and
the held-out split is by prompt hash (learner.tasks.split). `--task-args` are the generator's config fields
(e.g. `min_terms=2 max_terms=3` for basic_arithmetic). The prompt asks for the answer inside
<answer></answer> (reasoning-gym's default instruction); the reward reads it with reasoning-gym's
extract_answer and never raises (a verifier that does scores 0).

Only generators scored by reasoning-gym's base comparison (the answer string against the oracle's) are
allowed: the answer is a worker's text, and several generators' own scorers hand it to eval() or sympy's
parse_expr (code execution on the learner) until scoring runs in a sandbox. Generators whose questions
depend on Python's hash seed or on more than their seed are refused too (the held-out split and a resumed
run need the same prompts from the same seed)."""

from __future__ import annotations

import logging
import random
from typing import Any

from learner.tasks import Problem, TaskError

log = logging.getLogger(__name__)


NOT_REPRODUCIBLE = {"isomorphic_strings", "list_functions", "ransom_note"}
"""Generators whose question for a seed changes with PYTHONHASHSEED or between calls (checked 2026-11-26)."""


def allowed_generators() -> list[str]:
    """The generators a task may name: scored by the base string comparison, reproducible from their seed."""
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    return sorted(
        name for name, (cls, _) in DATASETS.items()
        if cls.score_answer is ProceduralDataset.score_answer and name not in NOT_REPRODUCIBLE
    )  # fmt: skip


class ReasoningGymTask:
    def __init__(self, dataset: str, **config: Any) -> None:
        try:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
            from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
        except ImportError:
            raise TaskError(
                f"--task reasoning-gym:{dataset} needs the reasoning-gym package: pip install 'echo-rl[reasoning-gym]'"
            ) from None
        allowed = allowed_generators()
        if dataset not in DATASETS:
            close = [n for n in allowed if dataset[:3] in n][:8] or allowed[:8]
            raise TaskError(f"reasoning-gym has no dataset {dataset!r}; e.g. {', '.join(close)}")
        if dataset not in allowed:
            why = "its questions are not reproducible from their seed" if dataset in NOT_REPRODUCIBLE else (
                "it scores answers with its own code, which may run a worker's text (eval, sympy)")  # fmt: skip
            raise TaskError(f"reasoning-gym:{dataset} is not allowed: {why}; allowed: {', '.join(allowed)}")
        self.name = f"reasoning-gym:{dataset}"
        self.dataset, self.config = dataset, config
        self._create, self._extract = reasoning_gym.create_dataset, extract_answer
        self.instruction = SYSTEM_PROMPTS["default"]
        try:  # the config checked once, here, with a one-line error: an unknown field, a value out of range
            self.scorer = self._create(self.dataset, size=1, seed=0, **self.config)
            self.scorer[0]
        except Exception as exc:  # noqa: BLE001 - a generator's own validation raises what it likes
            raise TaskError(f"--task-args for reasoning-gym:{self.dataset}: {exc}") from None

    def sample(self, rng: random.Random) -> Problem:
        seed = rng.getrandbits(32)  # some generators seed numpy, which takes 32 bits
        entry = self._create(self.dataset, size=1, seed=seed, **self.config)[0]
        return Problem(f"{entry['question']}\n\n{self.instruction}", entry)

    def reward(self, completion: str, answer: Any) -> float:
        try:
            return float(self.scorer.score_answer(self._extract(completion), answer))
        except Exception as exc:  # noqa: BLE001 - a generator's verifier must not stop training
            log.warning("reasoning-gym:%s scoring failed (%s: %s); scoring 0", self.dataset, type(exc).__name__, exc)
            return 0.0
