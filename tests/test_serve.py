"""`echo-rl serve` with the official `tinker` SDK as its client (learner/serve), on the tiny model."""

import contextlib
import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from learner.serve.futures import NotFound  # noqa: E402
from learner.serve.losses import LOSSES  # noqa: E402
from learner.serve.service import ServeOptions, make_app  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

KEY_A, KEY_B = "tml-test-key-aaaaaaaa", "tml-test-key-bbbbbbbb"


@contextlib.contextmanager
def serving(options: ServeOptions, app=None):
    """`app` (default: `make_app(options)`) under uvicorn on a loopback port: yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = make_app(options, sampler_engine) if app is None else app
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    options = ServeOptions(("tiny",), str(tmp_path_factory.mktemp("cache")), "cpu", frozenset({KEY_A, KEY_B}),
                           str(tmp_path_factory.mktemp("checkpoints")), 3)  # fmt: skip
    with serving(options) as url:
        yield url


def sampler_engine():
    from worker.engines import make_engine

    return make_engine("transformers", "", threads=1, max_batch=4, device="cpu")


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def client(base_url: str, key: str = KEY_A):
    return tinker.ServiceClient(base_url=base_url, api_key=key)


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """A datum whose position t predicts tokens[t + 1] (Tinker's alignment), with extra per-token inputs."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})  # fmt: skip


def by_hand_tokenizer():
    from learner.train.models import tiny_policy

    return tiny_policy(seed=0).tokenizer


def by_hand_logprobs(tokens: list[int]) -> np.ndarray:
    """log pi(tokens[t + 1] | tokens[: t + 1]) under the tiny model as tiny_policy(seed=0) makes it (a fresh
    LoRA adapter is zero: the model is the base)."""
    from learner.train.models import tiny_policy

    model = tiny_policy(seed=0).model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]  # [T, V]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).numpy()


def test_a_tinker_client_trains_a_lora_model_and_every_loss_is_the_formula_on_the_logprobs(base_url):
    """The SDK's own ServiceClient: create a rank-4 LoRA training client on `tiny`, forward returns the logprobs a
    by-hand forward pass of the base model gives (position t scores target t), each RL loss's loss:sum is
    its formula on them, and cross_entropy steps lower the loss."""
    sc = client(base_url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 4 and info.model_data.arch == "llama"
    assert tc.get_tokenizer().decode([72, 101]) == by_hand_tokenizer().decode([72, 101])  # from the served folder
    tokens = [5, 17, 99, 3, 42, 7, 61]
    want = by_hand_logprobs(tokens)
    out = tc.forward([datum(tokens)], "cross_entropy").result()
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logp.shape == want.shape and np.allclose(logp, want, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(-want.sum(), rel=1e-5)

    q = (want - np.array([0.3, -0.2, 0.0, 0.5, -0.4, 0.1])).tolist()  # the "sampler's" logprobs
    adv = [1.0, -1.0, 2.0, 0.5, -0.5, 0.0]
    ratio, a = np.exp(want - np.array(q)), np.array(adv)
    lo, hi = LOSSES["ppo"].config["clip_low_threshold"], LOSSES["ppo"].config["clip_high_threshold"]
    expected = {
        "importance_sampling": -(ratio * a).sum(),
        "ppo": -np.minimum(ratio * a, np.clip(ratio, lo, hi) * a).sum(),
        "cispo": -(np.clip(ratio, lo, hi) * a * want).sum(),
    }
    for name, value in expected.items():
        got = tc.forward([datum(tokens, logprobs=q, advantages=adv)], name).result().metrics["loss:sum"]
        assert got == pytest.approx(value, rel=1e-4, abs=1e-5), name
    by_hand = -(a * want - 0.5 * 0.05 * (want - np.array(q)) ** 2).sum()  # dro, beta 0.05
    got = tc.forward([datum(tokens, logprobs=q, advantages=adv)], "dro", {"beta": 0.05}).result().metrics["loss:sum"]
    assert got == pytest.approx(by_hand, rel=1e-4, abs=1e-5)
    with pytest.raises(tinker.RequestFailedError, match="beta"):  # (Tinker's default beta is not published)
        tc.forward([datum(tokens, logprobs=q, advantages=adv)], "dro").result()
    with pytest.raises(tinker.RequestFailedError, match="beta"):  # (beyond float32 in the penalty)
        tc.forward([datum(tokens, logprobs=q, advantages=adv)], "dro", {"beta": 1e30}).result()

    # gspo: each datum's tokens carry its sequence ratio, the geometric mean over the tokens its mask marks
    mask, other = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0], tokens[::-1]
    q2 = (by_hand_logprobs(other) + 0.25).tolist()
    want2 = by_hand_logprobs(other)
    s1 = np.exp(((want - np.array(q)) * np.array(mask)).sum() / sum(mask))
    s2 = np.exp(np.mean(want2 - np.array(q2)))
    by_hand = sum(-np.minimum(s * a, np.clip(s, lo, hi) * a).sum() for s in (s1, s2))
    two = [datum(tokens, logprobs=q, advantages=adv, sequence_ratio_mask=mask),
           datum(other, logprobs=q2, advantages=adv, sequence_ratio_mask=[1.0] * 6)]  # fmt: skip
    assert tc.forward(two, "gspo").result().metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-4, abs=1e-5)
    q3 = want2 + np.array([0.0, 0.3, -0.1, 2.0, 0.2, 0.1])  # token 3 (no advantage) would move the mean a lot
    unmasked = [datum(other, logprobs=q3.tolist(), advantages=[0.0, 1.0, 1.0, 0.0, 2.0, 2.0])]  # mask: A != 0
    s3 = np.exp(np.mean((want2 - q3)[[1, 2, 4, 5]]))
    a3 = np.array([0.0, 1.0, 1.0, 0.0, 2.0, 2.0])
    by_hand = -np.minimum(s3 * a3, np.clip(s3, lo, hi) * a3).sum()
    assert tc.forward(unmasked, "gspo").result().metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-4, abs=1e-5)

    # the SDK's own custom-loss path (two cross_entropy passes, the second weighted by the loss's gradient)
    custom = tc.forward_backward_custom([datum(tokens)], lambda data, logps: ((-2.0 * logps[0]).sum(), {})).result()
    assert custom.metrics["loss:sum"] == pytest.approx(-2.0 * want.sum(), rel=1e-5)

    # two datums sent in one call run in order with the optimizer steps between them
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum(tokens), datum(tokens[::-1])], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=0.02))
        losses.append(fb.result().metrics["loss:sum"])
        assert "grad_norm:mean" in step.result().metrics
    assert losses[-1] < losses[0] - 1.0


def test_a_trained_clients_sampler_samples_its_weights_and_scores_what_forward_scores(base_url):
    """After cross_entropy steps (adapters on every projection and on the tied output layer), the sampler
    save_weights_and_get_sampling_client makes gives prompt logprobs and sample logprobs equal to the
    training client's forward on the same tokens; a seed repeats its samples; stop tokens and stop strings
    end a sample where they first appear; a named save samples the same weights, for its key only; a base
    model's sampler is the base model, even after another sampler's adapters were on the engine."""
    sc = client(base_url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()  # train_unembed: the SDK's default
    tokens = [5, 17, 99, 3, 42, 7, 61]
    for _ in range(3):
        tc.forward_backward([datum(tokens)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05))
    sampler = tc.save_weights_and_get_sampling_client().result()

    def forward_logprobs(seq: list[int]) -> np.ndarray:
        return tc.forward([datum(seq)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    trained = forward_logprobs(tokens)
    assert not np.allclose(trained, by_hand_logprobs(tokens), atol=1e-2)  # training moved the model
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert scored[0] is None and np.allclose(scored[1:], trained, atol=1e-4)

    prompt = types.ModelInput.from_ints(tokens[:3])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    out = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    assert [s.tokens for s in out.sequences] == [s.tokens for s in again.sequences]
    assert len({tuple(s.tokens) for s in out.sequences}) > 1  # the samples are not one draw repeated
    for seq in out.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        assert np.allclose(seq.logprobs, forward_logprobs(tokens[:3] + seq.tokens)[2:], atol=1e-4)

    first = out.sequences[0].tokens
    cut = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[first[2]])
    stopped = sampler.sample(prompt, num_samples=5, sampling_params=cut).result().sequences[0]
    assert stopped.tokens == first[: first.index(first[2]) + 1] and stopped.stop_reason == "stop"

    tokenizer = by_hand_tokenizer()
    text = tokenizer.decode(first[3:5])
    cut = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[text])
    stopped = sampler.sample(prompt, num_samples=5, sampling_params=cut).result().sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == first[: len(stopped.tokens)]
    assert text in tokenizer.decode(stopped.tokens) and text not in tokenizer.decode(stopped.tokens[:-1])

    path = tc.save_weights_for_sampler("named").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/named"
    named = sc.create_sampling_client(model_path=path).result()
    assert np.allclose(named.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:], trained, atol=1e-4)
    with pytest.raises(tinker.NotFoundError):
        client(base_url, KEY_B).create_sampling_client(model_path=path).result()

    base = sc.create_sampling_client(base_model="tiny").result()
    base_scored = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert np.allclose(base_scored[1:], by_hand_logprobs(tokens), atol=1e-4)

    # "inflight" samplers of a client all sample its latest inflight save
    early = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    tc.forward_backward([datum(tokens)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    late = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    now = forward_logprobs(tokens)
    for inflight in (early, late):
        assert np.allclose(inflight.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:], now, atol=1e-4)

    for bad, message in [(dict(top_k=5), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p")]:
        bad_params = types.SamplingParams(**{"max_tokens": 4, **bad})
        with pytest.raises(tinker.BadRequestError, match=message):
            base.sample(prompt, num_samples=1, sampling_params=bad_params).result()
    with pytest.raises(tinker.BadRequestError, match="num_samples"):
        base.sample(prompt, num_samples=10_000, sampling_params=types.SamplingParams(max_tokens=4)).result()
    with pytest.raises(tinker.BadRequestError, match="num_samples x"):  # what one request may cost is bounded
        base.sample(prompt, num_samples=200, sampling_params=types.SamplingParams(max_tokens=1000)).result()
    sc.close("success").result()  # its model and samplers go (the fixture's key holds at most 3 models)


def test_checkpoints_restore_weights_and_adam_survive_a_restart_and_belong_to_their_key(tmp_path):
    """save_state keeps the adapters and AdamW's state: loading it and repeating a step gives the very model the
    first run reached; after a restart of the server on the same checkpoint folder a new client loads the state
    and samples the named sampler weights; the REST calls list them; another key finds none of it; a deleted
    checkpoint is gone. The REST calls a recipe makes besides (training runs, weights info, capabilities,
    healthz) answer from the same store."""
    options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A, KEY_B}), str(tmp_path / "ck"))
    tokens = [5, 17, 99, 3, 42, 7, 61]

    def step(tc) -> None:
        tc.forward_backward([datum(tokens)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()

    def logprobs(tc) -> np.ndarray:
        return tc.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    with serving(options) as url:
        sc = client(url)
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, user_metadata={"renderer_name": "x"}).result()
        step(tc)
        step(tc)
        saved_at = logprobs(tc)
        path = tc.save_state("two").result().path
        sampler_path = tc.save_weights_for_sampler("two").result().path
        assert path == f"tinker://{tc.model_id}/weights/two"
        step(tc)
        after_three = logprobs(tc)
        tc.load_state_with_optimizer(path).result()
        assert np.allclose(logprobs(tc), saved_at, atol=1e-6)
        step(tc)  # the same step from the restored state: Adam's moments came back too
        assert np.allclose(logprobs(tc), after_three, atol=1e-5)
        for bad in ("../escape", "..", ".hidden"):  # (a leading dot would name the store's own temp folders)
            with pytest.raises(tinker.RequestFailedError, match="name"):
                tc.save_state(bad).result()
        assert np.allclose(logprobs(tc), after_three, atol=1e-5)  # the refusal kept its seq_id: no gap, no hang
        rest = sc.create_rest_client()
        listed = {c.tinker_path: c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed == {path: "training", sampler_path: "sampler"}
        run = rest.get_training_run_by_tinker_path(path).result()
        assert run.base_model == "tiny" and run.lora_rank == 4 and run.user_metadata == {"renderer_name": "x"}
        runs = rest.list_training_runs().result()
        assert [r.training_run_id for r in runs.training_runs] == [tc.model_id] and runs.cursor.total_count == 1
        info = rest.get_weights_info_by_tinker_path(sampler_path).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
        models = rest.get_server_capabilities().result().supported_models
        assert [(m.model_name, m.trainable, m.sampleable) for m in models] == [("tiny", True, True)]
        assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}
        other = client(url, KEY_B).create_rest_client()
        assert other.list_training_runs().result().training_runs == []
        with pytest.raises(tinker.NotFoundError):
            other.get_training_run(tc.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            other.get_weights_info_by_tinker_path(sampler_path).result()

    with serving(options) as url:  # a new server process would read the same folder
        sc = client(url)
        restored = sc.create_training_client_from_state_with_optimizer(path).result()
        assert np.allclose(logprobs(restored), saved_at, atol=1e-6)
        step(restored)
        assert np.allclose(logprobs(restored), after_three, atol=1e-5)
        sampler = sc.create_sampling_client(model_path=sampler_path).result()
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert np.allclose(scored[1:], saved_at, atol=1e-4)
        rest = sc.create_rest_client()
        assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} == {path, sampler_path}
        with pytest.raises(tinker.NotFoundError):
            client(url, KEY_B).create_training_client_from_state(path).result()
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
        with pytest.raises(tinker.NotFoundError):
            sc.create_sampling_client(model_path=sampler_path).result()


def test_tenants_share_a_base_model_and_never_each_others_adapters(base_url):
    """A training client's losses and logprobs are the same whether it trains alone or while another key's
    client (another rank, no output-layer adapter, its own data and learning rate) trains on the same base
    model between its steps: the base is shared, each client's adapters and AdamW are its own."""
    tokens, other = [5, 17, 99, 3, 42, 7, 61], [8, 8, 21, 34, 55, 89]

    def run(with_neighbour: bool) -> tuple[list[float], np.ndarray]:
        sc = client(base_url, KEY_A)
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        neighbour = None
        if with_neighbour:
            sc_b = client(base_url, KEY_B)
            neighbour = sc_b.create_lora_training_client(base_model="tiny", rank=2, seed=5,
                                                         train_unembed=False).result()  # fmt: skip
        losses = []
        for _ in range(3):
            fb = tc.forward_backward([datum(tokens)], "cross_entropy")
            if neighbour is not None:
                neighbour.forward_backward([datum(other)], "cross_entropy").result()
                neighbour.optim_step(types.AdamParams(learning_rate=0.1)).result()
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            losses.append(fb.result().metrics["loss:sum"])
        final = tc.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        sc.close("success").result()
        if with_neighbour:
            sc_b.close("success").result()
        return losses, final

    alone, together = run(False), run(True)
    assert alone[0] == together[0]  # the very same figures, to the last bit
    assert np.array_equal(alone[1], together[1])


def test_with_a_sample_seed_a_loop_draws_the_same_samples_whatever_another_tenant_does(tmp_path):
    """serve --sample-seed: a sample-then-train loop (unseeded requests, as the cookbook's) run on a fresh server
    draws the same samples and reaches the very same losses whether or not another key samples and trains on the
    same base model between its requests (learner.serve.draw_ids); each request still draws its own samples."""
    tokens, other = [5, 17, 99], [8, 8, 21]
    params = types.SamplingParams(max_tokens=5, temperature=1.0)

    def run(with_neighbour: bool) -> tuple[list[float], list[list[int]]]:
        options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A, KEY_B}),
                               str(tmp_path / f"ckpt{with_neighbour}"), 3, sample_seed=11)  # fmt: skip
        with serving(options) as url:
            tc = client(url, KEY_A).create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
            neighbour = client(url, KEY_B).create_lora_training_client(base_model="tiny", rank=2).result()
            losses, drawn = [], []
            for _ in range(3):
                sampler = tc.save_weights_and_get_sampling_client().result()
                if with_neighbour:
                    theirs = neighbour.save_weights_and_get_sampling_client().result()
                    theirs.sample(types.ModelInput.from_ints(tokens), 4, params).result()  # their prompt: ours
                    neighbour.forward_backward([datum(other + [3, 4])], "cross_entropy").result()
                    neighbour.optim_step(types.AdamParams(learning_rate=0.1)).result()
                # (one after the other: identical requests in flight at once may trade their samples)
                prompt = types.ModelInput.from_ints(tokens)
                samples = [s.tokens for _ in range(2) for s in sampler.sample(prompt, 4, params).result().sequences]
                drawn.append(samples)
                fb = tc.forward_backward([datum(tokens + s) for s in samples if s], "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
                losses.append(fb.result().metrics["loss:sum"])
            return losses, drawn

    alone, together = run(False), run(True)
    assert alone == together  # the same samples, the very same losses
    assert alone[1][0][:4] != alone[1][0][4:]  # two equal requests: each its own draws


def test_requests_drawn_in_one_batch_are_each_drawn_from_the_model(tmp_path):
    """asample requests queued on one sampler are drawn together in the engine's waves (prompts of different
    lengths, left-padded): each sample's logprobs are still the model's for its own prompt, each request
    draws its own samples, and a refused request in the batch fails alone."""
    from learner.serve.sampler import LocalSampler, SamplerWeights

    sampler = LocalSampler(sampler_engine, str(tmp_path))
    params = types.SamplingParams(max_tokens=5, temperature=1.0, stop=[])
    prompts = [[5, 17], [9, 3, 42, 7, 61], [2, 2, 2], [5, 17]]
    reqs = [types.SampleRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, sampling_params=params)
            for p in prompts]  # fmt: skip
    reqs.append(types.SampleRequest(prompt=types.ModelInput.from_ints([10**6]), num_samples=1, sampling_params=params))
    draws = [11, 12, 13, 14, 15]
    drawn = sampler.sample_batch(SamplerWeights("tiny", 0, {}), reqs, draws)
    assert "vocabulary" in str(drawn[-1])
    for prompt, result in zip(prompts, drawn[:-1], strict=True):
        assert len(result.samples) == 2
        for sample in result.samples:
            want = by_hand_logprobs(prompt + sample.tokens)[len(prompt) - 1 :]
            assert np.allclose(sample.logprobs, want, atol=1e-4)
    assert [s.tokens for s in drawn[0].samples] != [s.tokens for s in drawn[3].samples]  # same prompt, own draws
    alone = sampler.sample_batch(SamplerWeights("tiny", 0, {}), [reqs[3]], [14])[0]  # its draws, not its batch's
    assert [s.tokens for s in alone.samples] == [s.tokens for s in drawn[3].samples]


@pytest.mark.parametrize("flush", [False, True])
def test_a_subnormal_temperature_is_refused_even_under_flush_to_zero(flush):
    """A temperature of 1e-310 (a subnormal: sample_next raised IndexError on it) is refused from its bits, also
    under the flush-to-zero the learner's process runs with, where it compares equal to 0. (There a JSON body's
    1e-310 already parses as 0.0, which is greedy: found when xdist ran the server test after a learner test.)"""
    from learner.serve.sampler import check_request
    from learner.serve.wire import RequestError

    tiny = struct.unpack("<d", struct.pack("<Q", 1 << 40))[0]  # about 5e-312, made from bits: a literal would be
    req = types.SampleRequest(prompt=types.ModelInput.from_ints([1, 2]), num_samples=1,  # parsed as 0 under FTZ
                              sampling_params=types.SamplingParams(max_tokens=4, temperature=tiny))  # fmt: skip
    torch.set_flush_denormal(flush)
    try:
        with pytest.raises(RequestError, match="temperature"):
            check_request(req)
    finally:
        torch.set_flush_denormal(False)


def test_a_prompt_token_id_beyond_31_bits_is_refused_before_anything_hashes_it():
    from learner.serve.sampler import check_request
    from learner.serve.wire import RequestError

    for token in (2**64 + 5, 2**31, -1):
        req = types.SampleRequest(prompt=types.ModelInput.from_ints([1, token]), num_samples=1,
                                  sampling_params=types.SamplingParams(max_tokens=4))  # fmt: skip
        with pytest.raises(RequestError, match="token id"):
            check_request(req)


def test_a_checkpoint_swapped_half_way_by_a_crash_is_put_back_at_the_next_start(tmp_path):
    """A save renames the old checkpoint aside, the new one into place, then deletes the old: a crash between
    the renames leaves only .NAME.old, which the next start puts back; a leftover .NAME.tmp is removed."""
    from learner.serve.checkpoints import CheckpointStore, RunInfo

    store = CheckpointStore(tmp_path)
    run_id = "sess-0123456789abcdef:train:0"
    store.add_run(run_id, KEY_A, RunInfo("tiny", 2, True), None)
    path = store.save(KEY_A, run_id, "weights", "a", {"x.lora_A.weight": np.ones((2, 3), np.float32)})
    final = store.find(KEY_A, path).folder
    final.rename(final.with_name(".a.old"))  # the crash: the old one aside, the new one never renamed in
    (final.parent / ".b.tmp").mkdir()
    store = CheckpointStore(tmp_path)
    assert store.adapters(store.find(KEY_A, path))["x.lora_A.weight"].sum() == 6.0
    assert not (final.parent / ".b.tmp").exists()
    with pytest.raises(NotFound):
        store.find(KEY_B, path)


def test_api_keys_see_only_their_own_models_and_bad_requests_get_the_sdks_errors(base_url):
    """Key B cannot read key A's model (not found, as if it did not exist); an unknown key is refused;
    a base model the server does not serve, an unknown loss and a token outside the vocabulary are the
    client's errors with a line naming them."""
    sc_a = client(base_url, KEY_A)
    tc_a = sc_a.create_lora_training_client(base_model="tiny", rank=2).result()
    sc_b = client(base_url, KEY_B)
    future = tc_a.forward([datum([1, 2, 3])], "cross_entropy")
    future.result()
    for key, status in ((KEY_B, 404), (KEY_A, 200)):
        got = httpx.post(f"{base_url}/api/v1/get_info", headers={"X-API-Key": key},
                         json={"model_id": tc_a.model_id, "type": "get_info"})  # fmt: skip
        assert got.status_code == status, got.text
    session = tc_a.model_id.split(":")[0]  # (the SDK names models SESSION:train:N)
    created = httpx.post(f"{base_url}/api/v1/create_model", headers={"X-API-Key": KEY_A}, json={
        "session_id": session, "model_seq_id": 99, "base_model": "tiny", "lora_config": {"rank": 1}})  # fmt: skip
    request_id = created.json()["request_id"]
    for key, status in ((KEY_B, 404), (KEY_A, 200)):
        got = httpx.post(f"{base_url}/api/v1/retrieve_future", headers={"X-API-Key": key},
                         json={"request_id": request_id}, timeout=60)  # fmt: skip
        assert got.status_code == status, got.text
    assert got.json()["model_id"] == f"{session}:train:99"
    with pytest.raises(tinker.AuthenticationError):
        client(base_url, "tml-not-a-key-of-this-server").create_lora_training_client(base_model="tiny", rank=2).result()
    with pytest.raises(tinker.BadRequestError, match="not served"):
        sc_b.create_lora_training_client(base_model="meta-llama/Llama-3.2-1B", rank=2).result()

    with pytest.raises(tinker.BadRequestError, match="holds 3 models"):  # the first test's, tc_a and #99
        client(base_url, KEY_A).create_lora_training_client(base_model="tiny", rank=2).result()
    sc_a.close("success").result()  # ends its session: tc_a and #99 go, and the key may create again
    client(base_url, KEY_A).create_lora_training_client(base_model="tiny", rank=2).result()
    bad_loss = sc_b.create_lora_training_client(base_model="tiny", rank=2).result()
    with pytest.raises(Exception, match="loss_fn 'stable_reinforce' is not served"):
        bad_loss.forward_backward([datum([1, 2, 3])], "stable_reinforce").result()
    with pytest.raises(Exception, match="outside the vocabulary"):
        bad_loss.forward_backward([datum([1, 2, 10**6])], "cross_entropy").result()


def test_a_refused_request_keeps_its_place_and_hostile_bodies_cost_the_server_nothing(base_url):
    """A request refused when its turn comes (an optim_step with a learning rate of 5) still takes its seq_id:
    the next one runs rather than waiting forever for a gap. An overflowing loss is stepped over, not on,
    and said so in finite JSON. A zstd bomb, deep JSON and a seq_id far ahead are 400s; a request waiting for
    an earlier seq_id fails when its session ends, rather than holding its place in the key's quota forever."""
    headers = {"X-API-Key": KEY_B}

    def post(path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(f"{base_url}/api/v1/{path}", headers=headers, json=body, timeout=60, **kw)

    session = post("create_session", {"tags": [], "user_metadata": None, "sdk_version": "test"}).json()["session_id"]
    created = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                    "lora_config": {"rank": 1}})  # fmt: skip
    assert post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                 "lora_config": {"rank": 1}}).json() == created.json()  # a retried POST  # fmt: skip
    model_id = created.json()["model_id"]
    assert post("retrieve_future", {"request_id": created.json()["request_id"]}).json()["model_id"] == model_id
    huge = post("create_model", {"session_id": session, "model_seq_id": 10**10, "base_model": "tiny",
                                 "lora_config": {"rank": 1}})  # fmt: skip
    assert huge.status_code == 400 and "model_seq_id" in huge.text
    bad = post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 5.0}})
    good = post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})
    assert post("retrieve_future", {"request_id": bad.json()["request_id"]}).json()["category"] == "user"
    assert post("retrieve_future", {"request_id": good.json()["request_id"]}).json()["type"] == "optim_step"
    far = post("optim_step", {"model_id": model_id, "seq_id": 10**6, "adam_params": {"learning_rate": 1e-3}})
    assert far.status_code == 400 and "out of range" in far.text
    waiting = post("optim_step", {"model_id": model_id, "seq_id": 5, "adam_params": {"learning_rate": 1e-3}})
    post(f"sessions/{session}/finish", {"reason": {"type": "success"}, "detail": None})
    ended = post("retrieve_future", {"request_id": waiting.json()["request_id"]}).json()  # not held forever
    assert ended["category"] == "user" and "ended" in ended["error"]

    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    got = httpx.post(f"{base_url}/api/v1/telemetry", headers=headers | {"Content-Encoding": "zstd"}, content=bomb)
    assert got.status_code == 400 and "exceeds" in got.text
    got = httpx.post(f"{base_url}/api/v1/telemetry", headers=headers, content=b"[" * 100_000 + b"]" * 100_000)
    assert got.status_code == 400

    tc = client(base_url, KEY_B).create_lora_training_client(base_model="tiny", rank=2).result()
    huge = [0.0, 3e38, 3e38]
    tc.forward_backward([datum([1, 2, 3, 4], logprobs=[-5.0] * 3, advantages=huge)], "importance_sampling").result()
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics == {"skipped_steps:sum": 1.0}


def test_serve_refuses_a_bad_key_file_in_one_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("not-a-key\n")
    res = run_cli("serve", "--api-key-file", str(keys), "--models", "tiny", timeout=60)
    assert res.returncode == 2 and "not a key" in res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_keys_take_turns_on_the_model_thread():
    """One key's queue of jobs does not hold up another's: after the job running, keys alternate."""
    import concurrent.futures

    from learner.serve.futures import ModelThread

    thread, ran, running, release = ModelThread(), [], threading.Event(), threading.Event()
    futures = []

    def job(name: str, wait: bool = False):
        def run() -> str:
            if wait:
                running.set()
                release.wait(30)
            ran.append(name)
            return name

        return run

    for key, name, wait in [("a", "a0", True)] + [("a", f"a{i}", False) for i in range(1, 5)] + [("b", "b1", False)]:
        futures.append(concurrent.futures.Future())
        thread.run(key, futures[-1], job(name, wait))
        running.wait(30)  # a0 runs before the others are queued
    release.set()
    concurrent.futures.wait(futures, timeout=30)
    thread.close()
    assert ran == ["a0", "a1", "b1", "a2", "a3", "a4"]


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("family", __import__("tests.families", fromlist=["FAMILIES"]).FAMILIES)
def test_every_family_serves_the_logprobs_of_its_own_forward_and_trains(family, full, tmp_path):
    """A training client on each family's tiny model (an HF folder, as a user serves one), with the output
    layer's adapter too, or every weight trained (full fine-tuning): forward's logprobs are the base model's own
    (fresh adapters are zero), and cross_entropy steps lower the loss; the local sampler, given the trained
    adapters (or weights), scores the prompt as the trained model does (the output layer included, tied or not),
    and the base model again after."""
    from learner.serve.sampler import LocalSampler, SamplerWeights
    from learner.serve.trained_model import OwnCopy, SharedBase, TrainedModel
    from learner.serve.wire import Datum, ForwardBackward
    from learner.train.models import load_policy
    from tests.families import save_family

    folder = str(save_family(family, tmp_path / family))
    tokens = [5, 17, 99, 3, 42, 7, 61]
    base = load_policy(folder, "unused").model
    with torch.no_grad():
        logits = base(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()  # [T, V]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).numpy()

    if full:
        served = TrainedModel(OwnCopy(folder, "unused", "cpu"), lora_rank=0)
    else:
        served = TrainedModel(SharedBase(folder, "unused", "cpu"), lora_rank=4, head=True)

    def request(forward_only: bool) -> ForwardBackward:
        inputs = {"target_tokens": np.array(tokens[1:], np.int64)}
        return ForwardBackward("m", 1, "cross_entropy", {}, forward_only, [Datum(np.array(tokens[:-1]), inputs)])

    logp, metrics = served.forward_backward(request(forward_only=True))
    assert np.allclose(logp[0], want, atol=1e-4), family
    losses = []
    for _ in range(3):
        losses.append(served.forward_backward(request(forward_only=False))[1]["loss:sum"])
        served.optim_step(0.005 if full else 0.02, (0.9, 0.95), 1e-8, 0.0, 1.0)
    assert losses[-1] < losses[0], (family, losses)

    trained = served.forward_backward(request(forward_only=True))[0][0]
    sampler = LocalSampler(sampler_engine, "unused")
    prompt = types.ModelInput.from_ints(tokens[:-1])
    ask = types.SampleRequest(prompt=prompt, sampling_params=types.SamplingParams(max_tokens=1), prompt_logprobs=True)
    weights = SamplerWeights(folder, 0 if full else 4, served.adapter_tensors(), full)
    scored = sampler.sample(weights, ask).prompt_logprobs
    assert np.allclose(scored[1:], trained[:-1], atol=1e-4), family
    torch.set_num_threads(2)
    base_scored = sampler.sample(SamplerWeights(folder, 0, {}), ask).prompt_logprobs  # the adapters replaced
    assert torch.get_num_threads() == 2  # the engine's thread count was its own while it sampled
    assert np.allclose(base_scored[1:], want[:-1], atol=1e-4), family
