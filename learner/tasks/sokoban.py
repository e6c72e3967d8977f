"""Sokoban in one answer: the whole solution as one run of moves (envs.sokoban has the board rules and the
multi-turn game)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs import EnvError
from envs.sokoban import check_board_args, generate_board, last_moves, solved
from learner.tasks import Problem, TaskError

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
        try:
            check_board_args(self.size, self.boxes, self.pulls)
        except EnvError as exc:
            raise TaskError(str(exc)) from None

    def sample(self, rng: random.Random) -> Problem:
        board = generate_board(rng, self.size, self.boxes, self.pulls)
        prompt = (
            "Solve this Sokoban puzzle. # is a wall, @ the player, $ a box, . a goal, * a box on a goal, "
            "+ the player on a goal. Push every box onto a goal. Answer with the moves as letters "
            "U (up), D (down), L (left), R (right), e.g. RRUL, on the last line.\n\n" + board
        )
        return Problem(prompt, board)

    def reward(self, completion: str, answer: str) -> float:
        moves = last_moves(completion, MAX_MOVES)
        return 1.0 if moves and solved(answer, moves) else 0.0
