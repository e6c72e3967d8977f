"""Reward functions used by tests through the `module:function` form of jsonl tasks."""


def crashes(completion: str, answer: object) -> float:
    raise RuntimeError("a buggy user reward")


def starts_ascii(completion: str, answer: object) -> float:
    """1 if the completion starts with an ASCII character: about half of a random byte model's samples,
    so groups have mixed rewards and the tiny model really trains."""
    return 1.0 if completion and ord(completion[0]) < 128 else 0.0


def text_hash(completion: str, answer: object) -> float:
    """A number in [0, 1) that any change of the completion's text changes: evaluation tests see every token."""
    import hashlib

    return int.from_bytes(hashlib.sha256(completion.encode()).digest()[:8], "little") / 2**64


def starts_with_a(completion: str, answer: object) -> float:
    """1 if the completion starts with 'A': a random model almost never does, a forger always can."""
    return 1.0 if completion.startswith("A") else 0.0
