"""The training node: models, tasks and rewards, the GRPO objective and the training loop."""
