"""The rollout worker: weight conversion for its engine, inference engines, and (soon) the daemon."""
