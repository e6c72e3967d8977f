"""Full fine-tuning through `echo-rl serve` (a create_model with LoRA rank 0 or no lora_config): every weight
trained, sampled from, checkpointed, on a copy of its own beside the LoRA clients' shared base (each family:
tests/test_serve.py)."""

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from learner.serve.service import ServeOptions, make_app  # noqa: E402
from tests.test_serve import KEY_A, KEY_B, by_hand_logprobs, client, datum, sampler_engine, serving  # noqa: E402

TOKENS = [5, 17, 99, 3, 42, 7, 61]


def logprobs(tc, tokens: list[int] = TOKENS) -> np.ndarray:
    return tc.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_a_full_fine_tuning_client_trains_every_weight_and_samples_and_checkpoints_them(tmp_path):
    """rank 0: the client starts as the base model, cross_entropy steps lower its loss and move every kind of
    weight (the embedding, the norms, not only the projections); its sampler's logprobs (scored alone, with a
    sample seed) are its forward's; a
    LoRA client on the same base still sees the base model, and its sampler after the full one samples the
    base again; save_state and a new client from it give the same model; a second full client is refused
    (the server's limit) until the first's session ends."""
    # (a sample seed: the samples are scored alone, learner.serve.scorer, on the full weights too)
    options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A, KEY_B}), str(tmp_path / "ck"),
                           3, max_full_models=1, sample_seed=5)  # fmt: skip
    app = make_app(options, sampler_engine)
    svc = app.state.service
    base = by_hand_logprobs(TOKENS)
    with serving(options, app) as url:
        sc = client(url)
        tc = sc.create_lora_training_client(base_model="tiny", rank=0).result()
        info = tc.get_info()
        assert info.is_lora is False and info.lora_rank is None
        assert np.allclose(logprobs(tc), base, atol=1e-5)
        before = {n: t.clone() for n, t in svc.slots[tc.model_id].model.weights().items()}
        losses = []
        for _ in range(3):
            fb = tc.forward_backward([datum(TOKENS)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0] - 1.0
        after = svc.slots[tc.model_id].model.weights()
        moved = {n for n in before if not torch.equal(before[n], after[n])}
        assert any("embed_tokens" in n for n in moved) and any("norm" in n for n in moved)
        assert any("mlp" in n for n in moved) and any("self_attn" in n for n in moved)
        trained = logprobs(tc)

        prompt = types.ModelInput.from_ints(TOKENS[:3])
        sampler = tc.save_weights_and_get_sampling_client()
        out = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=5, temperature=1.0)).result()
        for seq in out.sequences:
            assert np.allclose(seq.logprobs, logprobs(tc, TOKENS[:3] + seq.tokens)[2:], atol=1e-4)

        lora = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        assert np.allclose(logprobs(lora), base, atol=1e-5)  # the shared base is untouched
        scored = lora.save_weights_and_get_sampling_client().compute_logprobs(types.ModelInput.from_ints(TOKENS))
        assert np.allclose(scored.result()[1:], base, atol=1e-4)  # the local sampler has the base back

        named = [tc.save_weights_for_sampler(name).result().path for name in ("one", "two")]
        one, two = (sc.create_sampling_client(model_path=p) for p in named)
        first = one.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
        two.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()  # (one's weights leave memory)
        assert len(svc.full_samplers) == 1 and svc.full_samplers[0].name.endswith("two")
        assert one.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:] == first[1:]  # read again
        assert np.allclose(first[1:], trained, atol=1e-4)

        path = tc.save_state("full").result().path
        run = sc.create_rest_client().get_training_run_by_tinker_path(path).result()
        assert run.is_lora is False and run.lora_rank is None
        with pytest.raises(tinker.BadRequestError, match="full fine-tuning"):
            client(url, KEY_B).create_lora_training_client(base_model="tiny", rank=0).result()
        sc.close("success").result()  # the session's clients go, the full one with them

        other = client(url, KEY_B)
        assert np.allclose(logprobs(other.create_lora_training_client(base_model="tiny", rank=0).result()), base,
                           atol=1e-5)  # fmt: skip
        other.close("success").result()
        restored = client(url).create_training_client_from_state_with_optimizer(path).result()
        assert np.allclose(logprobs(restored), trained, atol=1e-6)


def test_full_fine_tuning_is_off_unless_the_server_allows_it(tmp_path):
    options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A}), str(tmp_path / "ck"))
    with serving(options) as url, pytest.raises(tinker.BadRequestError, match="max-full-models"):
        client(url).create_lora_training_client(base_model="tiny", rank=0).result()
