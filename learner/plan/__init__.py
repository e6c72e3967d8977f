"""Planning: the overlap-based capacity model, the scheduler that activates workers cheapest first, and the
discrete-event simulator of a swarm. Pure Python (no torch): `echo-rl plan` and `simulate` start fast."""
