"""A few GRPO steps on fixed rollouts, run by tests/test_parallel.py plainly and under torchrun.

python tests/dp_steps.py OUT.pt                              # one process
torchrun --nproc-per-node 2 tests/dp_steps.py OUT.pt         # two ranks, FSDP2 on gloo
torchrun --nproc-per-node 2 tests/dp_steps.py OUT.pt bf16    # FSDP2 mixed precision
"""

import sys

import torch

from learner.config import GRPOConfig
from learner.train.data_parallel import exit_rank, full_state, init_world, leave, shard
from learner.train.models import tiny_policy
from learner.train.trainer import GRPOTrainer
from tests.test_trainer import make_rollouts


def main(out: str, precision: str = "fp32") -> None:
    world = init_world("cpu")
    torch.manual_seed(0)
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy, n=7)  # before sharding: afterwards a forward pass needs every rank
    shard(policy.model, world, precision)
    # 64 tokens per micro-batch: the ranks' shares (4 and 3 rollouts) need different numbers of passes
    cfg = GRPOConfig(lr=1e-3, micro_batch_tokens=64)
    trainer = GRPOTrainer(policy.model, cfg, temperature=1.0, world=world, precision=precision)
    stats = [trainer.step(rollouts) for _ in range(3)]
    state = full_state(policy.model, world)
    if world.leader:
        torch.save({"state": state, "stats": stats}, out)
    leave(world)
    if world.sharded:
        exit_rank()


if __name__ == "__main__":
    main(*sys.argv[1:])
