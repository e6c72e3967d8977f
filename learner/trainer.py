"""One GRPO optimizer step on a batch of scored rollouts, with micro-batching to bound memory."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from learner.config import GRPOConfig
from learner.grpo import policy_loss
from learner.parallel import World


@dataclass
class Rollout:
    """A scored completion ready for training."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # log mu per completion token, from the sampler
    reward: float
    advantage: float = 0.0
    version: int = 0  # policy version the sampler held when generation started


class GRPOTrainer:
    """Owns the policy's optimizer (fused AdamW) and, when beta > 0, a frozen reference copy.

    `step(rollouts)` computes pi_theta's logprobs of the completion tokens at the sampling temperature,
    the loss of learner.grpo.policy_loss, and takes one clipped optimizer step.
    """

    def __init__(self, model: torch.nn.Module, cfg: GRPOConfig, temperature: float, world: World = World()) -> None:
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.world = world  # several ranks: `model` is sharded (learner.parallel) and each trains on its share
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            fused=True,
        )
        self.reference = None
        if cfg.beta > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    def step(self, rollouts: list[Rollout]) -> dict[str, float]:
        """One optimizer step; returns loss, grad norm, clip fraction and KL figures."""
        cfg = self.cfg
        if cfg.skip_equal_groups and cfg.beta == 0:
            rollouts = [r for r in rollouts if r.advantage != 0.0]
        rollouts = [r for r in rollouts if r.completion_ids]
        sums = {"loss": 0.0, "clip_frac": 0.0, "kl_behaviour": 0.0, "ratio_mean": 0.0, "kl_ref": 0.0}
        if not rollouts:
            return {**sums, "grad_norm": 0.0, "trained_tokens": 0}

        total_tokens = sum(len(r.completion_ids) for r in rollouts)  # of the whole batch, over all ranks
        n_rollouts = len(rollouts)
        world = self.world
        batches = micro_batches(rollouts[world.rank :: world.size], cfg.micro_batch_tokens)
        # FSDP gathers each layer's weights in every pass, so all ranks must make as many passes
        batches += [[]] * (world.max(len(batches)) - len(batches))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            if not batch:  # this rank's share is done: a pass that adds nothing to the gradient
                (completion_logprobs(self.model, [PADDING], self.temperature).sum() * 0.0).backward()
                continue
            lengths = torch.tensor([len(r.completion_ids) for r in batch])  # [B]
            if cfg.loss_norm == "token":
                weights = torch.full((int(lengths.sum()),), 1.0 / total_tokens)  # [N]
            else:
                weights = torch.repeat_interleave(1.0 / (lengths * n_rollouts), lengths)  # [N]
            logp = completion_logprobs(self.model, batch, self.temperature)  # [N]
            logp_ref = None
            if self.reference is not None:
                with torch.no_grad():
                    logp_ref = completion_logprobs(self.reference, batch, self.temperature)
            behaviour = torch.tensor([lp for r in batch for lp in r.behaviour_logprobs])  # [N]
            advantages = torch.repeat_interleave(torch.tensor([r.advantage for r in batch]), lengths)  # [N]
            loss, stats = policy_loss(
                logp, behaviour, advantages, weights,
                cfg.eps_low, cfg.eps_high, cfg.ratio_cap, logp_ref, cfg.beta, cfg.objective == "decoupled",
            )  # fmt: skip
            (loss * world.size).backward()  # FSDP averages gradients over ranks; the weights are global
            share = float(lengths.sum()) / total_tokens
            sums["loss"] += loss.item()
            for key in ("clip_frac", "kl_behaviour", "ratio_mean"):
                sums[key] += stats[key] * share
            sums["kl_ref"] += stats.get("kl_ref", 0.0)
        sums = dict(zip(sums, world.sum(list(sums.values())), strict=True))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "grad_norm": float(grad_norm), "trained_tokens": total_tokens}


PADDING = Rollout([0], [0], [0.0], 0.0)  # the smallest sequence a forward pass accepts


def micro_batches(rollouts: list[Rollout], max_tokens: int) -> list[list[Rollout]]:
    """Group rollouts of similar length so that each padded micro-batch holds <= max_tokens tokens."""
    ordered = sorted(rollouts, key=lambda r: len(r.prompt_ids) + len(r.completion_ids))
    batches: list[list[Rollout]] = []
    current: list[Rollout] = []
    for r in ordered:
        length = len(r.prompt_ids) + len(r.completion_ids)  # the longest so far, as they are sorted
        if current and length * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(r)
    if current:
        batches.append(current)
    return batches


def pack_completions(batch: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion ids [B, T], their mask [B, T], and for every completion token
    the (row, column) of the position whose output predicts it: rows [N], cols [N]."""
    seqs = [r.prompt_ids + r.completion_ids for r in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
    rows, cols = [], []
    for b, (r, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
        start = len(r.prompt_ids) - 1  # the position whose output predicts the first completion token
        rows += [b] * len(r.completion_ids)
        cols += range(start, start + len(r.completion_ids))
    return ids, mask, torch.tensor(rows), torch.tensor(cols)


def completion_logprobs(model: torch.nn.Module, batch: list[Rollout], temperature: float) -> torch.Tensor:
    """log pi(token) for every completion token of `batch`, flat in batch order: [N].

    Only the hidden states that predict completion tokens go through the output layer (a fifth of a
    small model's compute at a 49k vocabulary), so prompt positions cost no vocabulary projection.
    """
    ids, mask, rows_t, cols_t = pack_completions(batch)
    # through the model's own forward (FSDP gathers weights in its hooks), the output layer on one position
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, T, H] after the final norm
    logits = model.lm_head(hidden[rows_t, cols_t]).float() / temperature  # [N, V]
    targets = ids[rows_t, cols_t + 1]  # [N]
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)  # [N]
