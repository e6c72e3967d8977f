"""Environments of the `verifiers` package (0.4, its v1 API) as echo-rl environments: `--env verifiers:MODULE`.

A verifiers environment is a module that exports a Taskset (config in, Tasks out) and optionally an Env
(how one task becomes one episode: `Env.run(task, agents)`, e.g. a scripted user answering each model
turn). A Task carries its data (prompt, system prompt, answer ...), its `@vf.stop` conditions, its rubric
(`@vf.reward` and `@vf.metric` methods: the return is the weighted sum of the rewards) and its tools
(`toolsets()`: `vf.Toolset` classes whose `@vf.tool` methods the model calls).

verifiers runs a rollout itself: a harness program calls the model through an interception server, tools
run as MCP servers in subprocesses or sandboxes. echo-rl samples every model turn itself (a worker, token in
and token out) and replays it, so this adapter runs the same pieces in-process instead, on an event loop of
the episode's own that runs only while `reset`, `step` or `call_tools` waits: the environment's code
(`Env.run`) asks for the model's next message, the adapter hands it the turn echo-rl sampled, records it in
the rollout's trace as verifiers' own rollout does (envs.verifiers_rollout), checks the task's stop conditions
before each turn, and scores the finished trace with the task's rubric (`Task.score`).

- MODULE is the taskset's importable module (what `vf-init` makes, or your own); --env-args fill the Env's
  config fields where it has them, the rest the taskset's config.
- Episode `seed` plays task `seed % n` of the taskset's first MAX_TASKS tasks.
- The first user message is the task's system prompt and prompt, joined by a blank line; later observations
  are the messages the environment's code sends. Tools are offered with the model's own chat template and
  called in its own format (envs.tools): the calls run here, in-process (no MCP server, no sandbox: a tool
  is code the learner and its workers run), and their results go back as tool messages. A tool's state is
  the trace's (`self.state`), as verifiers gives it.
- The return is the rubric's score of the finished trace. An episode cut by echo-rl's budgets (--max-turns,
  --max-episode-tokens) before the environment stops is never scored: its return is 0.
- Refused with one line: environments with several agents (a judge, an opponent: echo-rl trains one policy
  and runs no other model), an Env with a `finalize` (cross-trace judgement), and tasks whose rubric needs
  a runtime (a sandbox); a task that fails at scoring fails its episode.

This reaches into verifiers' internals (the rollout session, the trace graph, the tool-state context), hence
the exact version pin (SUPPORTED). verifiers 0.1.x environments (run_rollout and a client) are no longer
read: 0.4 removed that API and the environments that targeted it moved to v1.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import logging
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs import EnvError, EnvFactory, Step, failure
from envs.tools import ToolCall, ToolEnv, shown
from envs.verifiers_rollout import Agents, Rollout, Seat, tool_name, toolsets

SUPPORTED = "verifiers==0.4.0"  # the v1 API's internals this adapter uses
MAX_TASKS = 100_000  # tasks of a taskset an episode's seed chooses among (a taskset may be infinite)
_loaded_envs: dict[tuple[str, str], _Loaded] = {}
_loading = threading.Lock()


@dataclass
class _Loaded:
    """A verifiers environment loaded once per process: its tasks, its Env, its tools' OpenAI schemas."""

    name: str
    tasks: list[Any]
    env: Any  # the vf.Env whose run(task, agents) plays an episode
    seat: str  # the name of its one agent
    max_turns: int | None  # its agent config's turn limit (verifiers' RolloutLimits)
    schemas: tuple[dict, ...]


def verifiers_factory(module: str, args: dict[str, Any]) -> EnvFactory:
    """A factory of `VerifiersEnv` episodes of the taskset in `module`, loaded with `args` (checked here)."""
    try:
        import verifiers
    except ImportError:
        raise EnvError(f"environment 'verifiers:{module}' needs the verifiers package: pip install "
                       f"'echo-rl[verifiers]' (that is {SUPPORTED})") from None  # fmt: skip
    version = getattr(verifiers, "__version__", "unknown")
    if version != SUPPORTED.partition("==")[2]:
        raise EnvError(f"environment 'verifiers:{module}': echo-rl runs {SUPPORTED}, found {version}; install that")
    loaded = _load(module, args)
    return lambda: VerifiersEnv(loaded)


def _load(module: str, args: dict[str, Any]) -> _Loaded:
    key = (module, repr(sorted(args.items())))
    with _loading:
        if key not in _loaded_envs:
            try:
                _loaded_envs[key] = _load_quietly(module, args)
            except EnvError:
                raise
            except Exception as exc:  # noqa: BLE001 - the environment's own loading failure, in one line
                raise EnvError(f"environment 'verifiers:{module}' failed to load: {failure(exc)}") from None
        return _loaded_envs[key]


def _load_quietly(module: str, args: dict[str, Any]) -> _Loaded:
    """The taskset of `module` with its config, its Env (built without Env.__init__, which would load a
    harness echo-rl does not run) and its tools' schemas; verifiers' log records go through echo-rl's
    logging, its INFO lines (one per rollout) silenced."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import _plugin_class

    logging.getLogger("verifiers").setLevel(logging.WARNING)
    name = f"environment 'verifiers:{module}'"
    try:  # imported here, by its own name: verifiers' loader looks for a dotted one among its built-ins first
        plugin = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise EnvError(f"{name}: cannot import {module!r} ({exc}); install it or add its folder to PYTHONPATH"
                       ) from None  # fmt: skip
    taskset_cls = _plugin_class(plugin, vf.Taskset, "taskset")
    try:  # as verifiers.v1.utils.loaders.environment_class: the module's Env, else the single-agent one
        env_cls = _plugin_class(plugin, vf.Env, "environment")
    except (TypeError, AttributeError):
        env_cls = vf.SingleAgentEnv
    env_config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    taskset_config_cls = concrete_type(taskset_cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    env_args = {k: v for k, v in args.items() if k in env_config_cls.model_fields and k != "taskset"}
    taskset_args = {k: v for k, v in args.items() if k not in env_args}
    unknown = sorted(set(taskset_args) - set(taskset_config_cls.model_fields))
    if unknown:
        fields = sorted((set(env_config_cls.model_fields) | set(taskset_config_cls.model_fields)) - {"taskset", "id"})
        raise EnvError(f"{name} has no argument {unknown[0]!r}; its configs' fields: {', '.join(fields)}")
    taskset = taskset_cls(taskset_config_cls(id=module, **taskset_args))
    env = env_cls.__new__(env_cls)
    # unvalidated: validating an EnvConfig imports its taskset by verifiers' loader, which misses dotted names
    env.config = env_config_cls.model_construct(taskset=taskset.config, **env_args)
    seats = list(agent_config_fields(env.config))
    if len(seats) != 1:
        raise EnvError(f"{name} has {len(seats)} agents ({', '.join(seats)}); echo-rl trains one policy and runs "
                       "no other model")  # fmt: skip
    env.taskset = taskset
    for hook in ("finalize", "start", "stop"):
        if getattr(type(env), hook) is not getattr(vf.Env, hook):
            raise EnvError(f"{name}'s Env has its own {hook}(): echo-rl runs one rollout an episode, with no "
                           "cross-trace judgement and no env-wide resources")  # fmt: skip
    seat = getattr(env.config, seats[0])
    caps = ("max_input_tokens", "max_output_tokens", "max_total_tokens")
    if any(getattr(seat, cap, None) is not None for cap in caps):
        raise EnvError(f"{name}'s agent has token limits; echo-rl's --max-episode-tokens bounds an episode's tokens")
    tasks = list(itertools.islice(iter(taskset), MAX_TASKS))
    if not tasks:
        raise EnvError(f"{name}'s taskset has no tasks")
    _check_task(tasks[0], name)
    _allow_open_files()
    schemas = asyncio.run(_tool_schemas(tasks[0]))
    return _Loaded(name, tasks, env, seats[0], seat.max_turns, schemas)


def _check_task(task: Any, name: str) -> None:
    """Refuse a task this adapter would run differently from verifiers: hooks that need a runtime (a sandbox),
    stop conditions on a request or response rather than the trace (echo-rl checks the trace's)."""
    import verifiers.v1 as vf
    from verifiers.v1.session import hook_boundary

    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            raise EnvError(f"{name}'s task has its own {hook}(trace, runtime); echo-rl runs tasks without a runtime")
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            runtime = inspect.signature(fn).parameters.get("runtime")
            if runtime is not None and runtime.default is inspect.Parameter.empty:
                raise EnvError(f"{name}'s @vf.{kind} {fn.__name__} needs a runtime; echo-rl runs tasks without one")
    for fn in task.hooks("stop"):
        if hook_boundary(fn, allow_trace=True) is not vf.Trace:
            raise EnvError(f"{name}'s @vf.stop {fn.__name__} reads a request or response; echo-rl checks stop "
                           "conditions on the trace only")  # fmt: skip


def _allow_open_files() -> None:
    """Each live episode holds an event loop (3 file descriptors): raise the soft limit on open files to the
    hard one (at most 2^20), as servers do, so a learner hosting many episodes does not run out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _tool_schemas(task: Any) -> tuple[dict, ...]:
    """The OpenAI schemas of a task's tools, listed by an in-process MCP server as verifiers lists them."""
    from mcp.server.mcpserver import MCPServer

    schemas = []
    for toolset in toolsets(task):
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        for tool in await server.list_tools():
            function = {"name": tool_name(toolset, tool.name), "description": tool.description or "",
                        "parameters": tool.input_schema}  # fmt: skip
            schemas.append({"type": "function", "function": function})
    return tuple(schemas)


class VerifiersEnv(ToolEnv):
    """One episode of a verifiers environment, stepped turn by turn (the module docstring has the rules)."""

    def __init__(self, loaded: _Loaded) -> None:
        self.loaded, self.name = loaded, loaded.name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.run: asyncio.Task | None = None
        self.rollout: Rollout | None = None
        self.asked: asyncio.Future | None = None  # set by the rollout: it needs the model's next message
        self.answer: asyncio.Future | None = None  # set by a step: the model's message (and tool results)
        self.reward: float | None = None  # the rubric's score, once the episode is over
        self.table: dict[str, Callable[..., Any]] = {}

    def tool_schemas(self) -> tuple[dict, ...]:
        return self.loaded.schemas

    def tool_table(self) -> dict[str, Callable[..., Any]]:
        return self.table

    def reset(self, seed: int) -> str:
        task = self.loaded.tasks[seed % len(self.loaded.tasks)]
        self.loop = asyncio.new_event_loop()
        self.run = self.loop.create_task(self._play(task))
        new = self._next()
        if new is None:
            raise EnvError(f"{self.name}: task {seed % len(self.loaded.tasks)} ended before the model's first turn")
        if any(m.role not in ("system", "user") for m in new):  # few-shot turns: not one user message
            raise EnvError(f"{self.name}: task {seed % len(self.loaded.tasks)}'s prompt holds assistant or tool "
                           "messages; echo-rl's first prompt is one user message")  # fmt: skip
        return _text(new)

    def step(self, action: str) -> Step:
        import verifiers.v1 as vf

        return self._answer(vf.AssistantMessage(content=action), [])

    def call_tools(self, calls: list[ToolCall]) -> Step:
        """Run the calls (envs.tools.ToolEnv's rules and bounds) and give the rollout the model's message with
        its calls and their results, as verifiers' harness would."""
        import verifiers.v1 as vf

        step = super().call_tools(calls)
        calls = calls if len(step.tool_results) == len(calls) else calls[:1]  # too many: one refusal answers
        ids = [f"call_{n}" for n in range(len(calls))]
        names = [shown(c.name) or "invalid" for c in calls]  # a lone surrogate in a name, escaped
        message = vf.AssistantMessage(content="", tool_calls=[
            vf.ToolCall(id=i, name=n, arguments=json.dumps(c.arguments))
            for i, n, c in zip(ids, names, calls, strict=True)])  # fmt: skip
        results = [vf.ToolMessage(tool_call_id=i, name=n, content=r)
                   for i, n, r in zip(ids, names, step.tool_results, strict=True)]  # fmt: skip
        after = self._answer(message, results)
        return after if after.done else step

    def close(self) -> None:
        """Cancel a rollout left unfinished (a budget ended the episode) and close the episode's loop."""
        if self.loop is None:
            return
        if self.run is not None and not self.run.done():
            self.run.cancel()
            self.loop.run_until_complete(asyncio.wait([self.run]))
        if self.run is not None and not self.run.cancelled():
            self.run.exception()  # seen: asyncio would log a failed task nobody asked about
        self.loop.close()
        self.loop = self.run = None

    def _answer(self, message: Any, results: list[Any]) -> Step:
        if self.answer is None or self.answer.done():
            raise EnvError(f"{self.name}: step() before reset(), or after the episode ended")
        self.answer.set_result((message, results))
        new = self._next()
        if new is None:
            return Step(reward=self.reward or 0.0, done=True)
        if results:
            return Step()  # the rollout took the tool results and asks for the next turn
        return Step(_text(new))

    def _next(self) -> list | None:
        """Run the rollout until it asks for the model's next message (the messages added since the model's
        last one) or ends (None, with the reward scored)."""
        assert self.loop is not None and self.run is not None
        self.asked = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait([self.asked, self.run], return_when=asyncio.FIRST_COMPLETED))
        if self.asked.done():
            return self.asked.result()
        if (exc := self.run.exception()) is not None:
            raise EnvError(f"{self.name}: the episode raised {failure(exc)}") from None
        return None

    async def _play(self, task: Any) -> None:
        """The environment's own episode (Env.run) with this episode as its one agent, then the score."""
        seat = Seat(self)
        agents = Agents({self.loaded.seat: seat})
        await self.loaded.env.setup(agents)
        await self.loaded.env.run(task, agents)
        if seat.trace is None:
            raise EnvError(f"{self.name}: the environment's run() played no rollout")
        self.reward = float(seat.trace.reward)

    async def _ask(self, new: list) -> tuple[Any, list]:
        """The model's next message and its tool results (the rollout's side of step and call_tools)."""
        assert self.loop is not None and self.asked is not None
        self.answer = self.loop.create_future()
        self.asked.set_result(new)
        return await self.answer


def _text(messages: list) -> str:
    """The text of the messages the model has not seen (system, user), joined by blank lines: echo-rl shows
    them as one user turn. A tool message is never among them (call_tools returns tool results)."""
    from verifiers.v1.types import content_text

    return "\n\n".join(text for m in messages if m.role in ("system", "user") and (text := content_text(m.content)))
