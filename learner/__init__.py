"""The training node, in four rooms and two entry loops (docs/design.md, "Code layout").

- learner/train/: the algorithm: models, LoRA, the GRPO objective, the trainer, torch.distributed data
  parallelism, checkpoints, weights to their wire form. Knows nothing of the swarm.
- learner/orchestrate/: the swarm side: protocol handlers, rollout intake (validate, verify, score,
  journal, buffer), leases and their admission rule, the replay buffer, the journal, publishing.
- learner/plan/: the capacity model, the scheduler that activates workers, the swarm simulator (no torch).
- learner/tasks/: prompts and reward functions.
- colocated_loop.py (generate, train and reload in one process) and swarm_loop.py (train on what workers
  push) are the two ways to run; run.py holds what both share (model, trainer, checkpoints, metrics).
"""
