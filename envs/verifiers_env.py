"""Environments of the `verifiers` package (0.1.x) as echo-rl environments: `--env verifiers:ENV_ID`.

verifiers drives an episode itself: `Environment.run_rollout(input, client, ...)` asks a client for each
model turn, calls the environment's `env_response` between turns, stops on its stop conditions and scores
the finished rollout with its rubric. echo-rl steps an environment from outside instead (a worker samples
each turn, the learner replays). This adapter turns one into the other: the rollout runs as a task on an
event loop that runs only while `reset` or `step` waits, and its client, rather than calling a model, hands
over the conversation it was asked to continue and waits for the next `step`'s action.

- ENV_ID is what `verifiers.load_environment` takes (an installed environment's module name, e.g. one
  `prime env install` or pip put there); --env-args go to its `load_environment(**args)`.
- Episode `seed` plays dataset row `seed % len(dataset)` (the environment's train dataset).
- The first user message is the row's prompt: its system and user messages' text joined by blank lines.
  Later observations are the messages `env_response` added, joined the same way.
- The return is the rubric's score of the finished rollout. An episode cut by echo-rl's budgets
  (--max-turns, --max-episode-tokens) before the environment stops is never scored: its return is 0.
- Refused with one line: tool-calling environments (their tools need structured tool calls, echo-rl's
  turns are text), rubrics with group-level rewards (the learner scores each episode alone), and datasets
  without a prompt. The environment's wall-clock `timeout_seconds` is switched off: it would count the
  worker's generation time, which the learner's replay does not have.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import signal
import threading
from collections.abc import Sequence
from typing import Any

from envs import EnvError, EnvFactory, Step, failure

SUPPORTED = "verifiers>=0.1.14,<0.2"  # the 0.1.x API: Environment.run_rollout, vf.Client, the Rubric
_loaded_envs: dict[tuple[str, str], tuple[Any, Any]] = {}  # (env_id, args) -> (environment, its dataset)
_local = threading.local()  # each thread's event loop (an asyncio loop runs in one thread)


def verifiers_factory(env_id: str, args: dict[str, Any]) -> EnvFactory:
    """A factory of `VerifiersEnv` episodes of environment `env_id` loaded with `args` (checked once here)."""
    try:
        import verifiers
    except ImportError:
        raise EnvError(
            f"environment 'verifiers:{env_id}' needs the verifiers package: pip install 'echo-rl[verifiers]' "
            f"(that is {SUPPORTED})"
        ) from None
    version = getattr(verifiers, "__version__", "unknown")
    if not (0, 1, 14) <= tuple(int(n) for n in re.findall(r"\d+", version)[:3]) < (0, 2):
        raise EnvError(f"environment 'verifiers:{env_id}': echo-rl runs {SUPPORTED}, found {version}; install that")
    _check(_loaded(env_id, args), env_id)
    return lambda: VerifiersEnv(env_id, args)


def _loaded(env_id: str, args: dict[str, Any]) -> Any:
    """The process's instance of the environment and its dataset, loaded once (make_env loads it first, in
    the main thread); the threads that replay episodes share it, each running rollouts on its own loop."""
    key = (env_id, repr(sorted(args.items())))
    if key not in _loaded_envs:
        try:
            env = _load_quietly(env_id, args)
        except Exception as exc:  # noqa: BLE001 - the environment's own loading failure, in one line
            raise EnvError(f"environment 'verifiers:{env_id}' failed to load: {failure(exc)}") from None
        if getattr(env, "timeout_seconds", None) is not None:
            env.timeout_seconds = None  # wall-clock limits would count the worker's sampling time
        _loaded_envs[key] = (env, env.get_dataset())
    return _loaded_envs[key]


def _load_quietly(env_id: str, args: dict[str, Any]) -> Any:
    """verifiers.load_environment without its side effects on the process: a verifiers Environment installs
    SIGINT and SIGTERM handlers that exit at once (a worker's SIGTERM finishes its lease first), so the
    process's handlers are put back, which also means loading in the main thread; its log records go
    through echo-rl's logging (verifiers leaves them to Python's last-resort stderr handler) and its own
    report of a failed load is silenced (the caller's EnvError says it once); the datasets progress bars
    of its dataset formatting are switched off."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("verifiers environments are loaded in the main thread (they set signal handlers)")
    import datasets
    import verifiers

    datasets.disable_progress_bars()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    logger = logging.getLogger("verifiers")
    logger.propagate, level = True, logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return verifiers.load_environment(env_id, **args)
    finally:
        logger.setLevel(level)
        for sig, handler in handlers.items():
            if handler is not None:  # None: a handler set outside Python, which Python cannot put back
                signal.signal(sig, handler)


def _check(loaded: tuple[Any, Any], env_id: str) -> None:
    env, rows = loaded
    name = f"environment 'verifiers:{env_id}'"
    if getattr(env, "tool_defs", None):
        raise EnvError(f"{name} calls tools; echo-rl's turns are text, so tool-calling environments are not supported")
    if env.requires_group_rollouts:
        raise EnvError(f"{name} has group-level reward functions; echo-rl scores each episode alone")
    if len(rows) == 0 or "prompt" not in rows.column_names:
        raise EnvError(f"{name} has an empty dataset or one without a prompt column")


class VerifiersEnv:
    """One episode of a verifiers environment, stepped turn by turn (the module docstring has the rules)."""

    def __init__(self, env_id: str, args: dict[str, Any]) -> None:
        self.env, self.rows = _loaded(env_id, args)
        self.name = f"verifiers:{env_id}"
        self.loop = _event_loop()
        self.client = _turn_client_class()(self.loop)
        self.rollout: asyncio.Task | None = None
        self.seen = 0  # messages of the conversation already shown to the model or sampled by it

    def reset(self, seed: int) -> str:
        row = dict(self.rows[seed % len(self.rows)])
        self.rollout = self.loop.create_task(self.env.run_rollout(row, self.client, "echo-rl", {}))
        asked = self._next_turn()
        if asked is None:
            raise EnvError(f"{self.name}: the rollout of row {seed % len(self.rows)} ended before the model's turn")
        self.seen = len(asked)
        return _text(asked, self.name)

    def step(self, action: str) -> Step:
        if self.rollout is None or self.client.reply is None:
            raise EnvError(f"{self.name}: step() before reset(), or after the episode ended")
        self.client.reply.set_result(action)
        asked = self._next_turn()
        if asked is None:  # the environment stopped: score the rollout
            output = self.rollout.result()
            if output.get("error"):
                raise EnvError(f"{self.name}: the rollout failed: {str(output['error']).splitlines()[0][:300]}")
            return Step(reward=float(output.get("reward") or 0.0), done=True)
        if len(asked) <= self.seen or asked[self.seen]["role"] != "assistant":
            raise EnvError(f"{self.name}: the environment rewrote the conversation; echo-rl plays linear episodes")
        added = asked[self.seen + 1 :]
        self.seen = len(asked)
        return Step(_text(added, self.name))

    def close(self) -> None:
        """Cancel a rollout left unfinished (a budget ended the episode) so the loop holds nothing of it."""
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()
            self.loop.run_until_complete(asyncio.wait([self.rollout]))
        self.rollout = None

    def _next_turn(self) -> list | None:
        """Run the rollout until it asks for the model's next turn (its conversation so far) or ends (None)."""
        asked = self.client.await_question()
        self.loop.run_until_complete(asyncio.wait([asked, self.rollout], return_when=asyncio.FIRST_COMPLETED))
        if asked.done():
            return asked.result()
        asked.cancel()
        if self.rollout.exception() is not None:
            exc = self.rollout.exception()
            raise EnvError(f"{self.name}: the rollout raised {failure(exc)}") from None
        return None


def _event_loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop


def _text(messages: Sequence[Any], name: str) -> str:
    """The text of system, user and tool messages, joined by blank lines (echo-rl shows it as one user turn)."""
    parts = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            parts.append(content)
            continue
        for part in content or []:
            if part["type"] != "text":
                raise EnvError(f"{name}: a message carries {part['type']!r} content; echo-rl shows only text")
            parts.append(part["text"])
    return "\n\n".join(p for p in parts if p)


@functools.cache
def _turn_client_class() -> type:
    """verifiers.clients.Client, specialised to answer with the actions echo-rl passes to `step`."""
    from verifiers.clients import Client
    from verifiers.types import Response, ResponseMessage

    class TurnClient(Client):
        """A verifiers client whose "model" is echo-rl: each request waits for the next action."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(None)
            self.loop = loop
            self.question: asyncio.Future | None = None  # the conversation the rollout asks to continue
            self.reply: asyncio.Future | None = None  # the action that continues it

        def await_question(self) -> asyncio.Future:
            self.question, self.reply = self.loop.create_future(), None
            return self.question

        def setup_client(self, config: Any) -> None:
            raise TypeError("echo-rl's turn client is built by the adapter, never from a verifiers ClientConfig")

        async def to_native_tool(self, tool: Any) -> Any:
            raise EnvError("tool-calling verifiers environments are not supported")

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> str:  # fmt: skip
            if self.question is None or self.question.done():
                raise EnvError("the environment asks for several model turns at once; echo-rl plays linear episodes")
            self.reply = self.loop.create_future()
            self.question.set_result(list(prompt))
            return await self.reply

        async def raise_from_native_response(self, response: str) -> None:
            return None  # an action is any text

        async def from_native_response(self, response: str) -> Any:
            message = ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
            return Response(id="echo-rl", created=0, model="echo-rl", message=message)

        async def close(self) -> None:
            return None

    return TurnClient
