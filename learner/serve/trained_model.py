"""One Tinker training client's model on the learner: a base policy with its own LoRA adapters and AdamW.

    forward_backward(datums, loss)  ->  logp of each target token, and loss.backward() (unless forward-only)
    optim_step(adam)                ->  clip the accumulated gradient, one AdamW step, zero it

Datum i's position t predicts target_tokens[t] from model_input[: t + 1] (Tinker's alignment). Datums go
through the model in passes of at most TOKENS_PER_PASS padded tokens, each pass's loss backward at once:
every loss is a sum over tokens, so the accumulated gradient is the whole request's.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.serve.losses import LOSSES, Loss
from learner.serve.wire import Datum, ForwardBackward, RequestError
from learner.train.data_parallel import World, full_optimizer_state, load_optimizer_state
from learner.train.devices import resolve_device
from learner.train.lora import add_lora
from learner.train.models import load_policy
from learner.train.trainer import model_device, token_logprobs
from learner.train.wire_weights import wire_name, wire_tensors

TOKENS_PER_PASS = 8192  # padded tokens through the model at once (bounds a pass's activations)


class TrainedModel:
    """`base_model` (a name learner.train.models.load_policy reads) with rank-`lora_rank` adapters."""

    def __init__(
        self, base_model: str, cache_dir: str, device: str, lora_rank: int, seed: int = 0, head: bool = True
    ) -> None:
        self.policy = load_policy(base_model, cache_dir)  # (`tiny`'s random weights: always seed 0's)
        self.tokenizer_id = tokenizer_source(base_model, cache_dir, self.policy.tokenizer)
        self.base_model, self.lora_rank = base_model, lora_rank
        model = self.policy.model.to(resolve_device(device))
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        torch.manual_seed(seed)  # the adapters' random A matrices
        with warnings.catch_warnings():  # peft warns of an adapter on a tied output layer: only the head gets it
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            add_lora(model, lora_rank, alpha=float(lora_rank), head=head)  # alpha = r: an adapter adds B A
        model.eval()  # no dropout: a forward pass gives the logprobs the loss uses
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)

    def adapter_tensors(self) -> dict[str, np.ndarray]:
        """A copy of the adapters under their wire names, float32 (what save_weights_for_sampler keeps)."""
        return wire_tensors(self.model, adapter_only=True)

    def optimizer_state(self) -> dict:
        """AdamW's state keyed by parameter name (what save_state keeps beside the adapters)."""
        return full_optimizer_state(self.model, self.optimizer, World())

    def restore(self, adapters: dict[str, np.ndarray], optimizer: dict | None) -> None:
        """Put saved adapters (wire names, as adapter_tensors gives them) and, if given, AdamW's state back."""
        params = {wire_name(n): p for n, p in self.model.named_parameters() if p.requires_grad}
        wrong = sorted(set(params) ^ set(adapters)) or [n for n, p in params.items()
                                                         if tuple(p.shape) != adapters[n].shape]  # fmt: skip
        if wrong:
            raise RequestError(f"the checkpoint's adapters do not fit this model (first: {wrong[0]})")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(adapters[name]))
        if optimizer is not None:
            try:
                load_optimizer_state(self.model, self.optimizer, optimizer)
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
        low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 0.0)
        if not 0.0 <= low <= high:
            raise RequestError(f"loss_fn_config: clip_low_threshold {low} must be in [0, clip_high_threshold {high}]")
        for datum in request.data:
            for name, value in loss.absent.items():
                datum.inputs.setdefault(name, np.full(len(datum.tokens), value, np.float32))
            self._check(datum, ("target_tokens", *loss.inputs))
        try:
            return self._passes(request, loss, config)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # the accumulated gradient would hold a part of this one
            raise

    def _passes(self, request: ForwardBackward, loss: Loss, config: dict[str, float]) -> tuple[list, dict]:
        logprobs, total = [], 0.0
        for batch in passes(request.data):
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


def passes(data: list[Datum]) -> list[list[Datum]]:
    """Consecutive datums in groups of at most TOKENS_PER_PASS padded tokens (a longer datum alone)."""
    groups: list[list[Datum]] = []
    width = 0
    for d in data:
        if groups and max(width, len(d.tokens)) * (len(groups[-1]) + 1) <= TOKENS_PER_PASS:
            groups[-1].append(d)
            width = max(width, len(d.tokens))
        else:
            groups.append([d])
            width = len(d.tokens)
    return groups
