"""learner/serve/scorer.py: with `serve --sample-seed`, a sample's logprobs are scored alone, so they do not depend
on the batch, the worker or the tenant it was drawn beside."""

import threading

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from learner.serve.sampler import Drawn, LocalSampler, SamplerWeights  # noqa: E402
from learner.serve.scorer import SampleScorer  # noqa: E402
from learner.serve.service import ServeOptions, make_app  # noqa: E402
from learner.train.models import tiny_policy  # noqa: E402
from learner.train.wire_weights import wire_tensors  # noqa: E402
from p2p.messages import Completion  # noqa: E402
from tests.test_serve import KEY_A, client, datum, sampler_engine, serving  # noqa: E402


def tiny_adapters(rank: int, seed: int) -> dict[str, np.ndarray]:
    """Random rank-`rank` adapters on every projection of the tiny model (names as learner.train.lora makes them)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in wire_tensors(tiny_policy(0).model, "f32").items():
        if a.ndim == 2 and name.endswith("_proj.weight"):
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = rng.normal(0, 0.1, (rank, a.shape[1])).astype(np.float32)
            out[f"{stem}.lora_B.weight"] = rng.normal(0, 0.1, (a.shape[0], rank)).astype(np.float32)
    return out


def flat(drawn: Drawn) -> list[float]:
    return [x for s in drawn.samples for x in s.logprobs]


@pytest.mark.parametrize("as_workers", [False, True])
def test_a_sample_scored_alone_has_the_same_logprobs_whatever_batch_it_was_drawn_in(tmp_path, as_workers):
    """Requests drawn together (prompts of different lengths, left-padded in the engine's waves) and each alone
    draw the same tokens; scored, their logprobs are the same to the last bit, and still those of the
    distribution they were drawn from (temperature and top_p applied); scoring another sampler in between
    changes nothing; a greedy sample keeps its logprob 0."""
    rounded = frozenset({"tiny"} if as_workers else ())
    sampler = LocalSampler(sampler_engine, str(tmp_path), rounded)
    scorer = SampleScorer(str(tmp_path), rounded)
    weights, other = SamplerWeights("tiny", 2, tiny_adapters(2, 0)), SamplerWeights("tiny", 2, tiny_adapters(2, 1))
    params = types.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, stop=[])
    prompts = [[5, 17], [9, 3, 42, 7, 61, 8, 8], [2, 2, 2]]
    reqs = [types.SampleRequest(prompt=types.ModelInput.from_ints(p), num_samples=3, sampling_params=params)
            for p in prompts]  # fmt: skip
    draws = [21, 22, 23]
    together = sampler.sample_batch(weights, reqs, draws)
    alone = [sampler.sample_batch(weights, [r], [d])[0] for r, d in zip(reqs, draws, strict=True)]
    for prompt, t, a in zip(prompts, together, alone, strict=True):
        assert [s.tokens for s in t.samples] == [s.tokens for s in a.samples]
        scored_t = scorer.score(weights, prompt, t, 0.8, 0.9)
        scorer.score(other, prompt, a, 0.8, 0.9)  # (another sampler's adapters in the scorer's model)
        scored_a = scorer.score(weights, prompt, a, 0.8, 0.9)
        assert flat(scored_t) == flat(scored_a)  # bit for bit
        off = Drawn([Completion(s.tokens, [x + 0.01 for x in s.logprobs], s.finish_reason) for s in t.samples], None)
        assert flat(scorer.score(weights, prompt, off, 0.8, 0.9)) == flat(scored_t)  # computed anew, not kept
        assert np.allclose(flat(scored_t), flat(t), atol=1e-4)  # the sampler's own distribution
        assert [s.tokens for s in scored_t.samples] == [s.tokens for s in t.samples]
    greedy = Drawn([Completion([4, 5], [0.0, 0.0], "length")], None)
    assert scorer.score(weights, [5, 17], greedy, 0.0, 1.0) is greedy


class WorkerStandIn:
    """Stands in for serve's swarm side: every request is drawn by a 'worker' (another LocalSampler, on a
    thread of its own) whose logprobs carry noise in their last bits, as a replay of another shape has."""

    def __init__(self, tmp_path) -> None:
        self.sampler = LocalSampler(sampler_engine, str(tmp_path / "worker"))
        self.lock = threading.Lock()
        self.answered = 0

    def submit(self, weights, req, draw, answer, here) -> bool:
        def work() -> None:
            with self.lock:
                drawn = self.sampler.sample(weights, req, draw)
                self.answered += 1
            noisy = [Completion(s.tokens, [x * (1 + 1e-7) for x in s.logprobs], s.finish_reason) for s in drawn.samples]
            answer(Drawn(noisy, None))

        threading.Thread(target=work, daemon=True).start()
        return True

    def close(self) -> None:
        pass


def test_with_a_sample_seed_samples_come_back_alike_drawn_at_once_here_or_by_a_worker(tmp_path):
    """Two fresh `--sample-seed` servers, the same requests: one has every request drawn by a worker and sent all
    at once, the other draws them here one after the other. The samples are the same tokens with the very same
    logprobs (without scoring, the worker's noise and the batch's shape would show in their last bits)."""
    tokens = [5, 17, 99, 3, 42, 7, 61]
    params = types.SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95)
    prompts = [tokens[:3], tokens[:5], tokens[2:4], tokens[1:6]]  # (identical requests at once may trade samples)

    def run(by_worker: bool) -> list[list[tuple[list[int], list[float]]]]:
        options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A}),
                               str(tmp_path / f"ckpt{by_worker}"), 3, sample_seed=3)  # fmt: skip
        app = make_app(options, sampler_engine)
        stand_in = WorkerStandIn(tmp_path) if by_worker else None
        app.state.service.swarm = stand_in
        with serving(options, app) as url:
            tc = client(url).create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
            tc.forward_backward([datum(tokens)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            asks = [lambda p=p: sampler.sample(types.ModelInput.from_ints(p), 3, params) for p in prompts]
            futures = [ask() for ask in asks] if by_worker else None
            outs = [f.result() for f in futures] if by_worker else [ask().result() for ask in asks]
        if stand_in is not None:
            assert stand_in.answered == len(prompts)
        return [[(s.tokens, s.logprobs) for s in out.sequences] for out in outs]

    assert run(True) == run(False)
