"""A tool-use environment: arithmetic problems and a calculator the model may call before answering.

The calculator is a restricted evaluator, not Python: it parses the expression with `ast` and walks the tree
itself, accepting only integer literals, + - * / // % ** unary minus and parentheses, and computing exactly
(fractions). Strict limits keep a call bounded in time and memory whatever the model writes: at most
MAX_EXPRESSION characters and MAX_NODES tree nodes, every intermediate value below 10^MAX_DIGITS in magnitude,
exponents at most MAX_EXPONENT, and powers checked for size before they are computed. It reads no names,
calls nothing, imports nothing and touches no file, so it has nothing to touch.
"""

from __future__ import annotations

import ast
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from envs import EnvError, Step
from envs.tools import ToolEnv

MAX_EXPRESSION = 200  # characters
MAX_NODES = 100  # syntax-tree nodes
MAX_DIGITS = 60  # |value| < 10^60 at every step
MAX_EXPONENT = 64


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model is shown."""


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def evaluate(expr: str, ops: str = "+-*/%^~") -> tuple[Fraction, list[int]]:
    """The exact value of `expr` and the integer literals it uses, in order. `ops` limits the operators:
    + - * / (// and % with "%", ** with "^", unary minus with "~"). Raises CalcError for anything else or
    beyond the limits."""
    expr = expr.strip()
    if not expr or len(expr) > MAX_EXPRESSION:
        raise CalcError(f"an expression must have 1 to {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"an expression may have at most {MAX_NODES} parts")
    allowed = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "%", ast.Mod: "%", ast.Pow: "^"}
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return _bounded(Fraction(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and "~" in ops:
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and allowed.get(type(node.op), "?") in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise CalcError("division by zero")
            if isinstance(node.op, ast.Pow):
                _check_power(left, right)
            return _bounded(_BINARY[type(node.op)](left, right))
        what = _SYMBOLS.get(type(getattr(node, "op", None)), type(node).__name__)
        shown = " ".join(ops.replace("^", "**").replace("~", ""))
        raise CalcError(f"{what} is not allowed; use integers, {shown} and parentheses")

    return ev(tree.body), used


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= 10**MAX_DIGITS or value.denominator >= 10**MAX_DIGITS:
        raise CalcError(f"numbers are limited to {MAX_DIGITS} digits")
    return value


def _check_power(base: Fraction, exponent: Fraction) -> None:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponents must be integers up to {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    size = max(abs(base.numerator), base.denominator)
    if size > 1 and abs(exponent) * math.log10(size) >= MAX_DIGITS:  # before computing it
        raise CalcError(f"numbers are limited to {MAX_DIGITS} digits")


def show(value: Fraction) -> str:
    """A value as the model reads it: an integer, or a fraction and its decimal."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} (about {float(value):.6g})"


CALL = re.compile(r"calc\s*:\s*([^\n]*)", re.IGNORECASE)


@dataclass
class CalculatorEnv:
    """Compute a*b+c style expressions with `terms` integers of up to `digits` digits.

    Each turn either calls the calculator, writing `calc: EXPRESSION` (the first such line counts; the
    observation is its value or why it was refused), or answers: a turn without a call is the final answer
    and ends the episode, reward 1 if its last integer is the value, else 0. `call_cost` is subtracted per
    call (0: tools are free)."""

    digits: int = 3
    terms: int = 3
    call_cost: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise EnvError("calculator: digits must be between 1 and 9")
        if not 2 <= self.terms <= 5:
            raise EnvError("calculator: terms must be between 2 and 5")
        self.answer = 0

    def draw(self, seed: int) -> str:
        """The expression of episode `seed`; its value becomes the answer."""
        rng = random.Random(seed)
        numbers = [rng.randint(2, 10**self.digits - 1) for _ in range(self.terms)]
        ops = [rng.choice("+-*") for _ in range(self.terms - 1)]
        expr = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:], strict=True))
        self.answer = int(evaluate(expr)[0])
        return expr

    def reset(self, seed: int) -> str:
        expr = self.draw(seed)
        return (
            f"What is {expr}? You have a calculator. To use it, reply with calc: and an expression, e.g. "
            f"calc: {expr}\nWhen you know the value, reply with the number."
        )

    def step(self, action: str) -> Step:
        call = CALL.search(action)
        if call is not None:
            try:
                result = show(evaluate(call.group(1).strip().strip("`").strip())[0])
            except CalcError as exc:
                result = f"error: {exc}"
            return Step(f"calc: {result}", reward=-self.call_cost)
        answer = last_integer(action)
        return Step(reward=1.0 if answer == self.answer else 0.0, done=True)


def calculate(expression: str) -> str:
    """Compute an arithmetic expression exactly.

    Args:
        expression: integers, + - * / // % ** and parentheses, e.g. "12 * (3 + 4)"
    """
    try:
        return show(evaluate(expression)[0])
    except CalcError as exc:
        return f"error: {exc}"


@dataclass
class CalculatorToolEnv(CalculatorEnv, ToolEnv):
    """The calculator's problems with the calculator as a tool the model calls in its chat template's own
    tool-call format (envs.tools): `calculate(expression)`. A turn without a call is the final answer (reward 1
    if its last integer is the value, else 0); `call_cost` is subtracted per call."""

    tools = (calculate,)

    def reset(self, seed: int) -> str:
        return f"What is {self.draw(seed)}? Use the calculate tool, then reply with the number."

    def step(self, action: str) -> Step:
        return Step(reward=1.0 if last_integer(action) == self.answer else 0.0, done=True)


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (commas inside numbers allowed), or None."""
    for m in reversed(re.findall(r"-?\d[\d,]*", text[-2000:])):
        digits = m.replace(",", "")
        if digits.strip("-").isdigit() and len(digits) <= 30:
            return int(digits)
    return None
