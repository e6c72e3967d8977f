"""What learner and worker both need: the libp2p host, chunked broadcast of signed versions, the codec,
the typed wire messages and sampling draws they exchange.

Only this package may import trio or libp2p; learner/ and worker/ never import each other.
"""
