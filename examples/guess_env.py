"""A multi-turn environment of your own, as README.md and docs/environments.md show it:

    echo-rl learner start --colocated --env examples.guess_env:GuessEnv --env-args high=8 --max-turns 4

(run from the repository's root, or put this folder on PYTHONPATH and name it guess_env:GuessEnv).
"""

import random
import re

from envs import Step


class GuessEnv:
    """Guess a number in [1, high]: each wrong guess is answered "higher" or "lower"; reward 1 for a hit."""

    def __init__(self, high: int = 16) -> None:
        self.high = high

    def reset(self, seed: int) -> str:  # the episode drawn by `seed`: its first user message
        self.secret = random.Random(seed).randint(1, self.high)
        return f"I am thinking of a number from 1 to {self.high}. Guess it: reply with one number."

    def step(self, action: str) -> Step:  # the model's turn as text -> observation, reward, done
        guesses = re.findall(r"\d+", action)
        if not guesses:
            return Step("Reply with one number.")
        if int(guesses[-1]) == self.secret:
            return Step(reward=1.0, done=True)
        return Step("higher" if int(guesses[-1]) < self.secret else "lower")
