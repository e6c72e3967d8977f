"""The in-process verifiers rollout behind envs.verifiers_env: what verifiers' Env.run sees as its agent
(`Seat`: Agent.run and Agent.interaction), and one rollout of a task (`Rollout`), recorded in a verifiers
Trace as verifiers.v1.rollout.Rollout records it, with echo-rl's sampled turns as the model's replies and
the task's tools called in-process. The episode (envs.verifiers_env.VerifiersEnv) hands each turn over
through `_ask`; nothing here runs a model, a harness, an MCP server or a sandbox.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from envs import EnvError

if TYPE_CHECKING:
    from envs.verifiers_env import VerifiersEnv


def toolsets(task: Any) -> list[Any]:
    return list(type(task).toolsets(task.config))


def tool_name(toolset: Any, name: str) -> str:
    """A tool's name as the model sees it: `<server>_<tool>`, or bare when the toolset's prefix is None."""
    return f"{toolset.server_name}_{name}" if toolset.server_name else name


class Agents:
    """Env.run's `agents`: the one seat, by its name."""

    def __init__(self, seats: dict[str, Any]) -> None:
        self.__dict__.update(seats)


class Seat:
    """What Env.run calls an agent (verifiers.v1.Agent's run and interaction), playing echo-rl's turns."""

    trainable = True

    def __init__(self, episode: VerifiersEnv) -> None:
        self.episode, self.trace = episode, None

    async def run(self, task: Any, **_: Any) -> Any:
        rollout = await self._open(task)
        try:
            await rollout.segment(None)
        except BaseException:  # an episode cut by a budget (cancelled) or failed is never scored
            await rollout.abort()
            raise
        if rollout.trace.stop_condition is None:
            rollout.trace.stop("agent_completed")
        return await self._close(rollout)

    def interaction(self, task: Any, **_: Any) -> Any:
        seat = self

        class Interaction:
            """verifiers.v1.agent.Interaction: each turn(message) sends a user turn and runs one segment; after
            the exchange ended (a terminated segment), a further turn raises, as verifiers' does."""

            async def __aenter__(self) -> Any:
                self.rollout, self.over = await seat._open(task), False
                return self

            @property
            def trace(self) -> Any:
                return self.rollout.trace

            async def turn(self, message: Any = None) -> Any:
                if self.over:
                    raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
                segment = await self.rollout.segment(message)
                self.over = segment.terminated
                return segment

            async def __aexit__(self, kind: type | None, *exc: Any) -> None:
                if kind is not None:  # cancelled (a budget ended the episode) or failed: not scored
                    await self.rollout.abort()
                    return
                if self.rollout.trace.stop_condition is None:
                    self.rollout.trace.stop("user_closed")
                await seat._close(self.rollout)

        return Interaction()

    async def _open(self, task: Any) -> Rollout:
        if self.trace is not None or self.episode.rollout is not None:
            raise EnvError(f"{self.episode.name}: the environment plays several rollouts in one episode")
        rollout = self.episode.rollout = Rollout(task, self.episode)
        try:
            await rollout.open()
        except BaseException:
            await rollout.abort()
            raise
        return rollout

    async def _close(self, rollout: Rollout) -> Any:
        self.trace = await rollout.score()
        return self.trace


class Rollout:
    """One rollout of a task, as verifiers.v1.rollout.Rollout records it, with echo-rl as the model and the
    tools called in-process."""

    def __init__(self, task: Any, episode: VerifiersEnv) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.session import RolloutLimits, RolloutSession, hook_boundary
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        self.task, self.episode = task, episode
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              state=state_cls(type(task))(), agent=AgentInfo(config=vf.AgentConfig()))  # fmt: skip
        stops = [fn for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is vf.Trace]
        limits = RolloutLimits(max_turns=episode.loaded.max_turns)
        self.session = RolloutSession(ctx=vf.ModelContext(model="echo-rl", client=vf.EvalClientConfig()),
                                      trace=self.trace, trace_stops=stops, limits=limits)  # fmt: skip
        self.stack = contextlib.AsyncExitStack()  # the toolsets' own exit stacks, as their servers hold them
        self.tools: list[Any] = []  # vf.Tool of each schema, as the trace records the tools offered
        self.conversation: list[Any] = []
        self.seen = 0  # messages of the conversation the model has seen

    async def open(self) -> None:
        """Set the task's toolsets up, and give the episode their tools (bound to the trace's state)."""
        import verifiers.v1 as vf

        self.tools = [vf.Tool(name=s["function"]["name"], description=s["function"]["description"],
                              parameters=s["function"]["parameters"]) for s in self.episode.loaded.schemas]  # fmt: skip
        from verifiers.v1.utils.decorators import discover_decorated

        for toolset in toolsets(self.task):
            await self.stack.enter_async_context(toolset._exit_stack)
            await toolset.setup()
            await toolset.setup_task(self.task)
            for fn in discover_decorated(toolset, "tool"):
                name = tool_name(toolset, getattr(fn, "tool_name", None) or fn.__name__)
                self.episode.table[name] = self._in_state(fn)
        data = self.task.data
        if data.system_prompt:
            self.conversation.append(vf.SystemMessage(content=data.system_prompt))
        if isinstance(data.prompt, str):
            self.conversation.append(vf.UserMessage(content=data.prompt))
        elif data.prompt:
            self.conversation.extend(data.prompt)

    def _in_state(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A toolset's method as a plain call: the trace's state is its `self.state`, an async one runs to its
        end on the episode's loop (a call comes from call_tools, while the loop waits)."""
        from verifiers.v1.mcp.server import _call_state

        @functools.wraps(fn)
        def call(**arguments: Any) -> Any:
            token = _call_state.set(self.trace.state)
            try:
                result = fn(**arguments)
                if inspect.isawaitable(result):
                    result = self.episode.loop.run_until_complete(result)
                return result
            finally:
                _call_state.reset(token)

        return call

    async def segment(self, message: Any) -> Any:
        """The model's turns until one without tool calls (verifiers' harness segment), after the user's
        `message` (a string or messages) when there is one; a Segment of verifiers."""
        import verifiers.v1 as vf
        from verifiers.v1 import graph
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message

        if self.trace.stop_condition is not None:  # the run already ended: nothing more is asked
            return Segment(messages=[], terminated=True)
        if isinstance(message, str):
            self.conversation.append(vf.UserMessage(content=message))
        elif message is not None:
            self.conversation.extend(parse_message(m) if isinstance(m, dict) else m for m in message)
        sampled = []
        while await self.session.refused() is None:
            reply, results = await self.episode._ask(self.conversation[self.seen :])
            finish = "tool_calls" if reply.tool_calls else "stop"
            response = vf.Response(id=f"echo-rl-{self.trace.num_turns}", created=int(time.time()), model="echo-rl",
                                   message=reply, finish_reason=finish)  # fmt: skip
            graph.prepare_turn(self.trace, self.conversation, self.tools).commit(response)
            self.conversation += [reply, *results]
            self.seen = len(self.conversation) - len(results)  # the results are the next observation
            sampled += [reply, *results]
            if not reply.tool_calls:
                break
        if self.conversation and isinstance(self.conversation[-1], vf.ToolMessage):  # a stop after tool results
            graph.prepare_turn(self.trace, self.conversation, self.tools).commit_prompt()
        if not sampled:
            return Segment(messages=[], terminated=True)
        return Segment(messages=sampled, root_reply=None)

    async def abort(self) -> None:
        """Free what the rollout holds (its toolsets' exit stacks) without scoring it."""
        await self.stack.aclose()

    async def score(self) -> Any:
        """The task's rubric on the finished trace (its rewards' weighted sum is trace.reward)."""
        try:
            await self.task.score(self.trace)
        finally:
            await self.stack.aclose()
        if self.trace.errors:
            raise EnvError(f"scoring failed: {self.trace.errors[-1].message.splitlines()[0][:200]}")
        self.trace.is_completed = self.trace.ok = True
        return self.trace
