"""Sokoban: push every box onto a goal. Boards come from reverse play, so each one is solvable."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from learner.tasks import Problem, TaskError

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MAX_MOVES = 200


@dataclass
class SokobanTask:
    """A `size` x `size` room (walls included) with `boxes` boxes, scrambled by `pulls` reverse moves.

    The completion's last run of U/D/L/R letters is replayed (a blocked move leaves the player where
    it is); reward 1 if every box then stands on a goal.
    """

    size: int = 6
    boxes: int = 1
    pulls: int = 12
    name: str = "sokoban"

    def __post_init__(self) -> None:
        if not 5 <= self.size <= 10:
            raise TaskError("sokoban: size must be between 5 and 10")
        if not 1 <= self.boxes <= 3:
            raise TaskError("sokoban: boxes must be between 1 and 3")
        if not 1 <= self.pulls <= 100:
            raise TaskError("sokoban: pulls must be between 1 and 100")

    def sample(self, rng: random.Random) -> Problem:
        while True:
            board = self._generate(rng)
            if board is not None:
                break
        prompt = (
            "Solve this Sokoban puzzle. # is a wall, @ the player, $ a box, . a goal, * a box on a goal, "
            "+ the player on a goal. Push every box onto a goal. Answer with the moves as letters "
            "U (up), D (down), L (left), R (right), e.g. RRUL, on the last line.\n\n" + board
        )
        return Problem(prompt, board)

    def _generate(self, rng: random.Random) -> str | None:
        """Place boxes on goals, then walk the player backwards, pulling boxes away from the goals."""
        n = self.size
        walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
        for _ in range(rng.randint(0, n // 2)):  # a few inner walls
            walls.add((rng.randint(2, n - 3), rng.randint(2, n - 3)))
        free = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1) if (r, c) not in walls]
        spots = rng.sample(free, self.boxes + 1)
        goals = set(spots[: self.boxes])
        boxes = set(goals)
        player = spots[-1]
        for _ in range(self.pulls * 4):
            dr, dc = MOVES[rng.choice("UDLR")]
            step = (player[0] + dr, player[1] + dc)
            if step in walls or step in boxes:
                continue
            behind = (player[0] - dr, player[1] - dc)  # a box behind the player follows it: a pull
            if behind in boxes and rng.random() < 0.7:
                boxes.remove(behind)
                boxes.add(player)
            player = step
        if boxes == goals:
            return None
        return render(n, walls, goals, boxes, player)

    def reward(self, completion: str, answer: str) -> float:
        runs = re.findall(r"\b[UDLR]+\b", completion[-4000:])
        if not runs:
            return 0.0
        return 1.0 if solved(answer, runs[-1][:MAX_MOVES]) else 0.0


def render(n: int, walls: set, goals: set, boxes: set, player: tuple[int, int]) -> str:
    rows = []
    for r in range(n):
        row = ""
        for c in range(n):
            p = (r, c)
            if p in walls:
                row += "#"
            elif p in boxes:
                row += "*" if p in goals else "$"
            elif p == player:
                row += "+" if p in goals else "@"
            else:
                row += "." if p in goals else " "
        rows.append(row)
    return "\n".join(rows)


def parse(board: str) -> tuple[set, set, set, tuple[int, int]]:
    walls, goals, boxes, player = set(), set(), set(), (0, 0)
    for r, line in enumerate(board.splitlines()):
        for c, ch in enumerate(line):
            p = (r, c)
            if ch == "#":
                walls.add(p)
            if ch in ".*+":
                goals.add(p)
            if ch in "$*":
                boxes.add(p)
            if ch in "@+":
                player = p
    return walls, goals, boxes, player


def move(walls: set, boxes: frozenset, player: tuple[int, int], direction: str) -> tuple[frozenset, tuple[int, int]]:
    """One move: walk, or push the box ahead if the square behind it is free; blocked moves change nothing."""
    dr, dc = MOVES[direction]
    step = (player[0] + dr, player[1] + dc)
    if step in walls:
        return boxes, player
    if step in boxes:
        beyond = (step[0] + dr, step[1] + dc)
        if beyond in walls or beyond in boxes:
            return boxes, player
        boxes = (boxes - {step}) | {beyond}
    return boxes, step


def solved(board: str, moves: str) -> bool:
    """Replay `moves` on `board`; True if all boxes end on goals."""
    walls, goals, boxes, player = parse(board)
    boxes = frozenset(boxes)
    for direction in moves:
        boxes, player = move(walls, boxes, player, direction)
    return boxes == goals
