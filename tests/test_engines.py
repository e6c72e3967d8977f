"""The llama.cpp engine against torch on the tiny model: logits, generation and behaviour logprobs."""

import inspect

import numpy as np
import pytest
import torch

from learner.orchestrate.rollouts import Rollout
from learner.train.models import model_spec
from learner.train.trainer import completion_logprobs
from learner.train.wire_weights import send_to_sampler, wire_tensors
from p2p.messages import Engine, GenerationRequest, SamplingParams
from worker.engines.hf import TransformersEngine
from worker.engines.llamacpp import LlamaCppEngine
from worker.gguf_writer import permute_for_llamacpp
from worker.quantize import dequantized_weights, quantize_gguf, tensor_types
from worker.sampling import replay_wave


@pytest.mark.parametrize("engine_class", [LlamaCppEngine, TransformersEngine])
def test_every_engine_keeps_the_engine_contract(engine_class):
    """Each engine has every method of p2p.messages.Engine, with the same parameters."""
    for name, method in inspect.getmembers(Engine, inspect.isfunction):
        if not name.startswith("_"):
            ours = inspect.signature(getattr(engine_class, name)).parameters
            assert list(ours) == list(inspect.signature(method).parameters), name


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    eng = LlamaCppEngine(tmp_path_factory.mktemp("engine"), threads=2, max_batch=8)
    send_to_sampler(eng, model_spec(tiny), tiny.model)
    yield eng
    eng.close()


def test_permutation_interleaves_rotary_halves():
    w = np.arange(8)[:, None].repeat(2, axis=1)  # one head of dim 8: rows 0..7
    assert permute_for_llamacpp(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_llamacpp_logits_match_torch(tiny, engine):
    ids = tiny.render_prompt("What is 12 + 7? Think step by step, then answer.")
    ours = engine.logits(ids)  # [T, V]
    with torch.no_grad():
        ref = tiny.model(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 5e-3  # F16 weights against float32
    assert np.array_equal(ours.argmax(axis=1), ref.argmax(axis=1))


@pytest.mark.parametrize(
    "fmt, matrix_type, closer", [("q8_0", "Q8_0", 1.0), ("q4_0", "Q4_0", 0.5), ("q4_k_m", "Q5_0", 0.5)]
)
def test_quantized_weights_read_back_are_the_ones_llamacpp_runs(tiny, engine, tmp_path, fmt, matrix_type, closer):
    """llama.cpp's quantizer on the engine's F16 GGUF; gguf-py reads the blocks back under HF names in HF's
    Q/K row order: a torch forward with them gives llama.cpp's logits of the quantized file closer than the
    float weights do, by half for 4-bit formats (for Q8_0 the weights' error is below the noise of llama.cpp
    quantizing activations to 8 bits; for q4_k_m the tiny model's 64-wide rows are not a multiple of Q4_K's
    256-value blocks, so llama.cpp falls back to Q5_0)."""
    quantized = tmp_path / f"{fmt}.gguf"
    quantize_gguf(engine.work_dir / "policy.gguf", quantized, fmt)
    assert tensor_types(quantized).get(matrix_type, 0) > 0
    spec = model_spec(tiny)
    floats = {n: p.detach().numpy() for n, p in tiny.model.state_dict().items()}
    read_back = dequantized_weights(quantized, spec, {n: a.shape for n, a in floats.items()})
    if fmt == "q8_0":  # llama.cpp's quantizer and gguf-py's reference one agree bit for bit
        import gguf

        w = floats["model.layers.0.mlp.down_proj.weight"].astype(np.float16).astype(np.float32)
        again = gguf.quants.dequantize(
            gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        )
        assert np.array_equal(again, read_back["model.layers.0.mlp.down_proj.weight"])
    ids = tiny.render_prompt("What is 12 + 7?")
    quant_engine = LlamaCppEngine(tmp_path / "engine", threads=2, max_batch=8)
    quant_engine.load_gguf(quantized, spec.eos_ids)
    theirs = quant_engine.logits(ids)  # [T, V]
    quant_engine.close()
    model = type(tiny.model)(tiny.model.config).float().eval()
    weights = {n: torch.from_numpy(read_back.get(n, a)) for n, a in floats.items()}
    weights.pop("lm_head.weight", None)  # tied: the output layer is the (quantized) embedding read back
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        with_read_back = model(torch.tensor([ids])).logits[0].numpy()
        with_floats = tiny.model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - with_read_back).max() < closer * np.abs(theirs - with_floats).max()


def test_generate_groups_and_behaviour_logprobs(tiny, engine):
    prompts = [tiny.render_prompt(f"What is {i} + {i}?") for i in range(3)]
    params = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12, seed=7)
    requests = [GenerationRequest(p, 4, k) for k, p in enumerate(prompts)]
    groups = engine.generate(requests, params)  # 12 sequences, max_batch 8: 2 waves
    assert [len(g) for g in groups] == [4, 4, 4]
    rollouts = []
    for p, group in zip(prompts, groups, strict=True):
        for c in group:
            assert 1 <= len(c.tokens) <= 12 and len(c.logprobs) == len(c.tokens)
            assert all(0 <= t < tiny.model.config.vocab_size for t in c.tokens)
            assert c.finish_reason in ("stop", "length")
            rollouts.append(Rollout(p, c.tokens, c.logprobs, 0.0))
    # the sampler's behaviour logprobs agree with torch's logprobs of the same tokens at the same temperature
    with torch.no_grad():
        ref = completion_logprobs(tiny.model, rollouts, temperature=0.8).numpy()
    ours = np.array([lp for r in rollouts for lp in r.behaviour_logprobs])
    assert np.abs(ours - ref).max() < 5e-3
    # same seed, same completions
    again = engine.generate([GenerationRequest(p, 4, k) for k, p in enumerate(prompts)], params)
    assert [[c.tokens for c in g] for g in again] == [[c.tokens for c in g] for g in groups]


def test_transformers_engine_same_interface(tiny):
    eng = TransformersEngine(threads=2)
    send_to_sampler(eng, model_spec(tiny), tiny.model)
    prompt = tiny.render_prompt("What is 1 + 1?")
    [group] = eng.generate([GenerationRequest(prompt, 3)], SamplingParams(1.0, 1.0, 10, 3))
    rollouts = [Rollout(prompt, c.tokens, c.logprobs, 0.0) for c in group]
    with torch.no_grad():
        ref = completion_logprobs(tiny.model, rollouts, temperature=1.0).numpy()
    assert np.abs(np.array([lp for r in rollouts for lp in r.behaviour_logprobs]) - ref).max() < 1e-4


def test_load_rejects_a_broken_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    eng = LlamaCppEngine(tmp_path, threads=1)
    with pytest.raises(RuntimeError, match="could not load"):
        eng.load_gguf(bad, [2])


def test_a_new_version_reuses_the_gguf_layout_byte_for_byte(tiny, tmp_path):
    """Versions after the first are written into the first file's layout (metadata copied, not packed
    again): the file is the very bytes a fresh write gives, and the staged model is the new weights."""
    from worker.gguf_writer import GGUFLayout, gguf_arrays, write_gguf

    spec = model_spec(tiny)
    first = write_gguf(tmp_path / "a.gguf", spec, wire_tensors(tiny.model, "f16"))
    layout = GGUFLayout.of(first)
    with torch.no_grad():
        changed = {name: p + 0.01 for name, p in tiny.model.state_dict().items()}
    newer = wire_tensors(tiny.model, "f16", state=changed)
    fresh = write_gguf(tmp_path / "b.gguf", spec, newer)
    assert layout.fits(gguf_arrays(spec, newer))
    reused = layout.write(tmp_path / "c.gguf", gguf_arrays(spec, newer))
    assert reused.read_bytes() == fresh.read_bytes()

    eng = LlamaCppEngine(tmp_path / "engine", threads=2, max_batch=8)  # stage twice: the second reuses it
    eng.install(eng.stage(spec, wire_tensors(tiny.model, "f16"), None))
    eng.install(eng.stage(spec, newer, None))
    reference = LlamaCppEngine(tmp_path / "reference", threads=2, max_batch=8)
    reference.load_gguf(fresh, spec.eos_ids)
    tokens = [1, 5, 9, 3]
    assert np.array_equal(eng.logits(tokens), reference.logits(tokens))
    eng.close()
    reference.close()


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "q4_0"])
def test_a_group_replayed_in_its_own_wave_layout_repeats_llamacpps_sampling_bit_for_bit(tiny, engine, tmp_path, fmt):
    """A group drawn by llama.cpp in a wave of its own (max_batch = G), F16 or quantized, fed back teacher-forced
    in that layout (worker.sampling.replay_wave) by a second engine with another thread count: every token is
    the one its draw picks and every logprob the worker's, to the bit. The same group replayed on another
    format's weights is told apart."""
    path = engine.work_dir / "policy.gguf"
    if fmt != "f16":
        path = tmp_path / f"{fmt}.gguf"
        quantize_gguf(engine.work_dir / "policy.gguf", path, fmt)
    spec = model_spec(tiny)
    prompt = tiny.render_prompt("Count from one to ten.")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=11)
    request = GenerationRequest(prompt, 4, 3, completion=4)
    worker = LlamaCppEngine(tmp_path / "worker", threads=2, max_batch=4)
    worker.load_gguf(path, spec.eos_ids)
    group = worker.generate([request], params)[0]
    worker.close()
    verifier = LlamaCppEngine(tmp_path / "verifier", threads=1, max_batch=4)
    verifier.load_gguf(path, spec.eos_ids)
    replayed = replay_wave(verifier, request, [c.tokens for c in group], params)
    verifier.close()
    for c, r in zip(group, replayed, strict=True):
        assert r.drawn == c.tokens and r.logprobs == c.logprobs and max(r.misses) == 0.0
    other_path = engine.work_dir / "policy.gguf"  # a quantized group on the F16 weights, an F16 one on q4_0's
    if fmt == "f16":
        other_path = tmp_path / "q4_0.gguf"
        quantize_gguf(engine.work_dir / "policy.gguf", other_path, "q4_0")
    other = LlamaCppEngine(tmp_path / "other", threads=2, max_batch=4)
    other.load_gguf(other_path, spec.eos_ids)
    elsewhere = replay_wave(other, request, [c.tokens for c in group], params)
    other.close()
    theirs = np.array([x for c in group for x in c.logprobs])
    assert np.abs(theirs - np.array([x for r in elsewhere for x in r.logprobs])).max() > 1e-3
