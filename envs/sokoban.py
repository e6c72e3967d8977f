"""Sokoban: push every box onto a goal. Boards come from reverse play, so each one is solvable.

The board rules (generate_board, move, solved) serve both the single-turn task (learner.tasks.sokoban: all
moves in one answer) and the multi-turn game here (a few moves per turn, the board shown after each turn).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from envs import EnvError, Step

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
RULES = (
    "# is a wall, @ the player, $ a box, . a goal, * a box on a goal, + the player on a goal. "
    "Push every box onto a goal. Moves are the letters U (up), D (down), L (left), R (right)."
)


def generate_board(rng: random.Random, size: int, boxes: int, pulls: int) -> str:
    """A solvable `size` x `size` board (walls included) with `boxes` boxes, `pulls` reverse moves scrambled:
    boxes placed on goals, then the player walks backwards, pulling boxes away from the goals."""
    while True:
        board = _scramble(rng, size, boxes, pulls)
        if board is not None:
            return board


def _scramble(rng: random.Random, n: int, n_boxes: int, pulls: int) -> str | None:
    walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
    for _ in range(rng.randint(0, n // 2)):  # a few inner walls
        walls.add((rng.randint(2, n - 3), rng.randint(2, n - 3)))
    free = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1) if (r, c) not in walls]
    spots = rng.sample(free, n_boxes + 1)
    goals = set(spots[:n_boxes])
    boxes = set(goals)
    player = spots[-1]
    for _ in range(pulls * 4):
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


def last_moves(text: str, limit: int) -> str:
    """The last run of U/D/L/R letters written as a word in `text`, at most `limit` of them ("" if none)."""
    runs = re.findall(r"\b[UDLR]+\b", text[-4000:])
    return runs[-1][:limit] if runs else ""


@dataclass
class SokobanEnv:
    """Sokoban as a game of turns: each turn the model writes some moves (its last run of U/D/L/R letters,
    at most `moves_per_turn`), the environment plays them and shows the board. Reward 1 and the episode ends
    when every box is on a goal; a turn without moves is told so. The board: a `size` x `size` room with
    `boxes` boxes scrambled by `pulls` reverse moves (learner.tasks.sokoban's knobs)."""

    size: int = 6
    boxes: int = 1
    pulls: int = 8
    moves_per_turn: int = 4

    def __post_init__(self) -> None:
        check_board_args(self.size, self.boxes, self.pulls)
        if not 1 <= self.moves_per_turn <= 50:
            raise EnvError("sokoban: moves_per_turn must be between 1 and 50")
        self.walls: set = set()
        self.goals: set = set()
        self.box_set: frozenset = frozenset()
        self.player = (0, 0)

    def reset(self, seed: int) -> str:
        board = generate_board(random.Random(seed), self.size, self.boxes, self.pulls)
        self.walls, self.goals, boxes, self.player = parse(board)
        self.box_set = frozenset(boxes)
        return (
            f"Let's play Sokoban. {RULES} Each turn, answer with up to {self.moves_per_turn} moves, e.g. "
            f"RRU; I will show you the board after them.\n\n{board}"
        )

    def step(self, action: str) -> Step:
        moves = last_moves(action, self.moves_per_turn)
        if not moves:
            return Step("No moves found. Answer with letters U, D, L, R.\n\n" + self.board())
        for direction in moves:
            self.box_set, self.player = move(self.walls, self.box_set, self.player, direction)
        if self.box_set == self.goals:
            return Step(reward=1.0, done=True)
        return Step(f"After {moves}:\n\n{self.board()}")

    def board(self) -> str:
        return render(self.size, self.walls, self.goals, set(self.box_set), self.player)


def check_board_args(size: int, boxes: int, pulls: int) -> None:
    if not 5 <= size <= 10:
        raise EnvError("sokoban: size must be between 5 and 10")
    if not 1 <= boxes <= 3:
        raise EnvError("sokoban: boxes must be between 1 and 3")
    if not 1 <= pulls <= 100:
        raise EnvError("sokoban: pulls must be between 1 and 100")
