"""Tool calling: Python functions an environment offers, the model's calls read in its chat template's format,
and their results shown back to it as tool messages.

A tool environment (ToolEnv) lists `tools`: plain functions with type hints and a Google-style docstring.
The learner renders their JSON schemas into the first prompt with the model's own chat template, which also
tells the model how to call them (learner.train.chat_templates); a template without a tool section gets
GENERIC_INSTRUCTIONS in the first user message and the Hermes format. After each model turn the episode runner
(envs.episode.step_env) reads the turn's calls with the run's TOOL_FORMATS parser: a turn with calls gets the
tools' results as the next observation (written as the template writes tool messages: envs.chat), a turn
without calls is the answer (ToolEnv.step). A call that cannot be run (bad JSON, an unknown tool, wrong
arguments, a tool that raised) is the model's mistake: its result says so, and the episode goes on.

The learner replays an episode by parsing the same text the same way and calling the same tools, so a tool
must be deterministic: the same arguments always give the same result. Every bound here keeps one call cheap
whatever a model (or a worker claiming its turns) writes: MAX_CALLS per turn, MAX_RESULT characters of a
result, JSON nested at most MAX_DEPTH deep. A tool bounds its own work (envs.calculator's evaluator does).
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs import EnvError, Step, failure

MAX_CALLS = 8  # tool calls read from one model turn; more are refused in one result
MAX_RESULT = 4000  # characters of one result shown to the model
MAX_DEPTH = 16  # nesting of a call's JSON


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments, or why it cannot be read (`error`)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def _calls_from_json(blobs: list[str], args_key: str) -> list[ToolCall]:
    """Calls from JSON objects {"name": ..., args_key: {...}} (the arguments may also be a JSON string)."""
    calls = []
    for blob in blobs:
        if _nesting(blob) > MAX_DEPTH + 2:
            value = None  # refused before decoding: how deep a decoder gets depends on the machine's stack
        else:
            try:
                value = json.loads(blob)
            except ValueError:
                calls.append(ToolCall("", {}, "the call is not valid JSON"))
                continue
        calls.append(_call_from_value(value, args_key))
    return calls


def _call_from_value(value: object, args_key: str) -> ToolCall:
    """A call from a decoded JSON value {"name": ..., args_key: {...}} (the arguments may be a JSON string)."""
    args = value.get(args_key, {}) if isinstance(value, dict) else None
    if isinstance(args, str):
        args = _json_prefix(args, json.JSONDecoder(), whole=True)
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or not isinstance(args, dict) or _depth(args) > MAX_DEPTH:
        return ToolCall("", {}, f'a call is a JSON object {{"name": "<tool>", "{args_key}": {{...}}}}')
    return ToolCall(name[:100], args)


def _json_prefix(text: str, decoder: json.JSONDecoder, whole: bool = False) -> object:
    """The JSON value `text` starts with (all of `text` if `whole`), or None: not JSON, or nested deeper than
    MAX_DEPTH + 2 (refused before decoding, so no machine's stack depth decides)."""
    if _nesting(text) > MAX_DEPTH + 2:
        return None
    try:
        value, end = decoder.raw_decode(text)
    except ValueError:
        return None
    return value if not whole or not text[end:].strip() else None


def _nesting(text: str) -> int:
    """How deep `text`'s brackets nest outside JSON strings (a linear scan, stopping past MAX_DEPTH + 2)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH + 2:
                break
        elif char in "]}":
            depth -= 1
    return deepest


def _depth(value: object, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen2.5 / Qwen3: each call a JSON object {"name", "arguments"} between <tool_call> and
    </tool_call> (an unclosed last one counts: the turn may stop right after its JSON)."""
    found = itertools.islice(_HERMES.finditer(text), MAX_CALLS + 1)  # no further than what is refused
    return _calls_from_json([m.group(1).strip() for m in found], "arguments")


def parse_llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.1-3.3 (custom tools): the whole answer is a JSON object {"name", "parameters"}, or several
    separated by ";". An answer that does not start with "{" is not a call."""
    text, blobs, at = text.strip().removeprefix("<|python_tag|>").lstrip(), [], 0
    if not text.startswith("{"):
        return []
    decoder = json.JSONDecoder()
    while at < len(text) and len(blobs) <= MAX_CALLS:
        if _nesting(text[at:]) > MAX_DEPTH + 2:  # not decoded: how deep a decoder gets is the machine's stack's
            blobs.append(text[at:])
            break
        try:
            _, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            blobs.append(text[at:])  # the rest is not JSON: one malformed call
            break
        blobs.append(text[at:end])
        at = len(text) - len(text[end:].lstrip().removeprefix(";").lstrip())  # past the ";" between calls
    return _calls_from_json(blobs, "parameters")


# possessive: a name's surrounding whitespace is never re-split (backtracking over it is quadratic)
_MISTRAL_CALL = re.compile(r"\s*+([^\[\]]{1,100}?)\s*+(?:\[CALL_ID\][^\[\]]{0,64})?\[ARGS\]", re.DOTALL)


def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral (Ministral 3, Devstral, Magistral, Mistral Small 3.2): each call is [TOOL_CALLS], the tool's name,
    [ARGS] and its arguments as a JSON object (a [CALL_ID] may sit before [ARGS]); Mistral Nemo's form,
    [TOOL_CALLS] and a JSON list of {"name", "arguments"}, is read too. Text before the first [TOOL_CALLS]
    is not a call."""
    parts = text.split("[TOOL_CALLS]")[1 : MAX_CALLS + 2]  # no further than what is refused
    calls = []
    decoder = json.JSONDecoder()
    for part in parts:
        if part.lstrip().startswith("["):  # Nemo: a JSON list of calls
            listed = _json_prefix(part.lstrip(), decoder)
            if not isinstance(listed, list):
                calls.append(ToolCall("", {}, 'calls are a JSON list [{"name": "<tool>", "arguments": {...}}]'))
                continue
            calls += [_call_from_value(value, "arguments") for value in listed[: MAX_CALLS + 1]]
            continue
        head = _MISTRAL_CALL.match(part)
        if head is None:
            calls.append(ToolCall("", {}, "a call is the tool's name, [ARGS] and its arguments as a JSON object"))
            continue
        args = _json_prefix(part[head.end() :].strip(), decoder)
        if not isinstance(args, dict) or _depth(args) > MAX_DEPTH:
            calls.append(ToolCall("", {}, "a call's arguments after [ARGS] are a JSON object"))
        else:
            calls.append(ToolCall(head.group(1).strip(), args))
    return calls[: MAX_CALLS + 1]


TOOL_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
GENERIC_FORMAT = "hermes"  # the format of GENERIC_INSTRUCTIONS, for templates without a tool section

GENERIC_INSTRUCTIONS = """You can call these tools, described as JSON schemas:
<tools>
{tools}
</tools>
To call a tool, write a JSON object with its name and arguments between <tool_call> and </tool_call>, e.g.
<tool_call>
{{"name": "{example}", "arguments": {{...}}}}
</tool_call>
Each result comes back in <tool_response></tool_response>. When you have the answer, reply without a call."""


def generic_instructions(schemas: list[dict]) -> str:
    """How to call `schemas`' tools, for a first user message whose chat template has no tool section."""
    tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    example = schemas[0].get("function", {}).get("name", "tool") if schemas else "tool"
    return GENERIC_INSTRUCTIONS.format(tools=tools, example=example)


# a parameter's annotation -> the JSON values it takes, and how the model is told so
_JSON_TYPES: dict[Any, tuple[tuple[type, ...], str]] = {
    str: ((str,), "a string"), int: ((int,), "an integer"), float: ((int, float), "a number"),
    bool: ((bool,), "true or false"), list: ((list,), "an array"), dict: ((dict,), "an object"),
}  # fmt: skip


class ToolEnv:
    """An Environment whose model may call `tools` before it answers (see the module docstring).

    A subclass sets `tools` (functions with type hints and Google-style docstrings: their JSON schemas come
    from them), implements reset(seed) and step(answer) -> Step (the turn without calls: usually done, with
    the reward), and may set `call_cost`, subtracted from the return per call (0: tools are free)."""

    tools: tuple[Callable[..., Any], ...] = ()
    call_cost: float = 0.0

    def tool_table(self) -> dict[str, Callable[..., Any]]:
        """The tools the model may call, by the name it calls them (their schemas' names)."""
        return {tool.__name__: tool for tool in self.tools}

    def tool_schemas(self) -> tuple[dict, ...] | None:
        """The tools' JSON schemas, or None: the learner makes them from the functions' hints and docstrings."""
        return None

    def reset(self, seed: int) -> str:
        raise NotImplementedError

    def step(self, action: str) -> Step:
        raise NotImplementedError

    def call_tools(self, calls: list[ToolCall]) -> Step:
        """Run the turn's calls in order; the observation is their results, one tool message each."""
        if len(calls) > MAX_CALLS:
            return Step(tool_results=(f"error: at most {MAX_CALLS} tool calls per turn",), reward=-self.call_cost)
        results = tuple(shown(self._call(call)) for call in calls)
        return Step(tool_results=results, reward=-self.call_cost * len(calls))

    def _call(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        tools = self.tool_table()
        tool = tools.get(call.name)
        if tool is None:
            return f"error: there is no tool {call.name!r}; the tools are {', '.join(tools)}"
        problem = argument_problem(call.name, tool, call.arguments)
        if problem:
            return f"error: {problem}"
        try:
            result = tool(**call.arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's failure on the model's input is the model's to see
            return f"error: {failure(exc)}"
        if isinstance(result, str):
            return result
        try:  # plain JSON values only: a set's or an object's text could differ between worker and learner
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            kind = type(result).__name__
            raise EnvError(f"tool {call.name} returned a {kind}: a tool returns a str or plain JSON values") from None


def shown(result: str) -> str:
    """A result as the model reads it: at most MAX_RESULT characters, without surrounding whitespace (some
    templates strip a tool message, so every result is stripped alike), and without lone surrogates (a
    JSON "\\ud800" a call may carry cannot be tokenized: it is shown escaped)."""
    return result[:MAX_RESULT].strip().encode("utf-8", "backslashreplace").decode("utf-8")


def argument_problem(name: str, tool: Callable[..., Any], arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the signature of `tool` (called `name`): a missing or unknown argument, a
    value of the wrong JSON type; or None."""
    params = inspect.signature(tool, eval_str=True).parameters
    unknown = sorted(set(arguments) - set(params))
    if unknown:
        return f"{name} has no argument {unknown[0][:40]!r}; its arguments are {', '.join(params)}"
    for param in params.values():
        if param.name not in arguments:
            if param.default is inspect.Parameter.empty:
                return f"{name} needs the argument {param.name!r}"
            continue
        types, what = _JSON_TYPES.get(param.annotation, ((object,), ""))
        value = arguments[param.name]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            return f"{name}'s argument {param.name!r} must be {what}"
    return None
