"""Train and held-out splits of a generated task, so that evaluation measures what training never saw.

A generated task (arithmetic, countdown, sokoban, knights-knaves) draws problems from a seed; the same
problem can come from many seeds, so disjoint seed ranges would not keep the splits apart. Instead a
problem belongs to the held-out split by its prompt's hash:

    held_out(p) = sha256(p.prompt) mod 100 < HELD_OUT_PERCENT

Training draws from the rest (a held-out draw is replaced by the next one from the same rng, so a step's
prompts stay a function of its seed); evaluation draws only held-out problems. jsonl tasks have no split:
the user's file is all training data, and `--eval-task jsonl:PATH` names its evaluation set.

An environment's episode is named by its seed, not by its first message (a game may open every episode
with the same words), so an environment splits by the seed's hash instead: training never plays a
held-out seed. Whether that also keeps initial states apart is the environment's matter (Kuhn poker has
six deals, Sokoban boards are many).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Literal

from learner.tasks import Problem, Task, TaskError
from learner.tasks.environment import EnvironmentTask

HELD_OUT_PERCENT = 10
MAX_DRAWS = 1000  # draws to find one problem of a split before the task is called too small for one

Split = Literal["all", "train", "held_out"]


def held_out(problem: Problem, by_seed: bool = False) -> bool:
    """Whether a problem belongs to the held-out split, by its prompt (an environment's: by its seed, the
    problem's answer) alone, so every process agrees."""
    digest = hashlib.sha256((str(problem.answer) if by_seed else problem.prompt).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < HELD_OUT_PERCENT


def has_split(task: Task) -> bool:
    """Generated tasks have a held-out split; a jsonl file is used whole."""
    return not task.name.startswith("jsonl:")


class SplitTask:
    """A task's train or held-out half: `sample` draws from the inner task until a problem of its split comes."""

    def __init__(self, task: Task, split: Literal["train", "held_out"]) -> None:
        self.task = task
        self.split = split
        self.name = task.name
        self.by_seed = isinstance(task, EnvironmentTask)

    def sample(self, rng: random.Random) -> Problem:
        for _ in range(MAX_DRAWS):
            problem = self.task.sample(rng)
            if held_out(problem, self.by_seed) == (self.split == "held_out"):
                return problem
        raise TaskError(
            f"task {self.name!r} has too few distinct problems for a {self.split} split ({MAX_DRAWS} draws found "
            "none): widen its task args (e.g. max_value) or pass --eval-task"
        )

    def reward(self, completion: str, answer: Any) -> float:
        return self.task.reward(completion, answer)


def split_task(task: Task, split: Split) -> Task:
    """`task` itself for "all" or for a task without a split, else its train or held-out half (of the whole
    task when `task` is a split already)."""
    task = task.task if isinstance(task, SplitTask) else task
    if split == "all" or not has_split(task):
        return task
    return SplitTask(task, split)
