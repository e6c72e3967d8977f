"""Device selection, bf16 autocast and gradient checkpointing, on the CPU that CI has.

The GPU paths share this code; scripts/gpu_check.sh runs them on a GPU (docs/benchmarks.md says where
that was measured and where not)."""

import copy
import json
import os

import numpy as np
import pytest
import torch

import learner.train.trainer as trainer_module
from learner.config import GRPOConfig
from learner.orchestrate.rollouts import Rollout
from learner.train.devices import enable_grad_checkpointing, grad_checkpointing_on, resolve_device
from learner.train.models import model_spec, tiny_policy
from learner.train.trainer import GRPOTrainer, completion_logprobs
from learner.train.wire_weights import send_to_sampler
from p2p.config import ConfigError
from p2p.messages import GenerationRequest, Heartbeat, SamplingParams, describe_hardware
from tests.conftest import run_cli
from tests.test_trainer import make_rollouts
from worker.engines.hf import TransformersEngine
from worker.engines.llamacpp import LlamaCppEngine, gpu_backend, gpu_device


def test_device_names_resolve_and_wrong_ones_say_why(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")  # no GPU: auto trains on the CPU
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="choose auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    # a machine with two GPUs (torch.device is only a name: nothing is allocated on them here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)  # each torchrun rank on its LOCAL_RANK GPU
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="each rank takes its LOCAL_RANK GPU"):
        resolve_device("cuda:0", ranks=2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "tpu"], "must be auto, cpu, cuda or cuda:N"),
        (["--precision", "fp8"], "(--precision): must be one of fp32, bf16"),
        (["--gpu-layers", "-2"], "must be >= -1"),
    ],
)
def test_bad_device_flags_give_one_line_errors(tmp_path, args, message):
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(tmp_path / "r"), *args)
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_weights():
    policy = tiny_policy(0)
    rollouts = make_rollouts(policy)
    seen: set[torch.dtype] = set()
    layer = policy.model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    before = copy.deepcopy(policy.model.state_dict())
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2), temperature=1.0, precision="bf16")
    stats = trainer.step(rollouts)
    assert seen == {torch.bfloat16}  # the decoder's matmuls ran in bf16
    assert stats["trained_tokens"] > 0 and stats["skipped_updates"] == 0 and np.isfinite(stats["loss"])
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # master weights stay fp32
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    # the logprobs (and so the ratio) are float32 from a float32 output layer, close to fp32's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = completion_logprobs(policy.model, rollouts, 1.0).detach()
    fp32 = completion_logprobs(policy.model, rollouts, 1.0).detach()
    assert bf16.dtype == torch.float32 and (bf16 - fp32).abs().max() < 0.1


def test_grad_checkpointing_gives_the_same_gradient(monkeypatch):
    """Recomputing the decoder layers and the output layer (in blocks of HEAD_ROWS positions) in the
    backward pass changes memory, not the gradient."""
    monkeypatch.setattr(trainer_module, "HEAD_ROWS", 7)  # several output-layer blocks on a small batch
    base = tiny_policy(0)
    rollouts = make_rollouts(base)
    grads = []
    for checkpointing in (False, True):
        policy = copy.deepcopy(base)
        if checkpointing:
            enable_grad_checkpointing(policy.model)
        assert grad_checkpointing_on(policy.model) == checkpointing
        trainer = GRPOTrainer(policy.model, GRPOConfig(max_grad_norm=1e9), 1.0, top_p=0.9)
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        trainer.step(rollouts)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_colocated_run_in_bf16_with_checkpointing_records_its_memory(tmp_path):
    res = run_cli(
        "learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(tmp_path / "r"), "--steps", "2",
        "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--device", "cpu",
        "--precision", "bf16", "--grad-checkpointing",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    memory = rows[-1]["memory_gib"]
    assert {"peak_generate", "peak_train", "peak_export", "weights", "grads", "optimizer", "resident"} <= set(memory)
    assert 0 < memory["weights"] < memory["peak_train"]  # the tiny model's weights: a sliver of the process


def test_transformers_engine_batches_prompts_of_different_lengths_exactly(tiny):
    """Left-padded prompts in one wave give the completions and behaviour logprobs each prompt gets alone."""
    eng = TransformersEngine(threads=2, max_batch=8, device="cpu")
    send_to_sampler(eng, model_spec(tiny), tiny.model)
    prompts = [tiny.render_prompt("What is 1 + 1?"), tiny.render_prompt("Name three colours of the rainbow, please.")]
    params = SamplingParams(1.0, 0.95, 10, 5)
    together = eng.generate([GenerationRequest(p, 3, k) for k, p in enumerate(prompts)], params)
    for k, p in enumerate(prompts):
        [alone] = eng.generate([GenerationRequest(p, 3, k)], params)
        assert [c.tokens for c in alone] == [c.tokens for c in together[k]]
        diff = max(
            abs(a - b)
            for x, y in zip(alone, together[k], strict=True)
            for a, b in zip(x.logprobs, y.logprobs, strict=True)
        )
        assert diff < 1e-4
    # and the behaviour logprobs are the trainer's logprobs of the same tokens
    rollouts = [Rollout(p, c.tokens, c.logprobs, 0.0) for p, g in zip(prompts, together, strict=True) for c in g]
    with torch.no_grad():
        ref = completion_logprobs(tiny.model, rollouts, 1.0, 0.95).numpy()
    assert np.abs(np.array([lp for r in rollouts for lp in r.behaviour_logprobs]) - ref).max() < 1e-4
    assert eng.backend() == {"backend": "cpu"}


def test_llamacpp_offload_on_a_cpu_build_is_refused_with_the_fix(tmp_path):
    if gpu_backend():
        pytest.skip("this llama.cpp has a GPU backend")
    assert LlamaCppEngine(tmp_path).gpu_layers == 0  # -1 (all) means none on a CPU build
    with pytest.raises(ConfigError, match="built for the CPU only.*ECHO_RL_GPU=cuda"):
        LlamaCppEngine(tmp_path, gpu_layers=10)


def test_the_gpu_a_worker_offloads_to_is_the_one_named_by_its_gpu_flag(tmp_path, monkeypatch):
    """`worker join --gpu N` sets CUDA_VISIBLE_DEVICES=N: its name and memory (what --quant auto sizes for) are
    GPU N's, not the first GPU's. nvidia-smi here is a stand-in answering for GPUs 0 and 1."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$2" = 1 ] && echo "RTX 3060, 12288" || echo "RTX 4090, 24564"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_device() == {"gpu": "RTX 4090", "gpu_mem_mb": 24564}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpu_device() == {"gpu": "RTX 3060", "gpu_mem_mb": 12288}
    for hidden in ["", "MIG-5c89b8f0-1e2c-5b0b-8a3e-000000000000"]:  # no GPU visible; a slice of one
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_device() == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert gpu_device() == {}


def test_heartbeat_carries_the_backend_and_status_shows_it():
    beat = Heartbeat.from_wire(
        {"version": 3, "hardware": {"engine": "llamacpp", "threads": 8, "machine": "x86_64", "cores": 16,
                                    "backend": "cuda", "gpu": "NVIDIA GeForce RTX 4090", "gpu_mem_mb": 24564,
                                    "gpu_layers": 999, "other": "x"}}
    )  # fmt: skip
    assert "other" not in beat.hardware
    line = describe_hardware(beat.hardware)
    assert line == "llamacpp on cuda NVIDIA GeForce RTX 4090 (24564 MB), 8 threads, x86_64 (16 cores)"
    assert describe_hardware({"engine": "llamacpp", "threads": True}) == "llamacpp on cpu, ? threads, ? (? cores)"
    assert describe_hardware({"engine": "llama\ncpp\x1b[2J", "gpu": "A\rB"}) == (
        "llamacpp[2J on cpu AB (? MB), ? threads, ? (? cores)"
    )  # no control characters reach a terminal


def test_bench_engines_measures_what_this_machine_has():
    res = run_cli(
        "bench", "engines", "--model", "tiny", "--engines", "llamacpp-cpu,transformers-cpu,llamacpp-gpu",
        "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--quant", "q8_0", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = {r["engine"]: r for r in json.loads(res.stdout)}
    assert rows["llamacpp-cpu"]["tokens_per_s"] > 0 and rows["transformers-cpu"]["tokens_per_s"] > 0
    assert rows["llamacpp-cpu"]["backend"] == {"backend": "cpu", "weights": "f16"}
    quantized = rows["llamacpp-cpu q8_0"]  # drawn alone too, as a quantized worker does
    assert quantized["alone_tokens_per_s"] > 0 and quantized["gguf_bytes"] < rows["llamacpp-cpu"]["gguf_bytes"]
    if not gpu_backend():
        assert rows["llamacpp-gpu"]["tokens_per_s"] is None  # reported as not available, not measured


def test_status_shows_a_workers_hardware_as_text_never_markup():
    from rich.console import Console

    from echo_cli.status import render

    verification = {"groups_checked": 0, "divergence_max": None, "divergence_median": None, "draw_miss_max": None,
                    "tolerance": 0.02, "draw_tolerance": 0.02, "flagged": {}, "groups_dropped": 0}  # fmt: skip
    peer = {"peer_id": "y" * 20, "price": 0.1, "version": 1, "version_lag": 0, "newest_share": 1.0,
            "tokens_per_s": 10, "open_leases": 0, "groups_accepted": 1, "refused": 0, "last_seen_s": 1,
            "hardware": "llamacpp on [red]cuda[/red] X (1 MB), 2 threads"}  # fmt: skip
    doc = {"peer_id": "x" * 20, "run_id": "r", "step": 1, "steps": 2, "version_published": 1, "mode": "async",
           "staleness": 2, "publish_every": 1, "utilisation": 0.5, "reward": 0.1, "buffer": 0, "stale_dropped": 0,
           "rollouts_per_s": 1.0, "verification": verification, "addrs": [], "peers": [peer],
           "device": "cpu (2 threads), fp32", "memory_gib": {"peak_train": 3.0, "resident": 2.0}}  # fmt: skip
    console = Console(width=250, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "[red]cuda[/red]" in text  # shown as the worker sent it, not interpreted
    assert "cpu (2 threads), fp32; memory: 3.0 GiB peak in training, 2.0 GiB resident" in text
