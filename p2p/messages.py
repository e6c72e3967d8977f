"""Plain data types that cross the learner/worker boundary.

They hold only Python scalars, lists and numpy arrays so that a worker needs neither torch nor
transformers, and so that they can be serialised with msgpack when they travel over the swarm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    """Everything a worker needs to run a llama-architecture policy besides its tensors.

    The tokenizer is carried as a byte-level BPE vocabulary so that llama.cpp can load the model;
    workers never tokenize text themselves (prompts arrive as token ids).
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
    lora_rank: int = 0  # > 0: versions after the first carry only LoRA adapters (see learner.lora)
    lora_alpha: float = 0.0  # an adapter adds (lora_alpha / lora_rank) * B A to its weight

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        return cls(**data)


def is_adapter(name: str) -> bool:
    """Whether a wire tensor name is a LoRA adapter matrix (`<weight>.lora_A.weight` or `.lora_B.weight`)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions: temperature > 0, nucleus top_p, a token budget and a seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (already rendered and tokenized by the learner) to complete `group_size` times.

    `group` is the prompt group's id: with the lease's seed, the completion's index and the token's
    position it keys every random draw (p2p.draws), so the learner can replay them."""

    prompt_ids: list[int]
    group_size: int
    group: int = 0


@dataclass
class Completion:
    """A sampled completion with the behaviour policy's log-probability of every sampled token.

    `logprobs[i]` is log mu(tokens[i] | prompt, tokens[:i]) under the exact distribution the token was
    drawn from (temperature and top-p applied), which the learner needs for importance weighting.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end-of-sequence token was sampled) or "length"


class MessageError(ValueError):
    """A request that breaks its protocol's schema or bounds: refused, and a penalty against its sender."""


LOGPROB_FLOOR = -50.0
"""Behaviour logprobs below this are refused at intake. An honest sampler draws a token below it with
probability under V * e^-50 (2e-17 for a 100k vocabulary) per token, at any temperature; a forged
-1000 would otherwise overflow the learner's importance ratio exp(logp - logp_mu)."""
MAX_VERSION = 2**31 - 1  # policy versions a peer may name (the learner refuses any it never published)
MAX_RATE = 1e9  # tokens/s or $/h a worker may declare


def _int(msg: dict, key: str, low: int, high: int) -> int:
    value = msg.get(key)
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
    """/echo/lease/1: a worker asks for up to `max_groups` prompt groups to generate with `version`."""

    version: int
    max_groups: int = 1

    def to_wire(self) -> dict:
        return {"version": self.version, "max_groups": self.max_groups}

    @classmethod
    def from_wire(cls, msg: dict) -> LeaseRequest:
        return cls(_int(msg, "version", -1, MAX_VERSION), _int({"max_groups": 1} | msg, "max_groups", 1, 1 << 16))


@dataclass(frozen=True)
class Heartbeat:
    """/echo/heartbeat/1: what a worker holds, how fast it is, what it costs and what it runs on."""

    version: int
    tokens_per_s: float = 0.0
    price: float = 0.0
    hardware: dict = field(default_factory=dict)  # short strings and small integers only

    HARDWARE_KEYS = ("engine", "threads", "max_batch", "machine", "cores")

    def to_wire(self) -> dict:
        return {
            "version": self.version,
            "tokens_per_s": self.tokens_per_s,
            "price": self.price,
            "hardware": self.hardware,
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
        return cls(
            _int(msg, "version", -1, MAX_VERSION),
            _float(msg, "tokens_per_s", 0.0, MAX_RATE, 0.0),
            _float(msg, "price", 0.0, MAX_RATE, 0.0),
            kept,
        )


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
                        {"tokens": c.tokens, "logprobs": c.logprobs, "finish": c.finish_reason} for c in g.completions
                    ],
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_wire(cls, msg: dict, group_size: int, max_tokens: int, vocab_size: int) -> RolloutSubmission:
        """Parse and check everything that does not need the lease: counts, token ids in the vocabulary,
        one logprob per token, each finite and in [LOGPROB_FLOOR, 0], a known finish reason."""
        lease, version = _int(msg, "lease", 0, 2**64 - 1), _int(msg, "version", 0, MAX_VERSION)
        groups = msg.get("groups")
        if not isinstance(groups, list) or not groups:
            raise MessageError("'groups' must be a non-empty list")
        parsed = []
        for group in groups:
            if not isinstance(group, dict):
                raise MessageError("a group must be a map")
            completions = group.get("completions")
            if not isinstance(completions, list) or len(completions) != group_size:
                raise MessageError(f"a group needs exactly {group_size} completions")
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
                if finish not in ("stop", "length"):
                    raise MessageError("finish must be 'stop' or 'length'")
                out.append(Completion(tokens, logprobs, finish))
            parsed.append(GroupSubmission(_int(group, "group", 0, 2**63 - 1), out))
        return cls(lease, version, parsed)


# Protocols between workers and the learner (the broadcast ones are in p2p.broadcast).
SPEC = "/echo/spec/1"  # {} -> {"run_id", "spec": ModelSpec dict}
LEASE = "/echo/lease/1"  # {"version", "max_groups"} -> {"lease": {...}} or {"wait": seconds, "newest": v}
ROLLOUT = "/echo/rollout/1"  # {"lease", "version", "groups": [...]} -> {"accepted", "stale"}
HEARTBEAT = "/echo/heartbeat/1"  # {"version", "tokens_per_s", "price"} -> {"newest": v}
STATUS = "/echo/status/1"  # {} -> the learner's status document (see learner.service.LearnerService.status)
