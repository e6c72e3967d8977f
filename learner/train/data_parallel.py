"""Data-parallel training over several processes (GPUs or nodes) with torch.distributed and FSDP2.

    torchrun --nproc-per-node N -m echo_cli learner start ...          # one node, N ranks
    torchrun --nnodes M --node-rank K --master-addr HOST ... -m echo_cli learner start ...

Every rank holds a shard of the weights, gradients and optimizer state (FSDP2 `fully_shard` on each
decoder layer, then on the whole model). Rank 0 alone runs the swarm side (host, leases, replay
buffer, publisher, metrics, checkpoints) and broadcasts each step's batch; rank r trains on rollouts
r, r + N, r + 2N, ... Every rank weights its tokens by the batch's global normalisation and scales its
loss by N, so the gradients FSDP averages over ranks equal those of one process on the whole batch.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from learner.train.devices import resolve_device
from p2p.config import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place among the training ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where this rank trains; collectives run there (nccl: a GPU)
    sharded: bool = False  # started by torchrun: in a process group, the model under FSDP2 (one rank too)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; a batch of rollouts is a few MB at most)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max(self, value: int) -> int:
        """The largest `value` over all ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over all ranks."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


def leave(world: World) -> None:
    """Leave the process group after the last step (a rank that exits without it aborts in gloo's threads)."""
    if world.sharded and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank() -> None:
    """End a torchrun rank whose work is done (process group left): a rank's static destructors sometimes
    abort in a torch.distributed thread after destroy_process_group ("terminate called without an active
    exception", seen about 1 run in 10 on a loaded 2-core machine), which torchrun reports as a failed run;
    flush and skip them."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def started_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets RANK and MASTER_ADDR, also for one rank)."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def init_world(device: str = "auto") -> World:
    """This process's rank and device (learner.train.devices.resolve_device of the --device flag); under
    torchrun join the process group (nccl when the ranks train on GPUs, gloo on CPUs) and shard the model
    with FSDP2, also with one rank (`torchrun --nproc-per-node 1`: what one GPU of a bigger run does)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    where = resolve_device(device, size)
    if not started_by_torchrun():
        if size > 1:
            raise ConfigError(f"WORLD_SIZE={size} without MASTER_ADDR and RANK: start several ranks with torchrun")
        return World(device=where)
    if where.type == "cuda":
        torch.cuda.set_device(where)  # before the group: nccl binds each rank to its current GPU
    if not dist.is_initialized():
        # ranks > 0 wait in a broadcast while rank 0 waits for workers' rollouts, which may take hours
        # (no worker online yet): the default 30-minute collective timeout would kill the run
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo", timeout=timedelta(days=7))
    return World(dist.get_rank(), dist.get_world_size(), where, sharded=True)


def shard(model: torch.nn.Module, world: World, precision: str = "fp32") -> None:
    """FSDP2: shard every decoder layer, then the rest (embeddings, final norm, output layer). bf16: the
    gathered weights are cast to bfloat16 for compute, gradients reduced in float32 (MixedPrecisionPolicy);
    the sharded master weights and AdamW stay float32."""
    if not world.sharded:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = mixed if precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def full_state(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (on the CPU); {} on the other ranks. Collective: every
    rank calls it at the same point."""
    if not world.sharded:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> dict:
    """The optimizer's whole state on rank 0, keyed by parameter name (any rank count can load it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=world.sharded)
    )


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore a state saved by full_optimizer_state on every rank (each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
