"""Knights and knaves: knights always tell the truth, knaves always lie. Who is who?"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from learner.tasks import Problem, TaskError

NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]

# A statement is (kind, a, b); it is evaluated on an assignment (True = knight).
KINDS = ("is_knight", "is_knave", "both_knights", "either_knave", "same", "different")


def holds(kind: str, a: int, b: int, world: tuple[bool, ...]) -> bool:
    return {
        "is_knight": world[a],
        "is_knave": not world[a],
        "both_knights": world[a] and world[b],
        "either_knave": (not world[a]) or (not world[b]),
        "same": world[a] == world[b],
        "different": world[a] != world[b],
    }[kind]


def say(kind: str, a: str, b: str) -> str:
    return {
        "is_knight": f"{a} is a knight.",
        "is_knave": f"{a} is a knave.",
        "both_knights": f"{a} and {b} are both knights.",
        "either_knave": f"{a} or {b} is a knave.",
        "same": f"{a} and {b} are the same kind.",
        "different": f"{a} and {b} are different kinds.",
    }[kind]


@dataclass
class KnightsKnavesTask:
    """Puzzles with `min_people` to `max_people` speakers, one statement each, and a unique solution.

    Reward 1 if the completion states the right kind for every person (the last mention counts).
    """

    min_people: int = 2
    max_people: int = 3
    name: str = "knights-knaves"

    def __post_init__(self) -> None:
        if not 2 <= self.min_people <= self.max_people <= 5:
            raise TaskError("knights-knaves: need 2 <= min_people <= max_people <= 5")

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_people, self.max_people)
        names = rng.sample(NAMES, n)
        while True:
            truth = tuple(rng.random() < 0.5 for _ in range(n))
            statements = []
            for speaker in range(n):
                while True:
                    kind = rng.choice(KINDS)
                    a, b = rng.sample(range(n), 2)
                    if holds(kind, a, b, truth) == truth[speaker]:  # knights speak truly, knaves falsely
                        statements.append((speaker, kind, a, b))
                        break
            worlds = [
                w
                for w in itertools.product([True, False], repeat=n)
                if all(holds(k, a, b, w) == w[s] for s, k, a, b in statements)
            ]
            if worlds == [truth]:
                break
        lines = [f'{names[s]} says: "{say(k, names[a], names[b])}"' for s, k, a, b in statements]
        prompt = (
            "On an island, knights always tell the truth and knaves always lie. "
            + " ".join(lines)
            + " Who is a knight and who is a knave? End with one line like: "
            + ", ".join(f"{nm}: knight" for nm in names[:2])
        )
        answer = {nm: ("knight" if k else "knave") for nm, k in zip(names, truth, strict=True)}
        return Problem(prompt, answer)

    def reward(self, completion: str, answer: dict) -> float:
        text = completion[-4000:]
        for name, kind in answer.items():
            found = re.findall(rf"\b{name}\b\W*(?:is\s+)?(?:an?\s+)?(knight|knave)", text, flags=re.IGNORECASE)
            if not found or found[-1].lower() != kind:
                return 0.0
        return 1.0
