import numpy as np
import pytest

from worker.sampling import sample_next


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_logprobs_are_those_of_the_tempered_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 50)).astype(np.float32)
    tokens, logprobs = sample_next(logits, 0.7, 1.0, np.random.default_rng(1))
    expected = log_softmax(logits.astype(np.float64) / 0.7)[np.arange(16), tokens]
    assert np.allclose(logprobs, expected, atol=1e-9)


def test_samples_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2]] * 20000))
    tokens, _ = sample_next(logits, 1.0, 1.0, np.random.default_rng(2))
    freq = np.bincount(tokens, minlength=3) / len(tokens)
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.02)


def test_top_p_truncates_and_renormalises():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    tokens, logprobs = sample_next(logits, 1.0, 0.8, np.random.default_rng(3))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    for t, lp in zip(tokens, logprobs, strict=True):
        assert lp == pytest.approx(np.log([0.5 / 0.8, 0.3 / 0.8][t]))


def test_same_seed_same_tokens():
    logits = np.random.default_rng(4).normal(size=(8, 100))
    a = sample_next(logits, 1.0, 0.9, np.random.default_rng(5))
    b = sample_next(logits, 1.0, 0.9, np.random.default_rng(5))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
