import numpy as np
import pytest

from p2p.draws import uniform, uniforms
from worker.sampling import sample_next


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def draws(n, seed=1):
    return uniforms(seed, [(0, i, 0) for i in range(n)])


def test_logprobs_are_those_of_the_tempered_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 50)).astype(np.float32)
    tokens, logprobs = sample_next(logits, 0.7, 1.0, draws(16))
    expected = log_softmax(logits.astype(np.float64) / 0.7)[np.arange(16), tokens]
    assert np.allclose(logprobs, expected, atol=1e-9)


def test_samples_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.2]] * 20000))
    tokens, _ = sample_next(logits, 1.0, 1.0, draws(20000, seed=2))
    freq = np.bincount(tokens, minlength=3) / len(tokens)
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.02)


def test_top_p_truncates_and_renormalises():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    tokens, logprobs = sample_next(logits, 1.0, 0.8, draws(4000, seed=3))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    for t, lp in zip(tokens, logprobs, strict=True):
        assert lp == pytest.approx(np.log([0.5 / 0.8, 0.3 / 0.8][t]))


def test_the_token_is_the_inverse_cdf_of_its_draw_in_token_id_order():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 4))
    u = np.array([0.05, 0.15, 0.55, 0.95])  # cumulative 0.1, 0.3, 0.6, 1.0
    tokens, _ = sample_next(logits, 1.0, 1.0, u)
    assert tokens.tolist() == [0, 1, 2, 3]


def test_draws_depend_only_on_their_key():
    a = uniform(7, 3, 1, 5)
    assert a == uniform(7, 3, 1, 5) and 0 < a < 1
    others = {uniform(8, 3, 1, 5), uniform(7, 4, 1, 5), uniform(7, 3, 2, 5), uniform(7, 3, 1, 6)}
    assert a not in others and len(others) == 4
    u = uniforms(7, [(g, c, p) for g in range(10) for c in range(10) for p in range(100)])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01  # 10,000 draws, sd of the mean 0.003


def test_temperature_zero_is_greedy():
    """Evaluation's greedy completions: the most likely token whatever the draw, with logprob 0."""
    logits = np.random.default_rng(1).normal(size=(8, 40)).astype(np.float32)
    tokens, logprobs = sample_next(logits, 0.0, 1.0, draws(8))
    assert tokens.tolist() == logits.argmax(axis=1).tolist() and not logprobs.any()


def test_a_lease_drawn_alone_gives_each_prompt_group_the_tokens_and_logprobs_it_has_alone():
    """LeaseGrant.alone (`serve --sample-seed`): each group id's requests in engine waves of their own, so a
    group's samples are those it gets drawn by itself, bit for bit, whatever else the lease holds (prompts of
    other lengths: drawn together they are padded to the longest, and the logits move in their last bits)."""
    from learner.train.models import model_spec, tiny_policy
    from learner.train.wire_weights import send_to_sampler
    from p2p.messages import GenerationRequest, LeaseGrant, MessageError, SamplingParams
    from worker.engines.hf import TransformersEngine
    from worker.sampling import generate_alone

    tiny = tiny_policy(0)
    engine = TransformersEngine(threads=2, max_batch=16)
    send_to_sampler(engine, model_spec(tiny), tiny.model)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=0)
    prompts = [[5, 17], [9, 3, 42, 7, 61, 8, 8, 11, 30], [2, 2, 2]]
    # a request of 4 samples split into two groups of 2 (draw id 21), between two others
    lease = [GenerationRequest(prompts[0], 2, 21), GenerationRequest(prompts[1], 3, 22),
             GenerationRequest(prompts[0], 2, 21, completion=2), GenerationRequest(prompts[2], 3, 23)]  # fmt: skip
    drawn = generate_alone(engine.generate, lease, params)
    by_itself = engine.generate([lease[0], lease[2]], params)
    assert [drawn[0], drawn[2]] == by_itself  # tokens, logprobs (exact floats) and finish
    assert drawn[1] == engine.generate([lease[1]], params)[0] and drawn[3] == engine.generate([lease[3]], params)[0]

    grant = LeaseGrant(7, lease, params, 0, 30.0, alone=True)
    assert LeaseGrant.from_wire(grant.to_wire()).alone
    assert "alone" not in LeaseGrant(7, lease, params, 0, 30.0).to_wire()  # the training learner's frames unchanged
    with pytest.raises(MessageError, match="alone"):
        LeaseGrant.from_wire(grant.to_wire() | {"alone": 1})


class TracingBackend:
    """A model-free LogitsBackend: each sequence's next logits depend on its own tokens alone (a hash of them),
    the end-of-turn token 0 likely after a few tokens; every call it gets is recorded."""

    max_batch = 8

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.history: list[list[int]] = []

    def _logits(self, seqs) -> np.ndarray:
        rows = []
        for s in seqs:
            h = self.history[s]
            z = np.random.default_rng(hash(tuple(h)) % (1 << 32)).normal(size=12) * 2.0
            z[0] += 0.5 * len(h) - 4.5  # end of turn grows likely as the sequence grows
            rows.append(z)
        return np.array(rows, dtype=np.float32)

    def prefill(self, wave, max_new_tokens):
        self.calls.append(("prefill", [(r.prompt_ids, r.group_size) for r in wave], max_new_tokens))
        self.history = [list(r.prompt_ids) for r in wave for _ in range(r.group_size)]
        return self._logits(range(len(self.history)))

    def decode(self, seqs, tokens):
        self.calls.append(("decode", list(seqs), list(tokens)))
        for s, t in zip(seqs, tokens, strict=True):
            self.history[s].append(t)
        return self._logits(seqs)

    def release(self, seq):
        self.calls.append(("release", seq))


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_replay_wave_makes_the_calls_generate_waves_made_and_finds_every_draw(temperature, top_p):
    """worker.sampling.replay_wave feeds a wave's completions back with the very prefill, decode and release
    calls generate_waves made (sequences ending at different steps, and at the budget), so an engine whose
    logits depend on the layout repeats them; every token is its draw's, every logprob the worker's. A forged
    token is off its draw, and completions no honest wave holds are refused."""
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.sampling import generate_waves, replay_wave

    request = GenerationRequest([5, 6, 7], 8, group=9, completion=12)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10, seed=3)
    drawn = TracingBackend()
    group = generate_waves(drawn, [request], params, {0}, 8)[0]
    lengths = [len(c.tokens) for c in group]
    assert temperature == 0 or (len(set(lengths)) > 2 and 10 in lengths)  # ends mid-wave, and at the budget
    again = TracingBackend()
    replayed = replay_wave(again, request, [c.tokens for c in group], params)
    assert again.calls == drawn.calls
    for c, r in zip(group, replayed, strict=True):
        assert r.drawn == c.tokens and r.logprobs == c.logprobs and max(r.misses) == 0.0
    forged = [list(c.tokens) for c in group]
    forged[0][0] = (forged[0][0] + 1) % 12
    first = replay_wave(TracingBackend(), request, forged, params)[0]
    assert first.drawn[0] != forged[0][0] and first.misses[0] > 0
    bad_first = ([], [1] * 11, [12], [-1], [1.0])  # empty, past the budget, outside the vocabulary, not an id
    for bad in [[first] + forged[1:] for first in bad_first] + [forged * 2]:
        with pytest.raises(ValueError):
            replay_wave(TracingBackend(), request, bad, params)
