"""The swarm side of the learner: the worker protocols' handlers, rollout intake (validate, verify, score,
journal, buffer), leases and the rule that admits them, the replay buffer, the journal, version publishing."""
