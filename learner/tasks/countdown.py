"""Countdown: combine given numbers with + - * / and parentheses to reach a target."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from fractions import Fraction

from envs.calculator import evaluate
from learner.tasks import Problem, TaskError

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/x×÷() .]+")


@dataclass
class CountdownTask:
    """`count` numbers in [1, max_number]; the target is the value of a random expression over some of them.

    Reward 1 if the completion's last line contains an expression that uses each given number at most
    once, only + - * / and parentheses, and evaluates exactly to the target.
    """

    count: int = 3
    max_number: int = 20
    name: str = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.count <= 6:
            raise TaskError("countdown: count must be between 2 and 6")
        if not 2 <= self.max_number <= 1000:
            raise TaskError("countdown: max_number must be between 2 and 1000")

    def sample(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            used = rng.sample(numbers, rng.randint(2, self.count))
            value = Fraction(used[0])
            for n in used[1:]:
                op = rng.choice("+-*/")
                value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
            if value.denominator == 1 and 0 < value <= 1000:
                break
        target = int(value)
        prompt = (
            f"Using the numbers {numbers}, each at most once, and the operations + - * / with parentheses, "
            f"write an expression equal to {target}. Put only the expression on the last line."
        )
        return Problem(prompt, {"numbers": numbers, "target": target})

    def reward(self, completion: str, answer: dict) -> float:
        try:
            value, used = evaluate_expression(_last_expression(completion))
        except Exception:  # noqa: BLE001 - any malformed expression simply scores 0
            return 0.0
        available = list(answer["numbers"])
        for n in used:
            if n not in available:
                return 0.0
            available.remove(n)
        return 1.0 if value == answer["target"] else 0.0


def _last_expression(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if re.search(r"\d", ln)]
    if not lines:
        raise ValueError("no expression")
    line = lines[-1].split("=")[0]
    candidates = [m.group(0) for m in _ALLOWED_CHARS.finditer(line) if re.search(r"\d", m.group(0))]
    if not candidates:
        raise ValueError("no expression")
    expr = max(candidates, key=len).replace("x", "*").replace("×", "*").replace("÷", "/")
    if len(expr) > 200:
        raise ValueError("expression too long")
    return expr


def evaluate_expression(expr: str) -> tuple[Fraction, list[int]]:
    """Evaluate + - * / over integer literals exactly; returns (value, literals used). Raises on anything else
    (envs.calculator's restricted evaluator, with its limits)."""
    return evaluate(expr, "+-*/")
