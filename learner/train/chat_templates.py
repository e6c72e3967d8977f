"""What a model's chat template does with tools, found by rendering probe conversations with it.

Three facts decide how a tool environment's episodes are written for a model (envs.tools, envs.chat):
- its tool-call format: the template's tool section says how to call (Qwen2.5/Qwen3/Hermes: <tool_call>
  JSON, "hermes"; Llama 3.1-3.3: a bare JSON object with "parameters", "llama3_json"; Mistral's
  [AVAILABLE_TOOLS] with [TOOL_CALLS]name[ARGS]{...} calls, "mistral"); a template that
  ignores tools, or describes them in a format no parser here reads, gets envs.tools.GENERIC_INSTRUCTIONS in
  the first user message and the Hermes format instead ("generic": logged when a tool environment starts);
- how it writes tool messages after an assistant turn (the tool frame), or None where it has no tool role;
- whether it writes a tool result as a JSON string (Llama 3.1's `tojson`).
"""

from __future__ import annotations

import functools
import json
import logging
import re

from envs.tools import GENERIC_FORMAT, generic_instructions

log = logging.getLogger(__name__)

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "echo_probe_tool",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "a value"}},
                       "required": ["x"]},
    },
}  # fmt: skip
# How each known format shows in a template's tool section (what the template tells the model to write):
# Hermes' <tool_call> holds JSON with a "name" (GLM's and Qwen3-Coder's XML calls inside the same tag do not)
FORMAT_MARKERS = {"hermes": re.compile(r'<tool_call>\s*\{\s*"name"'),
                  "llama3_json": re.compile(r'"parameters": dictionary of argument name')}  # fmt: skip


def tool_format(tokenizer: object) -> tuple[str, bool]:
    """(the model's tool-call format, whether its template writes the tools itself): rendered once per policy
    (learner.train.models.Policy.tool_format)."""
    try:
        text = _user_turn(tokenizer, "ECHOUSERPROBE", [PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template that raises on tools has no usable tool section
        return GENERIC_FORMAT, False
    if PROBE_TOOL["function"]["name"] in text:
        for name, marker in FORMAT_MARKERS.items():
            if marker.search(text):
                return name, True
        # Mistral's templates list the tools in [AVAILABLE_TOOLS] and say nothing of the call format (the model
        # learned it); only those that write a tool result without the call's id ([TOOL_RESULTS]result, as
        # Ministral 3 and Devstral do) are read: results written with ids the model made up are not
        if "[AVAILABLE_TOOLS]" in text and "[ARGS]" in str(getattr(tokenizer, "chat_template", "")):
            if tool_frame(tokenizer)[0] is not None:
                return "mistral", True
    return GENERIC_FORMAT, False


def observation_frame(tokenizer: object) -> tuple[str, str] | None:
    """(observation_open, observation_close): what the template writes between an assistant message and the
    next user message's content, and after that content when a reply is asked for (envs.chat); None when it
    does not write an assistant turn followed by a user turn."""
    model, observation = "ECHOMODELPROBE", "ECHOOBSERVATIONPROBE"
    messages = [{"role": "user", "content": "ECHOUSERPROBE"}, {"role": "assistant", "content": model},
                {"role": "user", "content": observation}]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = _after_each(text, [model, observation])
    return (pieces[0], pieces[1]) if pieces else None


def _after_each(text: str, probes: list[str]) -> list[str] | None:
    """The text after each probe up to the next one (after the last: to the end), or None unless the probes
    appear in `text` in order."""
    at = [text.find(p) for p in probes]
    if min(at) < 0 or at != sorted(at):
        return None
    ends = [a + len(p) for a, p in zip(at, probes, strict=True)]
    return [text[end:nxt] for end, nxt in zip(ends, [*at[1:], len(text)], strict=True)]


def tool_frame(tokenizer: object) -> tuple[tuple[str, str, str] | None, bool]:
    """((tool_open, tool_sep, tool_close) as the template writes two tool messages after an assistant turn, or
    None where it has no tool role), and whether it writes a result as a JSON string."""
    model, first, second = "ECHOMODELPROBE", "ECHOTOOLONE", "ECHOTOOLTWO"
    messages = [{"role": "user", "content": "ECHOUSERPROBE"}, {"role": "assistant", "content": model},
                {"role": "tool", "content": first}, {"role": "tool", "content": second}]  # fmt: skip
    try:  # with the tools offered: Hermes' templates loop over them in every conversation
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - templates without a tool role raise (Gemma: roles must alternate)
        return None, False
    quoted = json.dumps(first) in text and json.dumps(second) in text
    pieces = _after_each(text, [model, json.dumps(first), json.dumps(second)] if quoted else [model, first, second])
    return (tuple(pieces), quoted) if pieces else (None, False)


def render_user_turn(tokenizer: object, user_text: str, tools: tuple[dict, ...], in_template: bool) -> str:
    """The first prompt's text: one user turn and the assistant's opening, with `tools`' schemas written by the
    template's tool section (`in_template`), or else by envs.tools.generic_instructions before the user text."""
    if tools and not in_template:
        _log_generic(str(getattr(tokenizer, "name_or_path", "")))
        user_text = generic_instructions(list(tools)) + "\n\n" + user_text
    return _user_turn(tokenizer, user_text, list(tools) if tools and in_template else None)


def _user_turn(tokenizer: object, text: str, tools: list[dict] | None) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


@functools.cache
def _log_generic(name: str) -> None:
    log.info("model %s: its chat template has no tool section echo-rl reads; tools are described in the first "
             "user message, calls in the Hermes format (docs/environments.md)", name)  # fmt: skip
