"""A user's own environment, as `--env tests.guess_env:GuessEnv` loads it (the plugin tests)."""

import random
import re

from envs import Step


class GuessEnv:
    """Guess a number in [1, high]: each wrong guess is answered "higher" or "lower"; reward 1 for a hit."""

    def __init__(self, high: int = 16) -> None:
        self.high = high
        self.secret = 1

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(1, self.high)
        return f"I am thinking of a number from 1 to {self.high}. Guess it; I will say higher or lower."

    def step(self, action: str) -> Step:
        numbers = re.findall(r"\d+", action)
        if not numbers:
            return Step("Say a number.")
        guess = int(numbers[-1])
        if guess == self.secret:
            return Step(reward=1.0, done=True)
        return Step("higher" if guess < self.secret else "lower")


class Broken:
    """Fails its first episode: make_env reports it in one line."""

    def reset(self, seed: int) -> str:
        raise RuntimeError("no board today")

    def step(self, action: str) -> Step:
        return Step(done=True)


not_a_class = 3
