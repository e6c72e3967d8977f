"""Environments that make_env must refuse, each with one line (tests/test_envs.py)."""

from envs import Step


class Broken:
    """Fails its first episode."""

    def reset(self, seed: int) -> str:
        raise RuntimeError("no board today")

    def step(self, action: str) -> Step:
        return Step(done=True)


not_a_class = 3
