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
    """One prompt (already rendered and tokenized by the learner) to complete `group_size` times."""

    prompt_ids: list[int]
    group_size: int


@dataclass
class Completion:
    """A sampled completion with the behaviour policy's log-probability of every sampled token.

    `logprobs[i]` is log mu(tokens[i] | prompt, tokens[:i]) under the exact distribution the token was
    drawn from (temperature and top-p applied), which the learner needs for importance weighting.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end-of-sequence token was sampled) or "length"


# Protocols between workers and the learner (the broadcast ones are in p2p.broadcast).
SPEC = "/echo/spec/1"  # {} -> {"run_id", "spec": ModelSpec dict}
LEASE = "/echo/lease/1"  # {"version", "max_groups"} -> {"lease": {...}} or {"wait": seconds, "newest": v}
ROLLOUT = "/echo/rollout/1"  # {"lease", "version", "groups": [...]} -> {"accepted", "stale"}
HEARTBEAT = "/echo/heartbeat/1"  # {"version", "tokens_per_s", "price"} -> {"newest": v}
STATUS = "/echo/status/1"  # {} -> the learner's status document (see learner.service.LearnerService.status)
