"""What learner and worker both need: the types they exchange, and (soon) the libp2p swarm layer.

Only this package may import trio or libp2p; learner/ and worker/ never import each other.
"""
