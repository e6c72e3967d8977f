"""Kuhn poker against a fixed opponent: a game of hidden information in one or two decisions.

Three cards (J < Q < K), one to each player, one unseen; both ante 1 chip. The first player checks or bets 1;
after a check the second checks (showdown for 1) or bets; facing a bet a player calls (showdown for 2) or
folds (loses the ante). The model's seat, the deal and the opponent's mixed strategy all come from the
episode's seed, so an episode replays exactly. The reward is the model's chips won or lost (-2 to +2).

The opponent plays a fixed equilibrium strategy (Kuhn's family with alpha = 1/3: as first player it bets a K,
bluffs a J a third of the time and calls a bet with a Q two thirds of the time; as second player it bets a K
and bluffs a J a third of the time after a check, calls with a K and with a Q a third of the time), so no
strategy of the model wins more on average than the game's value: -1/18 chip per hand as first player,
+1/18 as second. A policy that ignores its card does much worse (folding a K, calling with a J).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from envs import EnvError, Step

CARDS = "JQK"
ACTIONS = ("check", "bet", "call", "fold")


@dataclass
class KuhnPokerEnv:
    """One hand of Kuhn poker; `seat` "first", "second" or "random" (drawn from the seed) for the model.

    Each model turn names an action (the last of check, bet, call, fold in its text); a move that is not legal
    there is answered with the legal ones, up to `retries` times per hand, then counts as a fold."""

    seat: str = "random"
    retries: int = 2
    history: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.seat not in ("first", "second", "random"):
            raise EnvError("kuhn-poker: seat must be first, second or random")
        if not 0 <= self.retries <= 5:
            raise EnvError("kuhn-poker: retries must be between 0 and 5")
        self.rng = random.Random(0)
        self.cards = ("J", "Q")
        self.first = True
        self.errors = 0

    def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        deal = self.rng.sample(CARDS, 2)
        self.cards = (deal[0], deal[1])  # (the model's, the opponent's)
        self.first = self.seat == "first" or (self.seat == "random" and self.rng.random() < 0.5)
        self.history, self.errors = [], 0
        intro = (
            "Kuhn poker: cards J < Q < K, we each ante 1 chip. Check or bet 1 chip; facing a bet, call or fold. "
            f"The higher card wins the pot. Your card: {self.cards[0]}. "
        )
        if self.first:
            return intro + "You act first: check or bet?"
        self.history.append(self._opponent())
        return intro + f"I act first and {self.history[0]}. Your move: " + " or ".join(self._legal()) + "?"

    def step(self, action: str) -> Step:
        words = re.findall(r"\b(check|bet|call|fold)\b", action.lower())
        legal = self._legal()
        if not words or words[-1] not in legal:
            self.errors += 1
            if self.errors > self.retries:
                return self._end(fold_by_model=True)
            return Step(f"That is not a move here. Choose {' or '.join(legal)}.")
        self.history.append(words[-1])
        if self._over():
            return self._settle()
        self.history.append(self._opponent())
        if self._over():
            return self._settle()
        return Step(f"I {self.history[-1]}. Your move: " + " or ".join(self._legal()) + "?")

    def _legal(self) -> tuple[str, ...]:
        return ("call", "fold") if self.history and self.history[-1] == "bet" else ("check", "bet")

    def _over(self) -> bool:
        h = self.history
        return h[-2:] == ["check", "check"] or h[-1] in ("call", "fold")

    def _opponent(self) -> str:
        """The opponent's move in the current history (alpha = 1/3 strategy; its card is cards[1])."""
        card, h, roll = self.cards[1], self.history, self.rng.random()
        if not h:  # opening as first player
            return "bet" if card == "K" or (card == "J" and roll < 1 / 3) else "check"
        if h == ["check"]:  # second player after a check
            return "bet" if card == "K" or (card == "J" and roll < 1 / 3) else "check"
        if h[-1] == "bet":  # facing a bet
            if card == "K" or (card == "Q" and roll < (2 / 3 if len(h) > 1 else 1 / 3)):  # len 2: it opened
                return "call"
            return "fold"
        raise AssertionError(f"no opponent move after {h}")

    def _settle(self) -> Step:
        h = self.history
        if h[-1] == "fold":
            # who folded: the players alternate, the model acting at even indices when it is first
            model_folded = (len(h) - 1) % 2 == (0 if self.first else 1)
            return self._end(fold_by_model=model_folded)
        pot_share = 2 if h[-1] == "call" else 1
        won = CARDS.index(self.cards[0]) > CARDS.index(self.cards[1])
        return Step(f"Showdown: I hold {self.cards[1]}.", reward=float(pot_share if won else -pot_share), done=True)

    def _end(self, fold_by_model: bool) -> Step:
        # a fold loses what the folder has in the pot: the ante (a bet was never called)
        return Step(f"I held {self.cards[1]}.", reward=-1.0 if fold_by_model else 1.0, done=True)
