"""Arithmetic: evaluate a short expression of integers with +, - and x."""

from __future__ import annotations

import random
from dataclasses import dataclass

from learner.tasks import Problem, TaskError, last_integer
from learner.tasks.countdown import evaluate_expression


@dataclass
class ArithmeticTask:
    """`terms` integers in [min_value, max_value] joined by operators drawn from `ops`.

    Reward 1 if the last integer in the completion equals the value, else 0.
    """

    min_value: int = 0
    max_value: int = 20
    terms: int = 2
    ops: str = "+-*"
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.min_value > self.max_value:
            raise TaskError("arithmetic: min_value must be <= max_value")
        if not 2 <= self.terms <= 6:
            raise TaskError("arithmetic: terms must be between 2 and 6")
        if not self.ops or set(self.ops) - set("+-*"):
            raise TaskError("arithmetic: ops must be a non-empty string of + - *")

    def sample(self, rng: random.Random) -> Problem:
        numbers = [rng.randint(self.min_value, self.max_value) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:], strict=True))
        value = int(evaluate_expression(expr)[0])
        shown = expr.replace("*", "x")
        return Problem(f"What is {shown}? End your answer with the number.", value)

    def reward(self, completion: str, answer: int) -> float:
        return 1.0 if last_integer(completion) == answer else 0.0
