"""One Tinker training client's model: its own LoRA adapters on a base model it shares with the other clients
of that base model (SharedBase), or every weight of its own copy (OwnCopy: full fine-tuning), and its own AdamW.

    forward_backward(datums, loss)  ->  logp of each target token, and loss.backward() (unless forward-only)
    optim_step(adam)                ->  clip the accumulated gradient, one AdamW step, zero it

Datum i's position t predicts target_tokens[t] from model_input[: t + 1] (Tinker's alignment). Datums go
through the model in passes of at most TOKENS_PER_PASS padded tokens (and LOGITS_PER_PASS logits), each pass's
loss backward at once: every loss is a sum over tokens, so the accumulated gradient is the whole request's.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.serve.losses import LOSSES, Loss
from learner.serve.wire import Datum, ForwardBackward, RequestError
from learner.train.devices import resolve_device
from learner.train.lora import add_lora, lora_targets
from learner.train.models import load_policy
from learner.train.trainer import model_device, token_logprobs
from learner.train.wire_weights import wire_name, wire_state

TOKENS_PER_PASS = 2048  # padded tokens through the model at once (bounds a pass's activations)
LOGITS_PER_PASS = 1 << 25  # and tokens x vocabulary (128 MiB per float32 copy of the logits). SmolLM2, a step of
# 64 datums of 175 tokens on 2 CPU cores: passes of 5461 tokens peaked at 12.4 GB (67 s), 1365 at 5.9 GB (48 s),
# 682 (this bound) at 3.1 GB (52 s): activations and logits both grow with the pass


class SharedBase:
    """A base model loaded once for all the training clients on it: each client's LoRA is a peft adapter of its
    own name, active only while that client's job runs (the model thread runs one job at a time), so clients
    share the base weights and never each other's adapters."""

    def __init__(self, base_model: str, cache_dir: str, device: str) -> None:
        self.policy = load_policy(base_model, cache_dir)  # (`tiny`'s random weights: always seed 0's)
        self.tokenizer_id = tokenizer_source(base_model, cache_dir, self.policy.tokenizer)
        self.model = self.policy.model.to(resolve_device(device)).eval()  # eval: no dropout in the logprobs
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.targets = lora_targets(self.model)  # (once: peft's layers wrap the linear ones)
        self.layers: list[Any] = []  # peft's LoRA layers (every adapter's)
        self.count = itertools.count()
        self.active: str | None = None

    def add(self, rank: int, seed: int, head: bool) -> str:
        """A new adapter (alpha = rank: it adds B A), its A drawn from `seed`; returns its name."""
        from peft.tuners.lora import LoraLayer

        name = f"client{next(self.count)}"
        torch.manual_seed(seed)
        with warnings.catch_warnings():  # peft warns of an adapter on a tied output layer (only the head gets
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # it), and of several adapters
            warnings.filterwarnings("ignore", message=".*multiple adapters.*")
            add_lora(self.model, rank, alpha=float(rank), head=head, name=name, targets=self.targets)
        self.layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        self.active = None
        return name

    def activate(self, name: str) -> None:
        """Make adapter `name` the one forward passes use (and the only one with requires_grad)."""
        if self.active != name:
            for layer in self.layers:
                layer.set_adapter(name)
            self.active = name

    def remove(self, name: str) -> None:
        with warnings.catch_warnings():  # (peft warns when the adapter removed is the active one)
            warnings.simplefilter("ignore")
            for layer in self.layers:
                if name in layer.lora_A:
                    layer.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)
        self.active = None


class OwnCopy(SharedBase):
    """A base model loaded for one full fine-tuning client: every weight its own to train (SharedBase's interface)."""

    def add(self, rank: int, seed: int, head: bool) -> str:
        self.model.requires_grad_(True)
        return "full"

    def activate(self, name: str) -> None:
        pass

    def remove(self, name: str) -> None:
        pass


class TrainedModel:
    """A training client: its own rank-`lora_rank` adapters on a SharedBase, or (rank 0) every weight of an
    OwnCopy, and its own AdamW. Its "adapters" (adapter_tensors, restore) are then all its weights."""

    def __init__(self, base: SharedBase, lora_rank: int, seed: int = 0, head: bool = True) -> None:
        self.base, self.model = base, base.model
        self.context, self.vocab, self.tokenizer_id = base.context, base.vocab, base.tokenizer_id
        self.name = base.add(lora_rank, seed, head)
        self.full = isinstance(base, OwnCopy)
        mine = [(n, p) for n, p in self.model.named_parameters() if self.full or f".{self.name}." in n]
        self.wire_names = [wire_name(n.replace(f".{self.name}.", ".default.")) for n, _ in mine]
        self.params = [p for _, p in mine]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def close(self) -> None:
        """Take the adapters off the shared base (the client is gone)."""
        self.base.remove(self.name)

    def weights(self) -> dict[str, torch.Tensor]:
        """What the client trains under wire names: its adapters, or (full) every weight of its model as a
        version carries them (learner.train.wire_weights: the tied output layer once, buffers too)."""
        return wire_state(self.model) if self.full else dict(zip(self.wire_names, self.params, strict=True))

    def adapter_tensors(self) -> dict[str, np.ndarray]:
        """A copy of weights() as float32 arrays (what save_weights_for_sampler and save_state keep)."""
        return {n: p.detach().to("cpu", torch.float32, copy=True).numpy() for n, p in self.weights().items()}

    def optimizer_state(self) -> dict:
        """AdamW's state (what save_state keeps beside the adapters): by parameter order, which the same base
        model, rank and output-layer choice give again."""
        return self.optimizer.state_dict()

    def restore(self, adapters: dict[str, np.ndarray], optimizer: dict | None) -> None:
        """Put saved adapters (wire names, as adapter_tensors gives them) and, if given, AdamW's state back."""
        params = self.weights()
        wrong = sorted(set(params) ^ set(adapters)) or [n for n, p in params.items()
                                                         if tuple(p.shape) != adapters[n].shape]  # fmt: skip
        if wrong:
            raise RequestError(f"the checkpoint's adapters do not fit this model (first: {wrong[0]})")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(adapters[name]))
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)  # fresh: a gradient or moments from before
        self.optimizer.zero_grad(set_to_none=True)  # the load would apply to the loaded weights
        if optimizer is not None:
            try:
                self.optimizer.load_state_dict(optimizer)
            except (KeyError, ValueError, RuntimeError) as exc:
                raise RequestError(f"the checkpoint's optimizer state does not fit this model ({exc})") from None

    def forward_backward(self, request: ForwardBackward) -> tuple[list[np.ndarray], dict[str, float]]:
        """Each datum's target logprobs (float32 [N]) and the metrics ({"loss:sum": L}); the gradient of L is
        added to the accumulated one unless the request is forward-only."""
        loss = LOSSES.get(request.loss_fn)
        if loss is None:
            raise RequestError(f"loss_fn {request.loss_fn!r} is not served; choose one of {sorted(LOSSES)}")
        unknown = set(request.config) - set(loss.config)
        if unknown:
            raise RequestError(f"loss_fn_config of {request.loss_fn}: {sorted(unknown)} not understood")
        config = loss.config | request.config
        if missing := sorted(k for k, v in config.items() if v != v):  # (losses.REQUIRED is NaN)
            raise RequestError(f"loss_fn {request.loss_fn} needs loss_fn_config values for {missing} (no default)")
        if not 0.0 <= config.get("beta", 0.0) <= 1e6:  # (larger overflows float32 in the penalty)
            raise RequestError(f"loss_fn_config: beta {config['beta']} must be in [0, 1e6]")
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 0.0)
        if not 0.0 <= low <= high:
            raise RequestError(f"loss_fn_config: clip_low_threshold {low} must be in [0, clip_high_threshold {high}]")
        for datum in request.data:
            for name, value in loss.absent.items():
                if name not in datum.inputs:
                    filled = value(datum.inputs) if callable(value) else np.full(len(datum.tokens), value, np.float32)
                    datum.inputs[name] = filled
            self._check(datum, ("target_tokens", *loss.inputs))
        self.base.activate(self.name)
        try:
            return self._passes(request, loss, config)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # the accumulated gradient would hold a part of this one
            raise

    def _passes(self, request: ForwardBackward, loss: Loss, config: dict[str, float]) -> tuple[list, dict]:
        logprobs, total = [], 0.0
        for batch in passes(request.data, max(1, min(TOKENS_PER_PASS, LOGITS_PER_PASS // self.vocab))):
            with torch.set_grad_enabled(not request.forward_only):
                logp = self._target_logprobs(batch)  # [N] over the pass's datums
                inputs = {name: flat(batch, name).to(logp.device) for name in loss.inputs}  # each [N]
                sizes = torch.tensor([len(d.tokens) for d in batch])
                inputs["datum"] = torch.repeat_interleave(torch.arange(len(batch)), sizes).to(logp.device)  # [N]
                value = loss.fn(logp, inputs, config)
                if not request.forward_only:
                    value.backward()
            total += float(value.detach())
            lengths = np.cumsum([len(d.tokens) for d in batch])[:-1]
            logprobs += np.split(logp.detach().float().cpu().numpy(), lengths)
        return logprobs, {"loss:sum": total}

    def optim_step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:  # fmt: skip
        """One AdamW step with these hyperparameters (Tinker sends them with every step); grad_clip_norm 0: no
        clipping. The gradient is zeroed after (AdamW's moments stay, as they would between Tinker's steps)."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        finite = bool(torch.isfinite(norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # a non-finite gradient (a loss that overflowed) is dropped, not stepped on, and said so
        return {"grad_norm:mean": float(norm)} if finite else {"skipped_steps:sum": 1.0}

    def _check(self, datum: Datum, names: tuple[str, ...]) -> None:
        """The datum's inputs are all there, of the right type and within the model's vocabulary and context."""
        if len(datum.tokens) > self.context:
            raise RequestError(f"a datum of {len(datum.tokens)} tokens exceeds the model's {self.context}")
        for name in names:
            x = datum.inputs.get(name)
            if x is None:
                raise RequestError(f"loss_fn_inputs lacks {name!r}")
            if name == "target_tokens" and x.dtype != np.int64:
                raise RequestError("target_tokens must be int64")
            if name != "target_tokens" and not np.isfinite(x).all():
                raise RequestError(f"loss_fn_inputs {name!r} holds a value that is not finite")
        for name, x in (("model_input", datum.tokens), ("target_tokens", datum.inputs["target_tokens"])):
            if len(x) and (x.min() < 0 or x.max() >= self.vocab):
                raise RequestError(f"{name} holds a token id outside the vocabulary (0 to {self.vocab - 1})")

    def _target_logprobs(self, batch: list[Datum]) -> torch.Tensor:
        """log pi_theta of every datum's target tokens, flat in datum order: [N]."""
        device = model_device(self.model)
        width = max(len(d.tokens) for d in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T]
        for b, d in enumerate(batch):
            ids[b, : len(d.tokens)] = torch.from_numpy(d.tokens)
            mask[b, : len(d.tokens)] = 1
        rows = torch.cat([torch.full((len(d.tokens),), b) for b, d in enumerate(batch)])  # [N]
        cols = torch.cat([torch.arange(len(d.tokens)) for d in batch])  # [N]
        targets = torch.from_numpy(np.concatenate([d.inputs["target_tokens"] for d in batch])).to(device)  # [N]
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                         logits_to_keep=1)  # fmt: skip
        hidden = out.hidden_states[-1][rows.to(device), cols.to(device)]  # [N, H]
        return token_logprobs(self.model, hidden, targets, 1.0, 1.0)


def tokenizer_source(name: str, cache_dir: str, tokenizer: Any) -> str:
    """What a client loads `name`'s tokenizer from (the SDK's get_tokenizer: AutoTokenizer.from_pretrained):
    a local folder's absolute path, a hub id as it is, else (tiny, smollm2-135m, a GGUF file) a folder the
    tokenizer is saved to once, in the cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if not path.exists() and name not in ("tiny", "smollm2-135m"):
        return name  # a hub id, which load_policy found in the local hub cache
    folder = Path(cache_dir).expanduser() / "tokenizers" / hashlib.sha256(name.encode()).hexdigest()[:16]
    if not (folder / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(folder)
    return str(folder.resolve())


def flat(batch: list[Datum], name: str) -> torch.Tensor:
    """Input `name` of every datum of `batch`, concatenated, as float32: [N]."""
    return torch.from_numpy(np.concatenate([d.inputs[name] for d in batch]).astype(np.float32))


def passes(data: list[Datum], tokens: int) -> list[list[Datum]]:
    """Consecutive datums in groups of at most `tokens` padded tokens (a longer datum alone)."""
    groups: list[list[Datum]] = []
    width = 0
    for d in data:
        if groups and max(width, len(d.tokens)) * (len(groups[-1]) + 1) <= tokens:
            groups[-1].append(d)
            width = max(width, len(d.tokens))
        else:
            groups.append([d])
            width = len(d.tokens)
    return groups
