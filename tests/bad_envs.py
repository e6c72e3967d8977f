"""Environments with bugs: ones make_env must refuse, each with one line, one that fails now and then, and one
that is not reproducible (tests/test_envs.py, tests/test_env_swarm.py, tests/test_hosted.py)."""

from envs import Step


class Broken:
    """Fails its first episode."""

    def reset(self, seed: int) -> str:
        raise RuntimeError("no board today")

    def step(self, action: str) -> Step:
        return Step(done=True)


class Flaky:
    """Works, except that a quarter of its seeds fail to start and odd seeds raise at the second turn; a turn
    with a digit in it earns 1."""

    def reset(self, seed: int) -> str:
        if seed % 4 == 1:
            raise KeyError(f"no level {seed}")
        self.seed, self.turn = seed, 0
        return "Say a number, then another."

    def step(self, action: str) -> Step:
        self.turn += 1
        if self.turn == 2 and self.seed % 2:
            raise ZeroDivisionError("division by zero in turn 2")
        return Step("Another.", reward=float(any(c.isdigit() for c in action)), done=self.turn == 3)


not_a_class = 3


class Noisy:
    """Not reproducible: every observation carries a fresh random nonce and the clock, as a tool calling a
    service would; a turn with a digit earns 1. Hosted by the learner (--env-host learner) it trains; played
    by a worker, the learner's replay could never match it."""

    def reset(self, seed: int) -> str:
        self.turn = 0
        return "Say a number, three times."

    def step(self, action: str) -> Step:
        import os
        import time

        self.turn += 1
        return Step(f"nonce {os.urandom(4).hex()} at {time.time():.6f}; again.",
                    reward=float(any(c.isdigit() for c in action)), done=self.turn == 3)  # fmt: skip


class RandomStart:
    """Starts each episode somewhere else whatever its seed: a group's episodes would not share their prompt."""

    def reset(self, seed: int) -> str:
        import os

        return f"Board {os.urandom(4).hex()}: your move."

    def step(self, action: str) -> Step:
        return Step(reward=1.0, done=True)
