"""`echo-rl serve`'s configuration: the [serve] table of a TOML file, every field also a flag."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from learner.config import DEVICE_NAMES
from p2p.config import ConfigError, require


@dataclass
class ServeConfig:
    """What the Tinker API is served on and for whom."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface; the API is plain HTTP, put TLS in front of it)."""
    port: int = 8000
    """TCP port of the API (a client's base_url is http://HOST:PORT)."""
    models: str = "smollm2-135m"
    """Base models a client may train, comma-separated (`smollm2-135m`, `tiny`, local HF folders)."""
    cache_dir: str = "~/.cache/echo-rl"
    """Where converted model weights are cached between runs."""
    device: str = "auto"
    """Where the models train: auto (cuda if any), cpu, cuda, cuda:N."""
    api_key_file: str = "~/.config/echo-rl/serve-keys"
    """API keys, one per line, each `tml-...` (the SDK's form); a missing file is made with one new key."""
    checkpoint_dir: str = "~/.local/share/echo-rl/serve-checkpoints"
    """Where save_state checkpoints and named sampler weights are kept (they outlive the server)."""
    max_models_per_key: int = 4
    """Training clients one API key may hold at once (each its adapters and AdamW state; the base is shared)."""
    max_full_models: int = 0
    """Full fine-tuning clients (LoRA rank 0) at once, all keys together (0: LoRA only). Each holds a float32 copy
    of its base model, its gradient and AdamW's moments (16 bytes a parameter), and its samplers and
    checkpoints every weight (docs/tinker.md)."""

    swarm_listen: str = ""
    """Multiaddr where workers join to draw samples (e.g. /ip4/0.0.0.0/tcp/4001; "": all drawn here)."""
    swarm_dir: str = "~/.local/share/echo-rl/serve-swarm"
    """The swarm side's identity, address file (learner.addr, for `worker join`) and version chunks."""
    swarm_secret_file: str = ""
    """File holding the swarm secret (`echo-rl secret`): only workers proving it sample ("": any worker)."""

    sample_seed: int = -1
    """Unseeded asample requests draw from this seed, the sampler, the prompt and how often the key asked it,
    and every sample's logprobs are scored alone: a recipe run sending the same requests gets the same samples
    and logprobs, here or from workers, beside any other tenant (-1: each draws afresh; docs/tinker.md)."""
    sampler_threads: int = 2
    """CPU threads the sampler uses (transformers engine, on `device`)."""
    sampler_max_batch: int = 32
    """Sequences the sampler decodes together (a request's samples go in waves of this many)."""

    def validate(self) -> None:
        require(self.sampler_threads >= 1, "serve.sampler_threads", "must be >= 1")
        require(self.sampler_max_batch >= 1, "serve.sampler_max_batch", "must be >= 1")
        require(1 <= self.port <= 65535, "serve.port", f"must be 1 to 65535, got {self.port}")
        require(bool(self.model_names()), "serve.models", "must name at least one base model")
        require(DEVICE_NAMES.fullmatch(self.device) is not None, "serve.device",
                f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")  # fmt: skip
        seed = self.sample_seed
        require(-1 <= seed < 1 << 63, "serve.sample_seed", f"must be -1 (afresh) to 2**63 - 1, got {seed}")
        per_key = self.max_models_per_key
        require(per_key >= 1, "serve.max_models_per_key", f"must be >= 1, got {per_key}")
        require(self.max_full_models >= 0, "serve.max_full_models", f"must be >= 0, got {self.max_full_models}")

    def model_names(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.models.split(",") if m.strip())


@dataclass
class ServeRootConfig:
    serve: ServeConfig = field(default_factory=ServeConfig)

    def validate(self) -> None:
        self.serve.validate()


def api_keys(path: str) -> frozenset[str]:
    """The keys in `path` (one per line; blank lines and # comments skipped). A missing file is created
    (mode 600) with one new key, which the caller prints."""
    file = Path(path).expanduser()
    if not file.exists():
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"tml-{secrets.token_urlsafe(24)}\n")
    try:
        lines = file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"serve.api_key_file {file}: cannot read it ({exc})") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    bad = [k for k in keys if not k.startswith("tml-") or len(k) < 16 or any(c.isspace() for c in k)]
    if bad:
        raise ConfigError(f"serve.api_key_file {file}: {bad[0][:8]}... is not a key: each is tml- and 12+ characters")
    if not keys:
        raise ConfigError(f"serve.api_key_file {file} holds no key: add a line tml-<random>, or delete the file")
    return frozenset(keys)
