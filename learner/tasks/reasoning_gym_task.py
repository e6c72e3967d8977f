"""`--task reasoning-gym:NAME`: one of reasoning-gym's procedural generators, scored by its own verifier.

reasoning-gym (https://github.com/open-thought/reasoning-gym) has ~100 generators (arithmetic, logic,
puzzles, games, graphs, codes...), each a dataset class whose item idx is drawn from Random(seed + idx) and
whose `score_answer(answer, entry)` is the task's verifier. Each problem here is item 0 of the generator
seeded from the step's rng, so a step's prompts are a function of its seed like every built-in task's, and
the held-out split is by prompt hash (learner.tasks.split). `--task-args` are the generator's config fields
(e.g. `min_terms=2 max_terms=3` for basic_arithmetic). The prompt asks for the answer inside
<answer></answer> (reasoning-gym's default instruction); the reward reads it with reasoning-gym's
extract_answer and never raises (a verifier that does scores 0)."""

from __future__ import annotations

import logging
import random
from typing import Any

from learner.tasks import Problem, TaskError

log = logging.getLogger(__name__)


class ReasoningGymTask:
    def __init__(self, dataset: str, **config: Any) -> None:
        try:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError:
            raise TaskError(
                f"--task reasoning-gym:{dataset} needs the reasoning-gym package: pip install 'echo-rl[reasoning-gym]'"
            ) from None
        if dataset not in DATASETS:
            close = [n for n in sorted(DATASETS) if dataset[:3] in n][:8] or sorted(DATASETS)[:8]
            raise TaskError(f"reasoning-gym has no dataset {dataset!r}; e.g. {', '.join(close)}")
        self.name = f"reasoning-gym:{dataset}"
        self.dataset, self.config = dataset, config
        self._create = reasoning_gym.create_dataset
        self.instruction = SYSTEM_PROMPTS["default"]
        self.scorer = self._generator(0)  # also checks the config once, here, with a one-line error

    def _generator(self, seed: int) -> Any:
        try:
            return self._create(self.dataset, size=1, seed=seed, **self.config)
        except (TypeError, ValueError, AssertionError) as exc:  # an unknown field, a value out of range
            raise TaskError(f"--task-args for reasoning-gym:{self.dataset}: {exc}") from None

    def sample(self, rng: random.Random) -> Problem:
        entry = self._generator(rng.getrandbits(63))[0]
        return Problem(f"{entry['question']}\n\n{self.instruction}", entry)

    def reward(self, completion: str, answer: Any) -> float:
        from reasoning_gym.utils import extract_answer

        try:
            return float(self.scorer.score_answer(extract_answer(completion), answer))
        except Exception as exc:  # noqa: BLE001 - a generator's verifier must not stop training
            log.warning("reasoning-gym:%s scoring failed (%s: %s); scoring 0", self.dataset, type(exc).__name__, exc)
            return 0.0
