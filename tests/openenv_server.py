"""An OpenEnv environment server for the tests (envs/openenv_env.py): a number-guessing game whose every
observation after the first carries a random nonce and the clock, so no worker could replay it. `serve()`
runs it on 127.0.0.1 in a thread of the calling process, as `openenv serve` would run it anywhere else."""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import time
import warnings
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app


class GuessAction(Action):
    message: str  # the model's turn (TextArena's field name: envs.openenv_env's default)


class GuessObservation(Observation):  # + done, reward
    prompt: str = ""


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess a number in [1, 4] within 3 tries: reward 1 for a hit."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.secret = State(), 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, 4)
        return GuessObservation(prompt="Guess my number from 1 to 4. Reply with one number.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        guesses = re.findall(r"\d+", action.message)
        if guesses and int(guesses[-1]) == self.secret:
            return GuessObservation(prompt="", reward=1.0, done=True)
        hint = "no number" if not guesses else "higher" if int(guesses[-1]) < self.secret else "lower"
        nonce = os.urandom(4).hex()  # what makes an episode impossible to replay
        return GuessObservation(prompt=f"{hint} (game {nonce} at {time.time_ns()})", reward=0.0,
                                done=self._state.step_count >= 3)  # fmt: skip

    @property
    def state(self) -> State:
        return self._state


def serve() -> tuple[str, uvicorn.Server]:
    """Serve GuessEnv on a free port of 127.0.0.1 in a daemon thread; its URL and the server (should_exit)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # uvicorn's legacy websockets protocol: the sans-io one logs a traceback whenever openenv 0.3.0 closes a
    # session the client closed first
    warnings.filterwarnings("ignore", "The `websockets` implementation is deprecated", module="uvicorn")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="websockets")
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=256)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", ws="websockets"))
    threading.Thread(target=server.run, name="openenv-test-server", daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the OpenEnv test server did not start"
    return f"http://127.0.0.1:{port}", server
