"""One GRPO optimizer step on a batch of scored rollouts, with micro-batching to bound memory.

The trainer reads four fields of a rollout (`TrainingSequence`); learner.orchestrate.rollouts.Rollout is
the one the learner passes, and this package never imports the swarm side."""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.utils.checkpoint import checkpoint

from learner.config import GRPOConfig
from learner.train.data_parallel import World
from learner.train.devices import autocast, grad_checkpointing_on
from learner.train.grpo import PROXIMAL_OBJECTIVES, TokenBatch, correction_weights, policy_loss
from p2p.messages import sampled_positions

log = logging.getLogger(__name__)


class TrainingSequence(Protocol):
    """What one step reads of a scored completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # log mu per completion token, from the sampler (0 for observation tokens)
    advantage: float
    spans: list[int]  # an episode's model / observation turns (p2p.messages.sampled_positions); [] one turn


def sampled(r: TrainingSequence) -> list[int]:
    """The positions in r.completion_ids that the policy sampled: the only ones trained on (an episode's
    observation tokens are context, never targets)."""
    return sampled_positions(len(r.completion_ids), r.spans)


def sampled_logprobs(r: TrainingSequence) -> list[float]:
    """The behaviour logprobs of r's sampled tokens, in order."""
    if not r.spans:
        return r.behaviour_logprobs
    return [r.behaviour_logprobs[i] for i in sampled(r)]


Batch = list[TrainingSequence]


@dataclass
class Padding:
    """The smallest sequence a forward pass accepts (a rank whose share of a minibatch is done)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float = 0.0
    spans: list[int] = field(default_factory=list)


class GRPOTrainer:
    """Owns the policy's optimizer (fused AdamW) and, when beta > 0, a frozen reference policy.

    `step(rollouts)` splits the batch into `grpo.minibatches` parts and takes one optimizer update on
    each: pi_theta's logprobs of the completion tokens (at the sampling temperature and top-p, as the
    sampler drew them), the loss of learner.train.grpo.policy_loss, a clipped gradient. An update whose loss
    or gradient is not finite is skipped (counted, logged): it never reaches the weights.

    The reference of the KL penalty is the initial policy: pass `reference` when the model already
    holds a checkpoint's weights (a resumed run), else it is copied from `model` here.

    `precision` bf16: the model's forward and backward passes run under bfloat16 autocast
    (learner.train.devices); the output layer, log-softmax and loss stay float32, so a token's ratio
    pi / mu is not rounded to bf16's 8 bits of mantissa.

    `max_completion_tokens` is the L of loss_norm = constant (Dr. GRPO's 1 / (n L)): the most tokens a
    completion can train on (the run's sampler.max_new_tokens, or an episode's budget).
    """

    def __init__(
        self, model: torch.nn.Module, cfg: GRPOConfig, temperature: float, world: World = World(),
        top_p: float = 1.0, reference: torch.nn.Module | None = None, precision: str = "fp32",
        max_completion_tokens: int | None = None,
    ) -> None:  # fmt: skip
        if cfg.loss_norm == "constant" and not max_completion_tokens:
            raise ValueError("loss_norm = constant needs max_completion_tokens (its fixed length L)")
        self.max_completion_tokens = max_completion_tokens or 1
        self.model = model
        self.precision = precision
        self.cfg = cfg
        self.temperature = temperature
        self.top_p = top_p
        self.world = world  # several ranks: `model` is sharded (train.data_parallel), each trains on its share
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            fused=True,  # on the CPU and on CUDA alike
        )
        self.reference = None
        if cfg.beta > 0:
            self.reference = reference if reference is not None else frozen_copy(model)
        self.skipped_updates = 0  # over the whole run: updates dropped for a non-finite loss or gradient

    def step(self, rollouts: list[TrainingSequence]) -> dict[str, float]:
        """One training step (grpo.minibatches optimizer updates); returns loss, grad norm, clip fraction,
        KL figures, tokens trained and updates skipped as non-finite."""
        cfg, world = self.cfg, self.world
        rollouts = [r for r in rollouts if r.completion_ids]
        n_mb = min(cfg.minibatches, len(rollouts))
        minibatches = [rollouts[i * len(rollouts) // n_mb : (i + 1) * len(rollouts) // n_mb] for i in range(n_mb)]
        # each rank's micro-batches of each minibatch; FSDP gathers each layer's weights in every pass, so
        # all ranks make as many passes (an empty one where a rank's share is done)
        plans = []
        for mb in minibatches:
            trained = [r for r in mb if not (cfg.skip_equal_groups and cfg.beta == 0 and r.advantage == 0.0)]
            passes = micro_batches(trained[world.rank :: world.size], cfg.micro_batch_tokens)
            passes += [[]] * (world.max(len(passes)) - len(passes))
            plans.append((mb, passes))
        # decoupled, gspo, cispo: pi_prox is the policy before this step's first update, for every rollout
        proximal = self._proximal_logprobs(plans) if cfg.objective in PROXIMAL_OBJECTIVES else None
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl_behaviour": 0.0, "ratio_mean": 0.0, "kl_ref": 0.0,
                "dropped_frac": 0.0, "grad_norm": 0.0}  # fmt: skip
        trained_tokens = skipped = 0
        self.model.train()
        for mb, passes in plans:
            stats, tokens = self._update(mb, passes, proximal)
            if stats is None:
                skipped += 1
                continue
            trained_tokens += tokens
            for key in sums:
                sums[key] += stats[key] / n_mb
        return {**sums, "trained_tokens": trained_tokens, "skipped_updates": skipped}

    def _update(
        self, minibatch: list[TrainingSequence], passes: list[Batch], proximal: dict[int, torch.Tensor] | None
    ) -> tuple[dict[str, float] | None, int]:
        """One optimizer update on a minibatch. Returns (stats, tokens trained) or (None, 0) if not finite."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._backward(minibatch, passes, proximal)
        tokens = sums.pop("tokens")
        if tokens == 0:  # nothing kept: no step (AdamW's momentum and decay would still move the weights)
            self.optimizer.zero_grad(set_to_none=True)
            return {**sums, "grad_norm": 0.0}, 0
        grad_norm = self._apply(sums["loss"])
        if grad_norm is None:
            return None, 0
        for key in ("clip_frac", "kl_behaviour", "ratio_mean"):
            sums[key] /= tokens
        return {**sums, "grad_norm": grad_norm}, int(tokens)

    def forward_backward(self, rollouts: list[TrainingSequence]) -> dict[str, float]:
        """Add the GRPO loss's gradient on `rollouts` (one minibatch, normalised over its own tokens) to the
        weights' .grad without stepping: the Python API's primitive (echo_rl.TrainingClient). Returns the
        loss, clip fraction, KL to the sampler and the tokens trained."""
        rollouts = [r for r in rollouts if r.completion_ids]
        trained = [
            r for r in rollouts if not (self.cfg.skip_equal_groups and self.cfg.beta == 0 and r.advantage == 0.0)
        ]
        passes = micro_batches(trained, self.cfg.micro_batch_tokens)
        # the weights do not change until optim_step: pi_prox is the policy as it is now
        proximal = self._proximal_logprobs([(rollouts, passes)]) if self.cfg.objective in PROXIMAL_OBJECTIVES else None
        self.model.train()
        sums = self._backward(rollouts, passes, proximal)
        tokens = max(sums["tokens"], 1e-12)
        return {
            "loss": sums["loss"], "kl_ref": sums["kl_ref"], "trained_tokens": int(sums["tokens"]),
            "dropped_frac": sums["dropped_frac"],
            **{key: sums[key] / tokens for key in ("clip_frac", "kl_behaviour", "ratio_mean")},
        }  # fmt: skip

    def optim_step(self) -> dict[str, float]:
        """Clip the accumulated gradient and take one AdamW step (skipped if it is not finite); clears it."""
        grad_norm = self._apply(0.0)
        return {"grad_norm": float("nan") if grad_norm is None else grad_norm, "skipped": grad_norm is None}

    def _backward(
        self, minibatch: list[TrainingSequence], passes: list[Batch], proximal: dict[int, torch.Tensor] | None
    ) -> dict[str, float]:
        """The loss's gradient over `passes` (this rank's micro-batches of `minibatch`) added to .grad. The loss
        is normalised over the minibatch's tokens (loss_norm), those of skipped equal-reward groups included, so
        skipping (an optimisation: their gradient is zero) never rescales the step; tokens a correction drops
        (weight 0) and sequences it drops whole leave the normaliser. Returns the loss and token-weighted sums
        of the statistics, summed over ranks."""
        cfg, world = self.cfg, self.world
        device = model_device(self.model)  # every tensor of the step where the model is
        corrections = {}  # id(rollout) -> the correction's weights of its tokens [len_i], this rank's rollouts
        for r in (r for batch in passes for r in batch) if proximal is not None else ():
            if r.advantage == 0.0:  # never dropped: no policy gradient (only the KL term), and so a skipped
                corrections[id(r)] = torch.ones_like(proximal[id(r)])  # equal group counts as if trained
            else:
                behaviour = torch.tensor(sampled_logprobs(r), device=device)
                corrections[id(r)] = correction_weights(proximal[id(r)], behaviour, cfg)
        dropped_tokens, dropped_rollouts = world.sum(
            [sum(float((w == 0).sum()) for w in corrections.values()),
             sum(float(len(w) > 0 and bool((w == 0).all())) for w in corrections.values())]
        )  # fmt: skip
        all_tokens = sum(len(sampled(r)) for r in minibatch)  # trained tokens of the whole minibatch, all ranks
        kept_tokens = max(all_tokens - dropped_tokens, 1.0)
        kept_rollouts = max(len(minibatch) - dropped_rollouts, 1.0)
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl_behaviour": 0.0, "ratio_mean": 0.0, "kl_ref": 0.0, "tokens": 0.0}
        for batch in passes:
            if not batch:  # this rank's share is done: a pass that adds nothing to the gradient
                (self._logprobs(self.model, [PADDING]).sum() * 0.0).backward()
                continue
            lengths = torch.tensor([len(sampled(r)) for r in batch], device=device)  # [B] trained tokens each
            sequence = torch.repeat_interleave(torch.arange(len(batch), device=device), lengths)  # [N]
            correction = torch.cat([corrections[id(r)] for r in batch]) if corrections else None  # [N]
            kept = (correction > 0).float() if correction is not None else torch.ones(len(sequence), device=device)
            if cfg.loss_norm == "token":
                weights = kept / kept_tokens  # [N]
            elif cfg.loss_norm == "sequence":
                # over the whole length: a sequence's dropped tokens take their share of its weight with them
                # (else a worker's logprobs could drop all but one token and give that one the whole weight)
                weights = kept / (lengths[sequence] * kept_rollouts)  # [N]
            else:  # constant (Dr. GRPO): every token weighs 1 / (n L), whatever the completions' lengths
                weights = kept / (kept_rollouts * self.max_completion_tokens)  # [N]
            logp = self._logprobs(self.model, batch)  # [N]
            logp_ref = None
            if self.reference is not None:
                with torch.no_grad():
                    logp_ref = self._logprobs(self.reference, batch)  # [N]
            tokens_in = TokenBatch(
                logp=logp,
                logp_behaviour=torch.tensor([lp for r in batch for lp in sampled_logprobs(r)], device=device),
                advantages=torch.repeat_interleave(torch.tensor([r.advantage for r in batch], device=device), lengths),
                sequence=sequence,
                logp_proximal=None if proximal is None else torch.cat([proximal[id(r)] for r in batch]),
                correction=correction,
            )
            loss, stats = policy_loss(tokens_in, weights, cfg, logp_ref)
            (loss * world.size).backward()  # FSDP averages gradients over ranks; the weights are global
            tokens = float(kept.sum())
            sums["loss"] += loss.item()
            for key in ("clip_frac", "kl_behaviour", "ratio_mean"):
                sums[key] += stats[key] * tokens
            sums["kl_ref"] += stats.get("kl_ref", 0.0)
            sums["tokens"] += tokens
        summed = dict(zip(sums, world.sum(list(sums.values())), strict=True))
        summed["dropped_frac"] = dropped_tokens / max(all_tokens, 1)
        return summed

    def _apply(self, loss: float) -> float | None:
        """Clip the gradient, step and clear it; returns its norm, or None (and no step) if the loss or the
        gradient is not finite."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            log.warning(
                "update skipped: loss %s, gradient norm %s are not finite (%d skipped in this run)",
                loss, grad_norm, self.skipped_updates,
            )  # fmt: skip
            return None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """completion_logprobs in the trainer's precision: [N] float32."""
        with autocast(model_device(model), self.precision):
            return completion_logprobs(model, batch, self.temperature, self.top_p)

    @torch.no_grad()
    def _proximal_logprobs(self, plans: list[tuple[Batch, list[Batch]]]) -> dict[int, torch.Tensor]:
        """log pi_prox of every completion token this rank trains on, keyed by id(rollout): [len_i] each."""
        out: dict[int, torch.Tensor] = {}
        for _, passes in plans:
            for batch in passes:
                logp = self._logprobs(self.model, batch or [PADDING])  # [N]
                for r, lp in zip(batch, logp.split([len(sampled(r)) for r in batch]), strict=False):
                    out[id(r)] = lp
        return out


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of a policy (the KL reference): take it before loading a checkpoint into `model`."""
    return copy.deepcopy(model).eval().requires_grad_(False)


PADDING = Padding([0], [0], [0.0])


def micro_batches(rollouts: list[TrainingSequence], max_tokens: int) -> list[list[TrainingSequence]]:
    """Group rollouts of similar length so that each padded micro-batch holds <= max_tokens tokens."""
    ordered = sorted(rollouts, key=lambda r: len(r.prompt_ids) + len(r.completion_ids))
    batches: list[list[TrainingSequence]] = []
    current: list[TrainingSequence] = []
    for r in ordered:
        length = len(r.prompt_ids) + len(r.completion_ids)  # the longest so far, as they are sorted
        if current and length * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(r)
    if current:
        batches.append(current)
    return batches


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are: the step's tensors are created there (CPU, cuda:N)."""
    return next(model.parameters()).device


def pack_completions(
    batch: list[TrainingSequence], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion ids [B, T], their mask [B, T], and for every sampled completion
    token (all of a single-turn completion's; an episode's model turns, not its observations) the (row,
    column) of the position whose output predicts it: rows [N], cols [N]; built on the CPU, then moved to
    `device` in one copy each."""
    seqs = [r.prompt_ids + r.completion_ids for r in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device="cpu")  # [B, T]
    mask = torch.zeros(len(seqs), width, dtype=torch.long, device="cpu")  # [B, T]
    rows, cols = [], []
    for b, (r, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s, device="cpu")
        mask[b, : len(s)] = 1
        start = len(r.prompt_ids) - 1  # the position whose output predicts the first completion token
        positions = sampled(r)
        rows += [b] * len(positions)
        cols += [start + i for i in positions]
    rows_t, cols_t = torch.tensor(rows, device="cpu"), torch.tensor(cols, device="cpu")
    return ids.to(device), mask.to(device), rows_t.to(device), cols_t.to(device)


def completion_logprobs(
    model: torch.nn.Module, batch: list[TrainingSequence], temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """log pi(token) for every sampled completion token of `batch` (pack_completions), flat in batch order: [N].

    pi is the distribution the sampler draws from: softmax(logits / temperature), with top_p < 1
    restricted to the nucleus and renormalised (worker.sampling; the verifier uses the same rule), so
    that an on-policy ratio pi / mu is 1. The nucleus is chosen on detached probabilities and always
    includes the scored token (a token just outside it by rounding, or by staleness, keeps a finite
    logprob). Only the hidden states that predict completion tokens go through the output layer (a
    fifth of a small model's compute at a 49k vocabulary), so prompt positions cost no vocabulary projection.
    """
    ids, mask, rows_t, cols_t = pack_completions(batch, model_device(model))
    # through the model's own forward (FSDP gathers weights in its hooks), the output layer on one position
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][rows_t, cols_t]  # [N, H] after the final norm
    targets = ids[rows_t, cols_t + 1]  # [N]
    if grad_checkpointing_on(model) and torch.is_grad_enabled():
        # the [N, V] log-probabilities are most of a step's activations (49k vocabulary): keep only the
        # hidden rows and recompute the output layer block by block in the backward pass
        blocks = zip(hidden.split(HEAD_ROWS), targets.split(HEAD_ROWS), strict=True)
        return torch.cat(
            [checkpoint(token_logprobs, model, h, t, temperature, top_p, use_reentrant=False) for h, t in blocks]
        )
    return token_logprobs(model, hidden, targets, temperature, top_p)


HEAD_ROWS = 256  # completion positions through the output layer at once under gradient checkpointing


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output layer on final hidden states [N, H] -> logits [N, V], as its own forward computes
    them: lm_head, then the family's final soft-capping where it has one (Gemma 2: c tanh(z / c))."""
    logits = model.lm_head(hidden)  # [N, V]
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def token_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """log pi(target) from final hidden states [N, H] and targets [N] (see completion_logprobs): [N]."""
    head = model.lm_head
    with torch.autocast(hidden.device.type, enabled=False):  # the output layer in the weights' own precision
        logits = head_logits(model, hidden.to(head.weight.dtype)).float() / temperature  # [N, V]
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]
    if top_p < 1.0:
        strict, _ = nucleus_masks(logp.detach(), top_p)  # [N, V]
        keep = strict.scatter(1, targets[:, None], True)
        logp = logp - torch.logsumexp(logp.masked_fill(~keep, -torch.inf), dim=-1, keepdim=True)  # [N, V]
    return logp.gather(1, targets[:, None]).squeeze(1)  # [N]


def nucleus_masks(logp: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of each row of log-probabilities [N, V], as worker.sampling chooses it: a token
    stays if the mass of the tokens more likely than it is still below top_p. Returns (strict, wider):
    boolean masks [N, V], wider holding one more token (a token the sampler's rounding let in)."""
    probs = logp.exp()
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    strict_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # a prefix of the sorted tokens
    wider_sorted = strict_sorted | torch.cat([torch.ones_like(strict_sorted[:, :1]), strict_sorted[:, :-1]], dim=1)
    strict = torch.zeros_like(strict_sorted).scatter(1, order, strict_sorted)
    wider = torch.zeros_like(wider_sorted).scatter(1, order, wider_sorted)
    return strict, wider
