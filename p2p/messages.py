"""Plain data types that cross the learner/worker boundary.

They hold only Python scalars, lists and numpy arrays so that a worker needs neither torch nor
transformers, and so that they can be serialised with msgpack when they travel over the swarm.

Long because every message between the learner and its workers is here with the bounds it is checked
against, so that one file shows the whole protocol (the broadcast's own messages are in p2p.broadcast).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import msgpack
import numpy as np
import zstandard

from p2p.wire import FrameError, bounded_decompress

MAX_HF_CONFIG = 1 << 16  # bytes of a model's config.json on the wire (real ones are 1-10 KB)
MAX_GGUF_RECIPE = 4 << 20  # bytes of a GGUF recipe (~60 B a node: 30 KB for a dense 36-layer model)
# bytes of a spec's vocabulary (tokens, token types, merges) decompressed: Qwen3's 151936 tokens and 294k merges
# are 5.2 MB of msgpack (2.1 MB zstd), which a 262k vocabulary (Gemma 3) would take past a frame's 8 MB
MAX_VOCAB = 64 << 20
VOCAB_FIELDS = ("tokens", "token_types", "merges")
# weight formats a worker may run (`worker join --quant`): the learner's 16-bit weights, or llama.cpp's
# quantization of them on the worker (worker.quantize), which a learner verifies on the same llama.cpp build only
WEIGHT_FORMATS = ("f16", "q8_0", "q4_0", "q4_k_m")


@dataclass(frozen=True)
class ModelSpec:
    """Everything a worker needs to run a policy besides its tensors.

    `hf_config` is the model's transformers config.json, from which the transformers engine rebuilds any
    causal LM family (AutoModelForCausalLM.from_config); the architecture fields below it are what the
    llama.cpp engine's GGUF writer reads. The tokenizer is carried as a byte-level BPE vocabulary so that
    llama.cpp can load the model; workers never tokenize text themselves (prompts arrive as token ids).
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    bos_id: int
    eos_ids: list[int]
    tokens: list[str] = field(repr=False)
    token_types: list[int] = field(repr=False)
    merges: list[str] = field(repr=False)
    tokenizer_pre: str = "default"
    lora_rank: int = 0  # > 0: versions after the first carry only LoRA adapters (see learner.train.lora)
    lora_alpha: float = 0.0  # an adapter adds (lora_alpha / lora_rank) * B A to its weight
    hf_config: str = ""  # the model's config.json (JSON text); "" from a learner before model families
    gguf_recipe: str = ""  # JSON: how llama.cpp's converter lays the tensors out (learner.train.gguf_recipe)

    @property
    def model_type(self) -> str:
        """transformers' name of the architecture (llama, qwen3, gemma3_text, ...)."""
        return str(self.config().get("model_type", "llama"))

    def config(self) -> dict:
        """hf_config parsed (shared: do not change it): {} where the learner sent none (a llama spec,
        described by the fields above)."""
        return _parsed(self.hf_config)

    def recipe(self) -> dict:
        """gguf_recipe parsed (shared: do not change it): {} where the learner sent none."""
        return _parsed(self.gguf_recipe)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        spec = cls(**data)
        if not isinstance(spec.hf_config, str) or len(spec.hf_config) > MAX_HF_CONFIG:
            raise TypeError(f"hf_config must be JSON text of at most {MAX_HF_CONFIG} bytes")
        if not isinstance(spec.gguf_recipe, str) or len(spec.gguf_recipe) > MAX_GGUF_RECIPE:
            raise TypeError(f"gguf_recipe must be JSON text of at most {MAX_GGUF_RECIPE} bytes")
        try:
            config, recipe = spec.config(), spec.recipe()
        except (ValueError, RecursionError):
            raise TypeError("hf_config or gguf_recipe is not JSON") from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type", ""), str):
            raise TypeError("hf_config is not a config.json object with a model_type")
        shape = {"arch": str, "kv": list, "nodes": list, "tensors": list}
        if not isinstance(recipe, dict) or ("arch" in recipe and not all(
                isinstance(recipe.get(k), t) for k, t in shape.items())):  # fmt: skip
            raise TypeError("gguf_recipe is not a recipe (arch, kv, nodes, tensors)")
        return spec


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> Any:
    """JSON text parsed once: a spec's recipe is read at every version a worker stages."""
    return json.loads(text) if text else {}


def is_adapter(name: str) -> bool:
    """Whether a wire tensor name is a LoRA adapter matrix (`<weight>.lora_A.weight` or `.lora_B.weight`)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions: temperature (0: greedy, for evaluation), nucleus top_p, a token budget, a seed;
    what else ends a completion: `stop_ids`, tokens besides the model's end-of-turn ones (an empty set: none
    at all, only the budget; a lease carries a non-empty set), and `stop_when(tokens so far)` (e.g. a stop
    string in their text; never in a lease)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    stop_ids: frozenset[int] | None = None
    stop_when: Callable[[list[int]], bool] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already rendered and tokenized by the learner) to complete `group_size` times.

    `group` is the prompt group's id: with the lease's seed, the completion's index and the token's
    position it keys every random draw (p2p.draws), so the learner can replay them. `greedy`: one
    completion of the most likely tokens (held-out evaluation), whatever the lease's temperature.

    A model turn of a multi-turn episode (envs.episode) continues the episode: `prompt_ids` holds the episode
    so far, `completion` is the episode's index in its group and `position` the number of tokens it holds
    after its first prompt, so that the turn's draws are keyed (group, completion + j, position + i) as if
    the episode were one completion. `episode`: an environment's group, the seed its episodes reset with."""

    prompt_ids: list[int]
    group_size: int
    group: int = 0
    greedy: bool = False
    completion: int = 0
    position: int = 0
    episode: int | None = None


@dataclass
class Completion:
    """A sampled completion with the behaviour policy's log-probability of every sampled token.

    `logprobs[i]` is log mu(tokens[i] | prompt, tokens[:i]) under the exact distribution the token was
    drawn from (temperature and top-p applied), which the learner needs for importance weighting.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end-of-sequence token was sampled, or the environment ended it), "length",
    # or, for an episode only, "error" (the environment's step raised: envs.episode)
    spans: list[int] = field(default_factory=list)  # an episode's turns (see sampled_positions); [] one turn
    reward: float | None = None  # an episode's return, as the worker's environment computed it


class Engine(Protocol):
    """The contract every inference engine keeps (worker.engines.llamacpp and .hf), which the worker's
    daemon, the co-located loop, evaluation and the Python API sample through.

    `generate` returns, per request, `group_size` completions in order, each drawn from the lease's
    counter-based draws (worker.sampling) with its behaviour logprobs; `stage` prepares a version beside
    the live one (safe while generate() runs on another thread), `install` swaps it in between leases,
    `discard` frees one not used; `load_policy` (float weights, LoRA adapters among them merged in) and
    `load_adapters` (hot-swapped on the loaded base, replacing the last ones) stage and install at once;
    `logits` gives the next-token logits at every position of one sequence (prompt logprobs); `unsupported`
    says why the engine cannot run a model (None: it can), before any weights are fetched."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]: ...

    def stage(
        self, spec: ModelSpec, weights: Mapping[str, np.ndarray] | None, adapters: Mapping[str, np.ndarray] | None
    ) -> Any: ...

    def install(self, staged: Any) -> None: ...

    def discard(self, staged: Any) -> None: ...

    def load_policy(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None: ...

    def load_adapters(self, spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> None: ...

    def logits(self, tokens: Sequence[int]) -> np.ndarray: ...

    def backend(self) -> dict[str, str | int]: ...

    def unsupported(self, spec: ModelSpec) -> str | None: ...


def sampled_count(n_tokens: int, spans: list[int]) -> int:
    """How many of a completion's `n_tokens` the policy sampled (see sampled_positions)."""
    return sum(spans[::2]) if spans else n_tokens


def sampled_positions(n_tokens: int, spans: list[int]) -> list[int]:
    """The indices of the sampled tokens among a completion's `n_tokens`.

    A single-turn completion (spans []) is sampled throughout. An episode's tokens alternate model turns
    and environment observations: spans = [model, observation, model, observation, ..., model] lengths,
    summing to n_tokens; observation tokens are written by the environment and are never trained on."""
    if not spans:
        return list(range(n_tokens))
    out, start = [], 0
    for k, length in enumerate(spans):
        if k % 2 == 0:
            out.extend(range(start, start + length))
        start += length
    return out


class MessageError(ValueError):
    """A request that breaks its protocol's schema or bounds: refused, and a penalty against its sender."""


LOGPROB_FLOOR = -50.0
"""Behaviour logprobs below this are refused at intake. An honest sampler draws a token below it with
probability under V * e^-50 (2e-17 for a 100k vocabulary) per token, at any temperature; a forged
-1000 would otherwise overflow the learner's importance ratio exp(logp - logp_mu)."""
MAX_VERSION = 2**31 - 1  # policy versions a peer may name (the learner refuses any it never published)
MAX_ADAPTER_SLOTS = 16  # LoRA versions a worker holds at once, switching per lease (SpecReply.adapter_slots)
MAX_RATE = 1e9  # tokens/s or $/h a worker may declare
MIN_TOKENS_PER_S = 1e-3
"""A declared generation rate is 0 (not measured yet) or at least this: slower than one token in 17 minutes is
no worker, and a tiny float (1e-307) would be flushed to 0 by the learner's arithmetic and divide by zero."""


def subnormal(x: float) -> bool:
    """Whether `x` is a nonzero subnormal float, read from its bits: the learner runs with flush-to-zero
    (torch.set_flush_denormal), under which a subnormal such as 5e-324 compares equal to 0."""
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return bits & 0x7FF0_0000_0000_0000 == 0 and bits & 0x000F_FFFF_FFFF_FFFF != 0


def _int(msg: dict, key: str, low: int, high: int, default: int | None = None) -> int:
    value = msg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MessageError(f"{key!r} must be an integer in [{low}, {high}], got {str(value)[:40]!r}")
    return value


def _float(msg: dict, key: str, low: float, high: float, default: float | None = None) -> float:
    value = msg.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise MessageError(f"{key!r} must be a number in [{low}, {high}], got {str(value)[:40]!r}")
    return float(value)


@dataclass(frozen=True)
class LeaseRequest:
    """/echo/lease/1: a worker asks for up to `max_groups` prompt groups to generate with `version`; `held`:
    the LoRA versions whose adapters it also holds and would switch to for a lease (SpecReply.adapter_slots)."""

    version: int
    max_groups: int = 1
    held: tuple[int, ...] = ()

    def to_wire(self) -> dict:
        out = {"version": self.version, "max_groups": self.max_groups}
        return out | ({"held": list(self.held)} if self.held else {})

    @classmethod
    def from_wire(cls, msg: dict) -> LeaseRequest:
        max_groups = _int({"max_groups": 1} | msg, "max_groups", 1, 1 << 16)
        return cls(_int(msg, "version", -1, MAX_VERSION), max_groups, _versions(msg.get("held", []), "held"))


def _versions(value: object, key: str) -> tuple[int, ...]:
    """At most MAX_ADAPTER_SLOTS distinct versions (0 to MAX_VERSION)."""
    versions = _ints(value, key, MAX_ADAPTER_SLOTS)
    if any(v > MAX_VERSION for v in versions) or len(set(versions)) != len(versions):
        raise MessageError(f"{key!r} must hold distinct versions of at most {MAX_VERSION}")
    return tuple(versions)


def describe_hardware(hardware: dict) -> str:
    """One bounded line from a worker's declared hardware (untrusted input: only known keys, short values),
    e.g. "llamacpp q8_0 on cuda NVIDIA GeForce RTX 4090 (24564 MB), 2 threads, x86_64 (16 cores)"."""

    def count(key: str) -> int | str:
        value = hardware.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 20 else "?"

    def text(key: str, default: str, limit: int) -> str:  # printable characters only: it reaches terminals
        return "".join(c for c in str(hardware.get(key, default))[:limit] if c.isprintable())

    engine, machine = text("engine", "?", 16), text("machine", "?", 16)
    if hardware.get("weights", "f16") != "f16":
        engine += f" {text('weights', '', 8)}"
    where = text("backend", "cpu", 16)
    if hardware.get("gpu"):
        where += f" {text('gpu', '', 32)} ({count('gpu_mem_mb')} MB)"
    return f"{engine} on {where}, {count('threads')} threads, {machine} ({count('cores')} cores)"


@dataclass(frozen=True)
class Heartbeat:
    """/echo/heartbeat/1: what a worker holds, how fast it is, what it costs and what it runs on."""

    version: int
    tokens_per_s: float = 0.0
    price: float = 0.0
    hardware: dict = field(default_factory=dict)  # short strings and small integers only
    punched: int = 0  # peers behind NATs it reached by hole punching (its own word: shown in status, nothing more)

    HARDWARE_KEYS = ("engine", "threads", "max_batch", "machine", "cores", "backend", "gpu", "gpu_mem_mb", "gpu_layers",
                     "weights", "build")  # weights: one of WEIGHT_FORMATS; build: its llama.cpp build (quantized)

    def to_wire(self) -> dict:
        return {
            "version": self.version,
            "tokens_per_s": self.tokens_per_s,
            "price": self.price,
            "hardware": self.hardware,
            "punched": self.punched,
        }

    @classmethod
    def from_wire(cls, msg: dict) -> Heartbeat:
        hardware = msg.get("hardware", {})
        if not isinstance(hardware, dict):
            raise MessageError("'hardware' must be a map")
        kept = {}
        for key in cls.HARDWARE_KEYS:  # unknown keys are ignored; known ones bounded
            value = hardware.get(key)
            if isinstance(value, str):
                kept[key] = value[:32]
            elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 20:
                kept[key] = value
        tokens_per_s = _float(msg, "tokens_per_s", 0.0, MAX_RATE, 0.0)
        if subnormal(tokens_per_s) or 0.0 < tokens_per_s < MIN_TOKENS_PER_S:
            raise MessageError(f"'tokens_per_s' must be 0 (unmeasured) or >= {MIN_TOKENS_PER_S}, got {tokens_per_s!r}")
        price = _float(msg, "price", 0.0, MAX_RATE, 0.0)
        punched = _int(msg, "punched", 0, 1 << 16, 0)
        return cls(_int(msg, "version", -1, MAX_VERSION), tokens_per_s, price, kept, punched)


@dataclass(frozen=True)
class GroupSubmission:
    """The G completions of one leased prompt group, in completion order (the order keys their draws)."""

    group: int
    completions: list[Completion]


@dataclass(frozen=True)
class RolloutSubmission:
    """/echo/rollout/1: a lease's completions, generated with policy `version`."""

    lease: int
    version: int
    groups: list[GroupSubmission]

    def to_wire(self) -> dict:
        return {
            "lease": self.lease,
            "version": self.version,
            "groups": [
                {
                    "group": g.group,
                    "completions": [
                        {"tokens": c.tokens, "logprobs": c.logprobs, "finish": c.finish_reason}
                        | ({"spans": c.spans, "reward": c.reward} if c.spans else {})
                        for c in g.completions
                    ],
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_wire(
        cls, msg: dict, group_size: int | list[int], max_tokens: int, vocab_size: int, max_turns: int = 0
    ) -> RolloutSubmission:
        """Parse and check everything that does not need the lease: counts, token ids in the vocabulary,
        one logprob per token, each finite and in [LOGPROB_FLOOR, 0], a known finish reason. `group_size`:
        the completions every group must have, or a list of them, one per group in order. `max_turns` > 0:
        every completion is an episode of at most that many model turns, with its spans and its return
        (their consistency with the environment is the learner's replay's to check: envs.episode)."""
        lease, version = _int(msg, "lease", 0, 2**64 - 1), _int(msg, "version", 0, MAX_VERSION)
        groups = msg.get("groups")
        if not isinstance(groups, list) or not groups:
            raise MessageError("'groups' must be a non-empty list")
        sizes = group_size if isinstance(group_size, list) else [group_size] * len(groups)
        if len(groups) != len(sizes):
            raise MessageError(f"the lease has {len(sizes)} groups")
        parsed = []
        for group, size in zip(groups, sizes, strict=True):
            if not isinstance(group, dict):
                raise MessageError("a group must be a map")
            completions = group.get("completions")
            if not isinstance(completions, list) or len(completions) != size:
                raise MessageError(f"a group needs exactly {size} completions")
            out = []
            for c in completions:
                if not isinstance(c, dict):
                    raise MessageError("a completion must be a map")
                tokens, logprobs, finish = c.get("tokens"), c.get("logprobs"), c.get("finish")
                if not isinstance(tokens, list) or not 1 <= len(tokens) <= max_tokens:
                    raise MessageError(f"a completion must have 1 to {max_tokens} tokens")
                if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
                    raise MessageError(f"token ids must be integers in [0, {vocab_size})")
                if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
                    raise MessageError("one logprob per token is required")
                if not all(type(x) is float and LOGPROB_FLOOR <= x <= 1e-6 for x in logprobs):
                    raise MessageError(f"logprobs must be floats in [{LOGPROB_FLOOR}, 0]")
                if finish not in ("stop", "length", "error") or (finish == "error" and not max_turns):
                    raise MessageError("finish must be 'stop' or 'length' (or 'error', for an episode)")
                spans, reward = c.get("spans", []), c.get("reward")
                if max_turns:
                    spans = _ints(spans, "spans", 2 * max_turns - 1)
                    if not spans or sum(spans) != len(tokens) or type(reward) is not float or not -1e6 <= reward <= 1e6:
                        raise MessageError("an episode needs spans summing to its tokens and a finite float reward")
                elif spans or reward is not None:
                    raise MessageError("spans and reward belong to an environment's episodes; this run has none")
                out.append(Completion(tokens, logprobs, finish, spans, reward))
            parsed.append(GroupSubmission(_int(group, "group", 0, 2**63 - 1), out))
        return cls(lease, version, parsed)


def _ints(value: object, key: str, limit: int = 1 << 16) -> list[int]:
    if not isinstance(value, list) or len(value) > limit or not all(type(t) is int and t >= 0 for t in value):
        raise MessageError(f"{key!r} must be a list of at most {limit} integers >= 0")
    return value


def _map(msg: object, key: str) -> dict:
    if not isinstance(msg, dict):
        raise MessageError(f"{key!r} must be a map")
    return msg


# the worker protocol's version: 5 adds hosted environments (ENV_STEP, EnvSpec.hosted) and tool calls (the chat
# format's tool fields), 4 fetches a version's chunks from the learner by claims (the learner picks which), 3
# sends a spec's vocabulary zstd-compressed, 2 added model families (ModelSpec.hf_config), 1 had none
PROTOCOL = 5
MAX_STOP_IDS = 64  # a lease's stop tokens besides end of turn (`echo-rl serve`'s requests bring theirs)
UPGRADE = "pip install -U echo-rl, or git pull && ./scripts/setup.sh in a checkout"


@dataclass(frozen=True)
class SpecRequest:
    """/echo/spec/1 request: the worker protocol the worker speaks (a worker before versioning sends {})."""

    protocol: int = PROTOCOL

    def to_wire(self) -> dict:
        return {"protocol": self.protocol}

    @classmethod
    def from_wire(cls, msg: dict) -> SpecRequest:
        return cls(_int(msg, "protocol", 1, 1 << 16) if "protocol" in msg else 1)

    def mismatch(self) -> str | None:
        """Why a learner of this PROTOCOL cannot serve the worker (None: it can): one of them is older."""
        if self.protocol == PROTOCOL:
            return None
        older = "worker" if self.protocol < PROTOCOL else "learner"
        return (
            f"the worker speaks protocol {self.protocol} and the learner {PROTOCOL}: upgrade echo-rl on the "
            f"{older} ({UPGRADE})"
        )


@dataclass(frozen=True)
class SpecReply:
    """/echo/spec/1 reply: the run's id (a new one when the learner restarts), the model, and G. `env`: a run
    on a multi-turn environment sends its rules, {"spec": envs.EnvSpec, "chat": envs.chat.ChatFormat} as
    wire maps (envs parses them: p2p does not know environments)."""

    run_id: str
    spec: ModelSpec
    group_size: int
    env: dict | None = None
    protocol: int = PROTOCOL  # the learner's (1: a learner before versioning, whose spec is a llama's)
    adapter_slots: int = 1  # > 1: each lease names the LoRA version it needs, of up to this many held at once
    quant_build: str = ""  # the llama.cpp build on which the learner replays quantized workers ("": it does not)
    weights_bytes: dict[str, int] = field(default_factory=dict)  # per format the learner takes: a worker's weights
    kv_bytes: int = 0  # one sequence's F16 KV cache (a prompt and the token budget): `worker join --quant auto`

    def to_wire(self) -> dict:
        spec = self.spec.to_dict()
        vocab = msgpack.packb([spec.pop(k) for k in VOCAB_FIELDS])
        spec["vocab"] = zstandard.ZstdCompressor(level=3).compress(vocab)  # see MAX_VOCAB
        out = {"run_id": self.run_id, "spec": spec, "group_size": self.group_size, "protocol": self.protocol}
        slots = {"adapter_slots": self.adapter_slots} if self.adapter_slots != 1 else {}
        quant = {"quant_build": self.quant_build} if self.quant_build else {}
        sizes = {"weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes} if self.weights_bytes else {}
        return out | slots | quant | sizes | ({"env": self.env} if self.env is not None else {})

    @classmethod
    def from_wire(cls, msg: dict) -> SpecReply:
        run_id = msg.get("run_id")
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 64:
            raise MessageError("'run_id' must be a string of 1 to 64 characters")
        spec = dict(_map(msg.get("spec"), "spec"))
        if "vocab" in spec:  # protocol 3 (before: the three lists as they are)
            spec.update(_vocab(spec.pop("vocab")))
        try:
            spec = ModelSpec.from_dict(spec)
        except (KeyError, TypeError) as exc:
            raise MessageError(f"'spec' is not a model spec ({exc})") from None
        env = msg.get("env")
        if env is not None:
            env = _map(env, "env")
            _map(env.get("spec"), "env.spec")
            _map(env.get("chat"), "env.chat")
        protocol = _int(msg, "protocol", 1, 1 << 16) if "protocol" in msg else 1
        slots = _int(msg, "adapter_slots", 1, MAX_ADAPTER_SLOTS, 1)
        quant_build = msg.get("quant_build", "")
        if not isinstance(quant_build, str) or len(quant_build) > 32 or not quant_build.isprintable():
            raise MessageError("'quant_build' must be a printable string of at most 32 characters")
        sizes = msg.get("weights_bytes", {})
        if not isinstance(sizes, dict) or not set(sizes) <= set(WEIGHT_FORMATS):
            raise MessageError(f"'weights_bytes' must map weight formats ({', '.join(WEIGHT_FORMATS)}) to sizes")
        sizes = {fmt: _int(sizes, fmt, 1, 1 << 50) for fmt in sizes}
        return cls(run_id, spec, _int(msg, "group_size", 1, 1 << 16), env, protocol, slots, quant_build, sizes,
                   _int(msg, "kv_bytes", 0, 1 << 40, 0))  # fmt: skip


def _vocab(packed: object) -> dict[str, list]:
    """A spec's compressed vocabulary: tokens and merges (strings), token types (ints), within MAX_VOCAB."""
    if not isinstance(packed, bytes):
        raise MessageError("'spec.vocab' must be zstd-compressed bytes")
    try:
        raw = bounded_decompress(packed, MAX_VOCAB)
        lists = msgpack.unpackb(raw, max_array_len=4 << 20, max_map_len=0, max_bin_len=0, max_ext_len=0,
                                max_str_len=1 << 16)  # fmt: skip
    except (FrameError, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MessageError(f"'spec.vocab' is not a vocabulary ({exc})") from None
    kinds = (str, int, str)
    if not (isinstance(lists, list) and len(lists) == 3 and all(
            isinstance(items, list) and all(type(x) is kind for x in items)
            for items, kind in zip(lists, kinds, strict=True))):  # fmt: skip
        raise MessageError("'spec.vocab' must hold lists of tokens, token types and merges")
    tokens, types, _ = lists
    if len(types) != len(tokens) or not all(0 <= t <= 6 for t in types):  # GGUF token types: 0 to 6
        raise MessageError("'spec.vocab' needs one token type (0 to 6) per token")
    return dict(zip(VOCAB_FIELDS, lists, strict=True))


@dataclass(frozen=True)
class LeaseGrant:
    """A lease: prompt groups to complete G times each with `params` (its seed keys every draw), using a
    policy version >= min_version, within deadline_s seconds. `alone`: each prompt group drawn in waves of its
    own (`echo-rl serve --sample-seed`: a group's tokens then do not depend on what else the lease holds)."""

    id: int
    requests: list[GenerationRequest]
    params: SamplingParams
    min_version: int
    deadline_s: float
    alone: bool = False

    def to_wire(self) -> dict:
        p = self.params
        return {
            "id": self.id,
            "groups": [
                {"group": r.group, "prompt_ids": r.prompt_ids}
                | ({"greedy": True} if r.greedy else {})
                | ({"completion": r.completion} if r.completion else {})
                | ({"episode": r.episode} if r.episode is not None else {})
                for r in self.requests
            ],
            "group_size": next((r.group_size for r in self.requests if not r.greedy), 1),
            "params": {"temperature": p.temperature, "top_p": p.top_p, "max_new_tokens": p.max_new_tokens,
                       "seed": p.seed} | ({"stop_ids": sorted(p.stop_ids)} if p.stop_ids else {}),
            "min_version": self.min_version,
            "deadline_s": self.deadline_s,
        } | ({"alone": True} if self.alone else {})  # fmt: skip

    @classmethod
    def from_wire(cls, msg: dict) -> LeaseGrant:
        group_size, groups = _int(msg, "group_size", 1, 1 << 16), msg.get("groups")
        if not isinstance(groups, list) or not 0 < len(groups) <= 1 << 16:
            raise MessageError("'groups' must be a non-empty list")
        requests = []
        for g in groups:
            g = _map(g, "groups")
            greedy = g.get("greedy", False)
            if not isinstance(greedy, bool):
                raise MessageError("'greedy' must be true or false")
            episode = _int(g, "episode", 0, 2**63 - 1) if "episode" in g else None
            completion = _int(g, "completion", 0, 1 << 16, 0)  # its first completion's index (a greedy one's: k)
            requests.append(GenerationRequest(_ints(g.get("prompt_ids"), "prompt_ids"), 1 if greedy else group_size,
                                              _int(g, "group", 0, 2**63 - 1), greedy, completion,
                                              episode=episode))  # fmt: skip
        p = _map(msg.get("params"), "params")
        stop_ids = _ints(p["stop_ids"], "stop_ids", MAX_STOP_IDS) if "stop_ids" in p else None
        params = SamplingParams(
            _float(p, "temperature", 1e-6, 100.0), _float(p, "top_p", 1e-6, 1.0),
            _int(p, "max_new_tokens", 1, 1 << 20), _int(p, "seed", 0, 2**64 - 1),
            frozenset(stop_ids) if stop_ids else None,
        )  # fmt: skip
        alone = msg.get("alone", False)
        if not isinstance(alone, bool):
            raise MessageError("'alone' must be true or false")
        return cls(_int(msg, "id", 0, 2**64 - 1), requests, params, _int(msg, "min_version", 0, MAX_VERSION),
                   _float(msg, "deadline_s", 0.0, 1e7), alone)  # fmt: skip


@dataclass(frozen=True)
class LeaseReply:
    """/echo/lease/1 reply: a lease, or wait `wait` seconds (`inactive`: the scheduler has switched this
    worker off; it keeps relaying chunks). `newest` is the newest published version either way."""

    grant: LeaseGrant | None = None
    wait: float = 0.0
    newest: int = -1
    inactive: bool = False

    def to_wire(self) -> dict:
        if self.grant is not None:
            return {"lease": self.grant.to_wire()}
        return {"wait": self.wait, "newest": self.newest} | ({"inactive": True} if self.inactive else {})

    @classmethod
    def from_wire(cls, msg: dict) -> LeaseReply:
        if "lease" in msg:
            return cls(LeaseGrant.from_wire(_map(msg["lease"], "lease")))
        inactive = msg.get("inactive", False)
        return cls(None, _float(msg, "wait", 0.0, 3600.0), _int(msg, "newest", -1, MAX_VERSION), inactive is True)


@dataclass(frozen=True)
class RolloutReply:
    """/echo/rollout/1 reply: how many prompt groups were accepted (all of the lease's, or an error)."""

    accepted: int

    def to_wire(self) -> dict:
        return {"accepted": self.accepted}

    @classmethod
    def from_wire(cls, msg: dict) -> RolloutReply:
        return cls(_int(msg, "accepted", 0, 1 << 16))


@dataclass(frozen=True)
class HeartbeatReply:
    """/echo/heartbeat/1 reply: the newest published version (-1 before the first); `active`: the LoRA versions
    whose requests are waiting, for a worker that holds several (SpecReply.adapter_slots) to fetch."""

    newest: int
    active: tuple[int, ...] = ()

    def to_wire(self) -> dict:
        return {"newest": self.newest} | ({"active": list(self.active)} if self.active else {})

    @classmethod
    def from_wire(cls, msg: dict) -> HeartbeatReply:
        return cls(_int(msg, "newest", -1, MAX_VERSION), _versions(msg.get("active", []), "active"))


MAX_TURNS_PER_STEP = 1 << 12  # episode turns one ENV_STEP request may carry (a lease's live episodes)


@dataclass(frozen=True)
class EpisodeTurn:
    """A model turn of episode `completion` of group `group`, its `turn`-th (0-based), for a hosted environment."""

    group: int
    completion: int
    turn: int
    tokens: list[int]


@dataclass(frozen=True)
class EnvStepRequest:
    """/echo/env-step/1 request: the lease's model turns the learner's hosted environment steps on (one per live
    episode; envs.episode plays, learner.orchestrate.hosting hosts)."""

    lease: int
    turns: list[EpisodeTurn]

    def to_wire(self) -> dict:
        return {"lease": self.lease, "turns": [[t.group, t.completion, t.turn, t.tokens] for t in self.turns]}

    @classmethod
    def from_wire(cls, msg: dict, max_tokens: int) -> EnvStepRequest:
        turns = _map(msg, "env step").get("turns")
        if not isinstance(turns, list) or not 0 < len(turns) <= MAX_TURNS_PER_STEP:
            raise MessageError(f"'turns' must be a list of 1 to {MAX_TURNS_PER_STEP} turns")
        out = []
        for t in turns:
            if not (isinstance(t, list) and len(t) == 4 and all(type(v) is int and 0 <= v < 1 << 62 for v in t[:3])):
                raise MessageError("a turn is [group, completion, turn, tokens]")
            out.append(EpisodeTurn(t[0], t[1], t[2], _ints(t[3], "tokens", max_tokens)))
        return cls(_int(msg, "lease", 0, 1 << 62), out)


@dataclass(frozen=True)
class EpisodeStep:
    """What the hosted environment answered to one turn: the tokens that follow it (its observation, as the
    chat template writes it; none when the episode is over), whether it is, how (finish) and the return so far."""

    observation: list[int]
    done: bool
    finish: str  # "stop", "length" or "error" once done, else ""
    reward: float


@dataclass(frozen=True)
class EnvStepReply:
    """/echo/env-step/1 reply: one EpisodeStep per turn of the request, in order."""

    steps: list[EpisodeStep]

    def to_wire(self) -> dict:
        return {"steps": [[s.observation, s.done, s.finish, s.reward] for s in self.steps]}

    @classmethod
    def from_wire(cls, msg: dict, n_turns: int) -> EnvStepReply:
        steps = _map(msg, "env step reply").get("steps")
        if not isinstance(steps, list) or len(steps) != n_turns:
            raise MessageError(f"'steps' must answer each of the {n_turns} turns")
        out = []
        for s in steps:
            if not (isinstance(s, list) and len(s) == 4 and type(s[1]) is bool
                    and s[2] in ("", "stop", "length", "error") and type(s[3]) in (int, float)):  # fmt: skip
                raise MessageError("a step is [observation, done, finish, reward]")
            out.append(EpisodeStep(_ints(s[0], "observation", 1 << 20), s[1], s[2], float(s[3])))
        return cls(out)


# Protocols between workers and the learner (the broadcast ones are in p2p.broadcast).
SPEC = "/echo/spec/1"  # SpecRequest -> SpecReply
LEASE = "/echo/lease/1"  # LeaseRequest -> LeaseReply
ROLLOUT = "/echo/rollout/1"  # RolloutSubmission -> RolloutReply
HEARTBEAT = "/echo/heartbeat/1"  # Heartbeat -> HeartbeatReply
STATUS = "/echo/status/1"  # {} -> the learner's status document (docs/status.md)
ENV_STEP = "/echo/env-step/1"  # EnvStepRequest -> EnvStepReply (a hosted environment's observations)
