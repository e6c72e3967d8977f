"""Examples: swarm profiles, worker fleets, and a multi-turn environment of your own (guess_env.py).

A regular package (not a namespace one), so that `--env examples.guess_env:GuessEnv` finds this folder from the
repository root before the `examples` package py-libp2p installs into site-packages.
"""
