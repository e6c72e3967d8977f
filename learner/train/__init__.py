"""The algorithm: the policy model, LoRA adapters, the GRPO objective, one optimizer step, torch.distributed
data parallelism (FSDP2), checkpoints and the weights' wire form. Imports nothing from learner.orchestrate."""
