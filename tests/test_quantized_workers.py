"""Quantized workers (`worker join --quant`): the learner replays their groups exactly on its own llama.cpp build,
refuses a format or build it cannot verify in one line, and flags a worker that runs another format than it
declares; in a real swarm an F16 and a q8_0 worker train side by side, neither flagged."""

import re

import pytest

from learner.orchestrate.rollouts import Rollout
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.verify_quantized import QuantEngines, QuantizedReplay, declared_weights
from learner.train.models import model_spec
from learner.train.wire_weights import wire_tensors
from p2p.host import BadRequest
from p2p.messages import WEIGHT_FORMATS, GenerationRequest, Heartbeat, SamplingParams, SpecReply, describe_hardware
from tests.conftest import run_cli
from worker.engines import make_engine
from worker.gguf_writer import unsupported_by_writer
from worker.quantize import QUANT_TYPES, llamacpp_build
from worker.sampling import generate_alone

PARAMS = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=77)


def test_weight_formats_are_the_quantizers_and_declared_bounded():
    assert set(WEIGHT_FORMATS) == {"f16", *QUANT_TYPES}
    beat = Heartbeat.from_wire({"version": 1, "hardware": {"weights": "q8_0", "build": "x" * 99, "engine": "llamacpp"}})
    assert beat.hardware["weights"] == "q8_0" and len(beat.hardware["build"]) == 32
    assert describe_hardware(beat.hardware).startswith("llamacpp q8_0 on cpu")
    spec = SpecReply.from_wire(SpecReply("r", model_spec_of_tiny(), 4, quant_build="0.3.36-cpu-abc").to_wire())
    assert spec.quant_build == "0.3.36-cpu-abc"
    with pytest.raises(ValueError, match="quant_build"):
        SpecReply.from_wire(SpecReply("r", model_spec_of_tiny(), 4).to_wire() | {"quant_build": "\x1b[2J"})
    sized = SpecReply("r", model_spec_of_tiny(), 4, weights_bytes={"f16": 10, "q4_0": 4}, kv_bytes=3)
    assert SpecReply.from_wire(sized.to_wire()).weights_bytes == {"f16": 10, "q4_0": 4}
    for sizes in [{"q3_k": 1}, {"f16": -1}, {"f16": 1 << 60}, {"f16": True}, {"f16": 1.5}, [1], "f16"]:
        with pytest.raises(ValueError, match="weights_bytes|'f16'"):
            SpecReply.from_wire(sized.to_wire() | {"weights_bytes": sizes})
    with pytest.raises(ValueError, match="kv_bytes"):
        SpecReply.from_wire(sized.to_wire() | {"kv_bytes": -3})


def model_spec_of_tiny():
    from learner.train.models import tiny_policy

    return model_spec(tiny_policy(0))


def test_a_worker_sizes_each_family_as_llamacpp_quantizes_it(tmp_path):
    """The learner's estimate of a worker's weights (learner.train.fit, sent for `--quant auto`) against the
    tensors llama.cpp's quantizer writes, every family's tiny model: F16, Q8_0 and Q4_0 to within 2% (measured:
    0.988 to 1.000), Q4_K_M's mix of blocks within 10% (0.92 to 0.96; SmolLM2 0.996, docs/benchmarks.md)."""
    from gguf import GGUFReader

    from learner.train.fit import worker_sizes
    from learner.train.models import load_policy
    from tests.families import FAMILIES, save_family
    from worker.quantize import quantize_gguf

    for family in FAMILIES:
        policy = load_policy(str(save_family(family, tmp_path / family)), "unused")
        spec = model_spec(policy)
        f16 = make_engine("llamacpp", tmp_path / f"{family}-engine", 1, 8, 0)._write(spec, wire_tensors(policy.model))
        estimate, kv = worker_sizes(policy.model.config, 16, spec.gguf_recipe)
        assert worker_sizes(policy.model.config, 16, '{"unsupported": "x"}')[1] == kv  # llama.cpp cannot run it
        assert kv == 2 * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (256 + 16)
        for fmt in WEIGHT_FORMATS:
            path = f16 if fmt == "f16" else tmp_path / f"{family}.{fmt}.gguf"
            if fmt != "f16":
                quantize_gguf(f16, path, fmt, 1)
            written = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
            low = 0.9 if fmt == "q4_k_m" else 0.98
            assert low <= estimate[fmt] / written <= 1.02, (family, fmt, estimate[fmt], written)


def test_quant_auto_takes_the_largest_format_that_fits_and_that_the_learner_verifies():
    from p2p.config import ConfigError
    from worker.quantize import GIB, PROCESS, auto_weights, memory_budget, worker_memory

    sizes = {"f16": 16 * GIB, "q8_0": 8 * GIB, "q4_k_m": 5 * GIB, "q4_0": 4 * GIB}
    reply = SpecReply("r", model_spec_of_tiny(), 4, quant_build="b1", weights_bytes=sizes, kv_bytes=GIB // 32)
    need = {fmt: worker_memory(reply, fmt, 32, on_gpu=False) for fmt in sizes}
    logits = 512 * reply.spec.vocab_size * 4  # llama.cpp's compute buffer
    # 2 models, the raw version twice, its float32 copy (2 x F16) and, quantized, the F16 GGUF read back
    assert need["f16"] == int(1.1 * (2 * 16 * GIB + GIB)) + 4 * 16 * GIB + PROCESS + logits
    assert need["q8_0"] == int(1.1 * (2 * 8 * GIB + GIB // 8)) + 5 * 16 * GIB + PROCESS + logits  # G sequences
    assert worker_memory(reply, "q8_0", 32, on_gpu=True) == need["q8_0"] - 5 * 16 * GIB  # those stay in RAM
    for budget, fmt in [(need["f16"], "f16"), (need["f16"] - 1, "q8_0"), (need["q4_k_m"], "q4_k_m"),
                        (need["q4_k_m"] - 1, "q4_0")]:  # fmt: skip
        assert auto_weights(reply, "b1", 32, budget, "RAM") == fmt
    assert worker_memory(reply, "f16", 8, False) < need["f16"]  # a smaller wave: less KV cache...
    assert worker_memory(reply, "q8_0", 8, False) == need["q8_0"]  # ...where G sequences were counted already
    with pytest.raises(ConfigError, match=r"no weight format fits RAM .*q4_0 [\d.]+ GiB\): join with --max-batch 4"):
        auto_weights(reply, "b1", 32, need["q4_0"] - 1, "RAM")
    with pytest.raises(ConfigError, match=r"formats are out \(the learner replays them on llama.cpp build b1"):
        auto_weights(reply, "b2", 32, need["q8_0"], "RAM")  # another build: F16 or nothing
    with pytest.raises(ConfigError, match=r"join with --gpu-layers 0 \(quantized workers run on the CPU\)"):
        auto_weights(reply, "0.3.36-gpu-1234", 32, worker_memory(reply, "q8_0", 32, on_gpu=True), "the GPU's memory")
    assert auto_weights(reply, "b2", 32, need["f16"], "RAM") == "f16"
    multi_turn = SpecReply("r", reply.spec, 4, {"spec": {}, "chat": {}}, quant_build="b1", weights_bytes=sizes)
    with pytest.raises(ConfigError, match="multi-turn"):
        auto_weights(multi_turn, "b1", 32, need["q8_0"], "RAM")
    with pytest.raises(ConfigError, match="choose --quant f16, q8_0, q4_k_m or q4_0 yourself"):
        auto_weights(SpecReply("r", reply.spec, 4, quant_build="b1"), "b1", 32, 1 << 40, "RAM")
    assert memory_budget(2.5, {"backend": "cpu"}) == (int(2.5 * GIB), "--memory-gib 2.5")
    assert memory_budget(0, {"backend": "cuda", "gpu_mem_mb": 8192}) == (8 * GIB, "the GPU's memory")
    assert memory_budget(0, {"backend": "cpu"})[0] > 0
    with pytest.raises(ConfigError, match="vulkan GPU has is unknown here .*--memory-gib"):
        memory_budget(0, {"backend": "vulkan"})


def test_a_learner_takes_only_formats_it_can_verify():
    build = llamacpp_build()
    assert declared_weights({}, build, False, True) == "f16"  # an older worker declares nothing: 16-bit
    assert declared_weights({"weights": "q4_0", "build": build}, build, False, True) == "q4_0"
    assert declared_weights({"weights": "q4_0", "build": "other"}, build, False, False) == "q4_0"  # unverified run
    for hardware, episodes, why in [
        ({"weights": "q3_k"}, False, "unknown weight format"),
        ({"weights": "q8_0", "build": "0.3.36-cpu-00000000"}, False, f"on build {build} only"),
        ({"weights": "q8_0", "build": build}, True, "multi-turn"),
    ]:
        with pytest.raises(BadRequest, match=why):
            declared_weights(hardware, build, episodes, True)
    with pytest.raises(BadRequest, match="build none only"):
        declared_weights({"weights": "q8_0", "build": build}, "", False, True)
    with pytest.raises(BadRequest, match=r"takes f16, q8_0 only \(its swarm.quant_formats\)"):  # unverified too
        declared_weights({"weights": "q4_0", "build": build}, build, False, False, ("f16", "q8_0"))
    from learner.swarm_config import SwarmConfig
    from p2p.config import ConfigError

    SwarmConfig(quant_formats="").validate()  # 16-bit workers only
    from learner.config import GRPOConfig

    auto = SwarmConfig()  # 4-bit workers only under an objective that corrects for the sampler
    for objective, correction, corrected in [("behaviour", "tis", False), ("decoupled", "tis", True),
                                             ("cispo", "icepop", True), ("decoupled", "none", False)]:  # fmt: skip
        assert GRPOConfig(objective=objective, correction=correction).corrects_sampler() is corrected
    assert auto.weight_formats(corrected=False) == ("f16", "q8_0")
    assert auto.weight_formats(corrected=True) == ("f16", "q8_0", "q4_k_m", "q4_0")
    assert SwarmConfig(quant_formats="q4_0, q8_0,q4_0").weight_formats() == ("f16", "q4_0", "q8_0")
    assert SwarmConfig(quant_formats="").weight_formats(corrected=True) == ("f16",)
    with pytest.raises(ConfigError, match=r"'AUTO': choose auto \(the default\)"):
        SwarmConfig(quant_formats="AUTO").validate()
    with pytest.raises(ConfigError, match="swarm.quant_formats: 'q3_k': choose auto .* or formats from q8_0"):
        SwarmConfig(quant_formats="q8_0,q3_k").validate()


def test_a_learner_warns_at_start_where_named_4_bit_workers_meet_an_uncorrected_objective(caplog):
    from learner.config import EnvConfig, GRPOConfig, LearnerConfig
    from learner.swarm_config import SwarmConfig
    from learner.swarm_side import warn_uncorrected_four_bit

    named = SwarmConfig(quant_formats="q8_0,q4_0")
    corrected = GRPOConfig(objective="decoupled", correction="tis", minibatches=2)
    for cfg, quantized, warned in [
        (LearnerConfig(swarm=named), True, ["q4_0"]),  # behaviour with q4_0 named: the expert's choice, warned
        (LearnerConfig(swarm=named, grpo=corrected), True, []),
        (LearnerConfig(), True, []),  # auto: no 4-bit under behaviour, nothing to warn about
        (LearnerConfig(swarm=SwarmConfig(quant_formats="q4_k_m,q4_0")), False, []),  # no quantized worker taken
        (LearnerConfig(swarm=named, env=EnvConfig(env="calculator")), True, []),  # multi-turn: 16-bit workers only
    ]:
        caplog.clear()
        assert warn_uncorrected_four_bit(cfg, quantized) == warned
        assert ("--objective decoupled --minibatches 2" in caplog.text) is bool(warned)


def draw(tiny, tmp_path, fmt: str, requests: list[GenerationRequest]) -> list[list]:
    """Groups a worker running `fmt` draws, each alone (as a quantized worker's daemon does)."""
    engine = make_engine("llamacpp", tmp_path / f"worker-{fmt}", 2, 32, 0, quant=fmt)
    engine.load_policy(model_spec(tiny), wire_tensors(tiny.model, "f16"))
    groups = generate_alone(engine.generate, requests, PARAMS)
    engine.close()
    return groups


def test_the_verifier_replays_a_quantized_group_exactly_and_flags_another_format(tiny, tmp_path):
    spec = model_spec(tiny)
    requests = [GenerationRequest(tiny.render_prompt(p), 4, g) for g, p in enumerate(["Count to ten.", "Say hi."])]

    def verifier() -> RolloutVerifier:
        engines = QuantEngines(lambda fmt: make_engine("llamacpp", tmp_path / f"v-{fmt}", 1, 4, 0, quant=fmt),
                               llamacpp_build(), unsupported_by_writer)  # fmt: skip
        v = RolloutVerifier(lambda: None, 1.0, 0.95, first=100, fraction=1.0, tolerance=0.02, draw_tolerance=0.02,
                            quantized=QuantizedReplay(engines, spec))  # fmt: skip
        v.remember(3, wire_tensors(tiny.model, "f16"), None)
        return v

    def rollouts(request, group) -> list[Rollout]:
        return [Rollout(request.prompt_ids, c.tokens, c.logprobs, 0.0, version=3) for c in group]

    honest = verifier()
    for fmt in ("q8_0", "q4_0"):
        for request, group in zip(requests, draw(tiny, tmp_path, fmt, requests), strict=True):
            replay = honest.check("w", 3, PARAMS.seed, request.group, rollouts(request, group), quantized=(fmt, PARAMS))
            assert (replay.divergence, replay.draw_miss, replay.off_draw) == (0.0, 0.0, 0.0)
    assert not honest.flagged and honest.replays == 4
    assert honest.held_gib() * 2**30 > honest.quantized.held_bytes() > 0  # both quantized models counted
    assert honest.check("w", 9, 1, 0, rollouts(requests[0], group), quantized=("q8_0", PARAMS)) is None  # not kept
    five = rollouts(requests[0], group + group[:1])  # more completions than a group of G = 4: never honest
    odd = honest.check("odd", 3, PARAMS.seed, 0, five, quantized=("q4_0", PARAMS))
    assert odd.refused and honest.flagged == {"odd": f"a group no honest worker sends ({odd.refused})"}
    honest.quantized.close()

    for runs, claims in [("q4_0", "q8_0"), ("f16", "q4_k_m"), ("q8_0", "f16-seed")]:
        liar = verifier()
        groups = draw(tiny, tmp_path, runs, requests)
        seed = PARAMS.seed + 1 if claims == "f16-seed" else PARAMS.seed  # another seed's text, its own logprobs
        fmt = "q8_0" if claims == "f16-seed" else claims
        for request, group in zip(requests, groups, strict=True):
            liar.check("liar", 3, seed, request.group, rollouts(request, group),
                       quantized=(fmt, SamplingParams(1.0, 0.95, 16, seed)))  # fmt: skip
        assert "liar" in liar.flagged, (runs, claims)
        assert f"v3 {fmt}" in liar.flagged["liar"]
        liar.quantized.close()


def test_worker_quant_flags_are_checked_in_one_line(tmp_path):
    res = run_cli("worker", "join", "--learner", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW", "--quant", "q3_k")
    assert res.returncode == 2 and "worker.quant" in res.stderr and "q4_k_m" in res.stderr
    res = run_cli("worker", "join", "--learner", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW", "--quant", "q8_0",
                  "--engine", "transformers")  # fmt: skip
    assert res.returncode == 2 and "needs --engine llamacpp" in res.stderr
    res = run_cli("worker", "join", "--learner", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW", "--memory-gib", "4")
    assert res.returncode == 2 and "only --quant auto reads it" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_an_f16_and_a_q8_0_worker_train_together_and_one_lying_about_its_format_is_flagged(swarm, tmp_path, weights):
    """Versions change every step, so the learner's quantized engine moves between versions too: whole models
    quantized anew, or (LoRA) adapters hot-swapped onto the quantized base it holds, as the worker's."""
    lora = ["--lora-rank", "4"] if weights == "lora" else []
    learner = swarm.learner("--steps", "4", "--verify-first", "1000", *lora)
    swarm.worker("f16", "--max-groups", "1")
    swarm.worker("q8", "--max-groups", "1", *(["--quant", "q8_0"] if lora else quant_auto_for("q8_0")))
    swarm.forger("format")  # declares q8_0, runs q4_0
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    workers = swarm.metrics()[-1]["workers"]
    by_weights = {row["weights"]: row for row in workers.values() if row["groups_accepted"]}
    assert set(by_weights) == {"f16", "q8_0"}, workers  # both honest workers' groups trained on
    flagged = [line for line in swarm.log("learner").splitlines() if " flagged: " in line]
    assert [peer_tail(tmp_path / "forger.key")] == sorted({line.split("worker ")[1][:8] for line in flagged}), flagged
    assert "from v" in flagged[0] and "q8_0" in flagged[0], flagged


def quant_auto_for(fmt: str) -> list[str]:
    """`--quant auto` with a --memory-gib that fits a worker of the swarm fixture's tiny model (token budget 16,
    G = 4, 32 sequences) in `fmt` and not in the next larger format."""
    from learner.train.fit import worker_sizes
    from learner.train.models import tiny_policy
    from worker.quantize import GIB, LARGEST_FIRST, worker_memory

    sizes, kv = worker_sizes(tiny_policy(0).model.config, 16)
    reply = SpecReply("r", model_spec_of_tiny(), 4, weights_bytes=sizes, kv_bytes=kv)
    need = [worker_memory(reply, f, 32, on_gpu=False) for f in LARGEST_FIRST]
    at = LARGEST_FIRST.index(fmt)
    return ["--quant", "auto", "--memory-gib", f"{(need[at] + need[at - 1]) / 2 / GIB:.9f}"]


def peer_tail(key_file) -> str:
    from p2p.identity import load_identity, peer_id_of

    return peer_id_of(load_identity(key_file))[-8:]


def test_a_quantized_worker_of_another_build_is_refused_at_join(swarm, tmp_path):
    """...or of a format the learner does not take (the default takes 4-bit workers only with an objective that
    corrects for them), or with --quant auto where no format fits its memory."""
    learner = swarm.learner("--steps", "1")
    worker = swarm.forger("build")  # a q8_0 worker whose llama.cpp build is not the learner's
    assert worker.wait(300) == 2, (tmp_path / "forger.log").read_text()[-2000:]
    lines = [ln for ln in (tmp_path / "forger.log").read_text().splitlines() if "--quant" in ln]
    assert lines and "join with --quant f16" in lines[-1] and "Traceback" not in (tmp_path / "forger.log").read_text()
    small = swarm.worker("small", "--quant", "auto", "--memory-gib", "0.00001")  # 10 KiB: not even q8_0 fits
    q4 = swarm.worker("q4", "--quant", "q4_0")
    assert swarm.wait(small, 300) == 2 and swarm.wait(q4, 300) == 2, swarm.log("small")[-2000:] + swarm.log("q4")
    assert "--quant auto: no weight format fits --memory-gib 1e-05" in swarm.log("small"), swarm.log("small")[-2000:]
    assert re.search(r"a worker needs f16 [\d.]+ MiB, q8_0 [\d.]+ MiB\)", swarm.log("small"))  # the learner's two
    assert "--quant q4_0: this learner takes f16, q8_0 workers only" in swarm.log("q4"), swarm.log("q4")[-2000:]
    assert "Traceback" not in swarm.log("small") + swarm.log("q4") and learner.poll() is None


def test_bench_codec_measures_what_a_learner_publishing_quantized_versions_would_ship():
    import json

    res = run_cli("bench", "codec", "--model", "tiny", "--lrs", "1e-3", "--steps", "2", "--quant", "q8_0", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["payload"]: r for r in json.loads(res.stdout)}
    assert {"full snapshot", "v1 vs v0", "v2 vs v1", "q8_0 v1 vs v0", "q8_0 v2 vs v1"} <= set(rows), rows
    quantized = rows["q8_0 v2 vs v1"]
    assert quantized["quantize_s"] > 0 and 0 < quantized["bytes"] < quantized["format_bytes"]  # a delta of the file
    res = run_cli("bench", "codec", "--model", "tiny", "--quant", "q3_k")
    assert res.returncode != 0 and "--quant q3_k: choose from" in res.stderr and "Traceback" not in res.stderr
