"""Environments served by OpenEnv (openenv-core) as echo-rl environments: `--env openenv:URL`.

An OpenEnv environment is a server (FastAPI; `openenv.core.env_server.create_fastapi_app`) that holds one
environment per WebSocket session and answers `reset` and `step` messages with an observation (a JSON
object), a reward and a done flag. The learner is its client: each echo-rl episode opens its own session
(openenv's GenericEnvClient, which runs none of the environment's code here), resets it with the episode's
seed and steps it with the model's turns. A server is a service, not something a worker could replay, so
an OpenEnv environment is always hosted by the learner (`--env-host learner`; envs.episode.HostedEpisode).

- The model's turn is sent as the action {ACTION_FIELD: text}; the observation's OBSERVATION_FIELD (a
  string) is shown to the model. Both names are --env-args (`action_field`, `observation_field`), since
  OpenEnv fixes no convention; the defaults are TextArena's (`message` -> `prompt`), the one TRL's
  examples use. The server's GET /schema lists an environment's fields.
- A reward of null counts 0 (OpenEnv's reset answers carry none); any other non-number is the server's
  error. An observation is cut to MAX_OBSERVATION characters before it is tokenized.
- Every reset and step waits at most `timeout_s` seconds: a server that hangs fails the episode (finish
  `error`), it never holds a worker's lease past its deadline. All sessions run on one event loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import urllib.request
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

from envs import EnvError, EnvFactory, Step, failure

SUPPORTED = "openenv-core==0.3.0"
MAX_OBSERVATION = 100_000  # characters of one observation shown to the model
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_connecting: asyncio.Lock | None = None  # on _loop


def openenv_factory(url: str, args: dict[str, Any]) -> EnvFactory:
    """A factory of `OpenEnvEnv` episodes of the server at `url` (http:// or https://), with `args`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EnvError(f"environment 'openenv:{url}': name the server as openenv:http://HOST:PORT")
    try:
        import openenv.core  # noqa: F401 - checked here, used by each episode
    except ImportError:
        raise EnvError(f"environment 'openenv:{url}' needs openenv-core: pip install 'echo-rl[openenv]' "
                       f"(that is {SUPPORTED})") from None  # fmt: skip
    unknown = sorted(set(args) - {"action_field", "observation_field", "timeout_s"})
    if unknown:
        raise EnvError(f"environment 'openenv:{url}' has no argument {unknown[0]!r}; allowed: action_field, "
                       "observation_field, timeout_s")  # fmt: skip
    action, observation = args.get("action_field", "message"), args.get("observation_field", "prompt")
    timeout = args.get("timeout_s", 30.0)
    if not all(isinstance(f, str) and f.isidentifier() for f in (action, observation)):
        raise EnvError("OpenEnv's action_field and observation_field are field names, e.g. message and prompt")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
        raise EnvError("OpenEnv's timeout_s is a number of seconds in (0, 3600]")
    _check_schema(url, action, observation, float(timeout))
    return lambda: OpenEnvEnv(url, action, observation, float(timeout))


def _check_schema(url: str, action: str, observation: str, timeout: float) -> None:
    """Refuse a server whose actions or observations lack the fields the episode uses (its GET /schema)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=timeout) as reply:
            schema = json.loads(reply.read(1 << 20))
        fields = {part: set(schema[part]["properties"]) for part in ("action", "observation")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EnvError(f"environment 'openenv:{url}': no OpenEnv schema at {url}/schema ({failure(exc)})") from None
    for part, name in (("action", action), ("observation", observation)):
        if name not in fields[part]:
            known = ", ".join(sorted(fields[part])[:20]) or "none"
            raise EnvError(f"environment 'openenv:{url}': its {part}s have no field {name!r} (they have: {known}); "
                           f"set --env-args {part}_field=NAME")  # fmt: skip


class OpenEnvEnv:
    """One episode in its own session of an OpenEnv server (the module docstring has the rules)."""

    replayable = False  # a service: the learner hosts its episodes

    def __init__(self, url: str, action_field: str, observation_field: str, timeout_s: float) -> None:
        from openenv.core import GenericEnvClient

        self.url, self.action_field, self.observation_field = url, action_field, observation_field
        self.timeout_s = timeout_s
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)

    def reset(self, seed: int) -> str:
        self._run(_connect(self.client))
        step = self._answer(self._run(self.client.reset(seed=seed)))
        if step.done:
            raise EnvError(f"OpenEnv server {self.url} ended the episode at its reset")
        return step.observation

    def step(self, action: str) -> Step:
        return self._answer(self._run(self.client.step({self.action_field: action})))

    def close(self) -> None:
        """End the session without waiting for the server (a close that fails or hangs is its matter)."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(self.client.close(), self.timeout_s), _event_loop())
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its failure is not ours to raise

    def _answer(self, result: Any) -> Step:
        """A StepResult as a Step: the observation's text field, the reward (null: 0) and done."""
        observation = result.observation if isinstance(result.observation, dict) else {}
        text = observation.get(self.observation_field)
        if not isinstance(text, str):
            fields = ", ".join(sorted(str(k)[:40] for k in observation)[:20]) or "none"
            raise EnvError(f"OpenEnv server {self.url}'s observation has no text field {self.observation_field!r} "
                           f"(its fields: {fields}); set --env-args observation_field=NAME")  # fmt: skip
        reward = 0.0 if result.reward is None else result.reward
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            raise EnvError(f"OpenEnv server {self.url} answered a reward that is not a number: {reward!r:.40}")
        if not isinstance(result.done, bool):
            raise EnvError(f"OpenEnv server {self.url} answered a done that is not true or false: {result.done!r:.40}")
        return Step(text[:MAX_OBSERVATION], float(reward), result.done)

    def _run(self, call: Coroutine) -> Any:
        """Run `call` on the sessions' event loop and wait at most timeout_s (plus a second for the loop)."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(call, self.timeout_s), _event_loop())
        try:
            return future.result(self.timeout_s + 1)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise EnvError(f"OpenEnv server {self.url} did not answer within {self.timeout_s:g} s") from None


async def _connect(client: Any) -> None:
    """Open the session's WebSocket, one connect at a time: openenv's connect sets and restores the process's
    NO_PROXY around each, which overlapping connects would leave set."""
    global _connecting
    if _connecting is None:
        _connecting = asyncio.Lock()
    async with _connecting:
        await client.connect()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for OpenEnv sessions, on a daemon thread started at the first episode."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="openenv-sessions", daemon=True).start()
        return _loop
