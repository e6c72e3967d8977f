"""How an episode's text becomes tokens: the model's tokenizer and the pieces of its chat template.

The model's own turns stay the tokens it sampled (token in, token out: never re-tokenized, so the trained
tokens are the sampled ones). An observation is written as the chat template writes a user turn after an
assistant turn, followed by the opening of the next assistant turn:

    observation tokens = encode(observation_open + text + observation_close)

where observation_open is what the template puts between an assistant message's content and the next user
message's content (with SmolLM2's template "<|im_end|>\\n<|im_start|>user\\n"), less the text of the model's
stop token when its turn ended with one (the model already wrote "<|im_end|>"), and observation_close what it
puts after a user message when a reply is asked for ("<|im_end|>\\n<|im_start|>assistant\\n").

The results of a turn's tool calls (envs.tools) are written the same way as the template writes tool messages
after an assistant turn: tool_open + result 1 + tool_sep + result 2 ... + tool_close (Qwen3: each result in
<tool_response> tags inside one user turn; Llama 3.1: an ipython turn each, the result as a JSON string). A
template without a tool role gets the Hermes convention inside a user turn (GENERIC_TOOL_FRAME).

Reasoning models (Qwen3, DeepSeek-R1 distills) think before they answer, in a block between <think> and
</think>, each one token of their vocabulary. An environment and a reward read the answer only
(without_thinking): what follows the last </think>; a turn cut off while thinking has no answer. The thinking
tokens are still sampled and trained like any other.

The learner derives the pieces from the template (learner.train.models.chat_format) and sends them with the
tokenizer's JSON to workers, so both sides encode and decode with the same `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import zstandard
from tokenizers import Tokenizer

from p2p.wire import FrameError, bounded_decompress

MAX_TOKENIZER_JSON = 64 << 20  # bytes of a tokenizer a worker accepts from the learner, decompressed
GENERIC_TOOL_FRAME = ("<tool_response>\n", "\n</tool_response>\n<tool_response>\n", "\n</tool_response>")
# a reasoning model's thinking block, one token each in its vocabulary: Qwen3/DeepSeek's, Magistral/Ministral's
THINK = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def think_ids(token_id: Callable[[str], int | None]) -> tuple[int, int] | None:
    """The (open, close) thinking token ids of a vocabulary (`token_id`: a token's id or None): the first pair
    of THINK it has; None for a model whose vocabulary has no single thinking tokens."""
    for pair in THINK:
        ids = [token_id(t) for t in pair]
        if None not in ids:
            return ids[0], ids[1]
    return None


def without_thinking(tokens: list[int], think: tuple[int, int] | None) -> list[int]:
    """The answer of a model turn: the tokens after its last </think>; none ([]) if it opened <think> and never
    closed it (cut off while thinking); all of them for a model without thinking tokens (`think` None)."""
    if think is None:
        return tokens
    if think[1] in tokens:
        return tokens[len(tokens) - tokens[::-1].index(think[1]) :]
    return [] if think[0] in tokens else tokens


@dataclass(frozen=True)
class ChatFormat:
    """A model's tokenizer (its tokenizers JSON) and the chat-template text around an observation."""

    tokenizer_json: str = field(repr=False)
    observation_open: str
    observation_close: str
    stop_ids: tuple[int, ...]  # tokens that end a model turn (the model's end-of-sequence tokens)
    tool_format: str = "hermes"  # how the model writes tool calls (envs.tools.TOOL_FORMATS)
    tool_frame: tuple[str, str, str] | None = None  # (tool_open, tool_sep, tool_close); None: generic
    tool_json: bool = False  # the template writes a tool result as a JSON string (Llama 3.1)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)

    def decode(self, tokens: list[int]) -> str:
        """A model turn as the environment reads it: its answer (without_thinking), special tokens removed."""
        return self.tokenizer.decode(without_thinking(tokens, self.think), skip_special_tokens=True)

    def decode_calls(self, tokens: list[int]) -> str:
        """A model turn as tool calls are read from it (envs.tools): its answer with special tokens kept (a
        call's markers may be special tokens), less the stop token that ended it."""
        answer = without_thinking(tokens, self.think)
        answer = answer[:-1] if answer and answer[-1] in self.stop_ids else answer
        return self.tokenizer.decode(answer, skip_special_tokens=False)

    @cached_property
    def think(self) -> tuple[int, int] | None:
        return think_ids(self.tokenizer.token_to_id)

    def observation_ids(self, text: str, turn: list[int]) -> list[int]:
        """The tokens of observation `text` after the model turn `turn` (see the module docstring)."""
        return self._after(turn, self.observation_open, text + self.observation_close)

    def tool_result_ids(self, results: tuple[str, ...], turn: list[int]) -> list[int]:
        """The tokens of tool `results` after the model turn `turn` that called the tools."""
        if self.tool_frame is None:
            opening, sep, close = GENERIC_TOOL_FRAME
            opening, close = self.observation_open + opening, close + self.observation_close
        else:
            opening, sep, close = self.tool_frame
        shown = [json.dumps(r, ensure_ascii=False) if self.tool_json else r for r in results]
        return self._after(turn, opening, sep.join(shown) + close)

    def _after(self, turn: list[int], opening: str, rest: str) -> list[int]:
        """Encode opening + rest after `turn`, less the text of the stop token the turn already ended with."""
        if turn and turn[-1] in self.stop_ids:
            stop = self.tokenizer.decode([turn[-1]], skip_special_tokens=False)
            if stop and opening.startswith(stop):
                opening = opening[len(stop) :]
        return self.tokenizer.encode(opening + rest, add_special_tokens=False).ids

    def to_wire(self) -> dict:
        """The tokenizer's JSON travels zstd-compressed (SmolLM2's 2.1 MB is ~0.5 MB, under a frame's 1 MB
        string limit as bytes)."""
        return {
            "tokenizer": zstandard.ZstdCompressor(level=9).compress(self.tokenizer_json.encode()),
            "open": self.observation_open,
            "close": self.observation_close,
            "stop_ids": list(self.stop_ids),
            "tool_format": self.tool_format,
            "tool_frame": list(self.tool_frame) if self.tool_frame else None,
            "tool_json": self.tool_json,
        }

    @classmethod
    def from_wire(cls, msg: dict) -> ChatFormat:
        from envs import EnvError

        packed, opening, close, stops = (msg.get(k) for k in ("tokenizer", "open", "close", "stop_ids"))
        try:
            tok = bounded_decompress(packed, MAX_TOKENIZER_JSON).decode()
        except (FrameError, UnicodeDecodeError):
            raise EnvError("the run's chat format needs the tokenizer as zstd-compressed JSON") from None
        if not isinstance(opening, str) or not isinstance(close, str) or len(opening) + len(close) > 4096:
            raise EnvError("the run's chat format needs short observation_open and observation_close strings")
        if not isinstance(stops, list) or not all(type(s) is int and s >= 0 for s in stops):
            raise EnvError("the run's chat format needs stop_ids, a list of token ids")
        tool_format, frame, tool_json = msg.get("tool_format"), msg.get("tool_frame"), msg.get("tool_json")
        from envs.tools import TOOL_FORMATS

        if not isinstance(tool_format, str) or tool_format not in TOOL_FORMATS or not isinstance(tool_json, bool):
            raise EnvError(f"the run's chat format needs tool_format, one of {', '.join(TOOL_FORMATS)}, and tool_json")
        if frame is not None and not (
            isinstance(frame, list) and len(frame) == 3 and all(isinstance(f, str) for f in frame)
            and sum(map(len, frame)) <= 4096
        ):  # fmt: skip
            raise EnvError("the run's chat format needs tool_frame as three short strings (or none)")
        try:
            Tokenizer.from_str(tok)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type
            raise EnvError(f"the run's tokenizer JSON does not load: {exc}") from None
        return cls(tok, opening, close, tuple(stops), tool_format, tuple(frame) if frame else None, tool_json)
