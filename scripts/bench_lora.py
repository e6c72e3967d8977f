"""LoRA versions against full-weight versions on SmolLM2-135M: bytes on the wire, worker apply time,
llama.cpp hot-swap latency. One process, measured side by side.

    .venv/bin/python scripts/bench_lora.py [--rank 8] [--steps 2] [--swaps 20] [--json]

Both policies train `--steps` GRPO steps on arithmetic from rollouts the llama.cpp engine samples, then
publish as the learner does (f16 on the wire): the full run an XOR delta against the previous version,
the LoRA run its adapters. "Apply" is what a worker does with a version it downloaded: check and
decode the chunks, rebuild the tensors, hand them to the llama.cpp engine (a new F16 GGUF loaded from
scratch for full weights; a GGUF adapter set on the live context for LoRA). Swap latency repeats the
LoRA hand-over alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from grpo_steps import train  # scripts/grpo_steps.py

from learner.orchestrate.publisher import Publisher
from learner.train.lora import add_lora
from learner.train.models import load_policy, model_spec
from learner.train.wire_weights import wire_tensors
from p2p.versions import build_version, float_tensors, rebuild_raw
from worker.engines.llamacpp import LlamaCppEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    cache = "~/.cache/echo-rl"
    result: dict = {"model": args.model, "rank": args.rank}

    # full fine-tuning: publish v(steps-1) then v(steps) as a delta, as the learner does every step
    policy = load_policy(args.model, cache)
    spec = model_spec(policy)
    result["bf16_checkpoint_bytes"] = sum(a.size * 2 for a in wire_tensors(policy.model).values())
    engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-lora-"), threads=2, max_batch=32)
    engine.load_policy(spec, wire_tensors(policy.model))
    publisher = Publisher(seeder=None, run_id="bench", full_every=10, dtype="f16")
    train(policy, engine, args.steps - 1, 1e-5, lora=False)
    before = publisher.snapshot(policy.model)
    _, raw_before = build_version("bench", 0, before)
    train(policy, engine, 1, 1e-5, lora=False)
    delta, _ = build_version("bench", 1, publisher.snapshot(policy.model), base=(0, raw_before))
    full, _ = build_version("bench", 1, publisher.snapshot(policy.model))
    t = time.perf_counter()
    raw = rebuild_raw(delta.manifest, delta.chunks, raw_before)
    engine.load_policy(spec, float_tensors(delta.manifest, raw))
    result["full_apply_s"] = round(time.perf_counter() - t, 3)
    result["full_snapshot_bytes"] = full.manifest.payload_size
    result["full_delta_bytes"] = delta.manifest.payload_size
    engine.close()

    # LoRA: the adapters of the newest version, as the learner ships them
    policy = load_policy(args.model, cache)
    add_lora(policy.model, args.rank, args.alpha)
    policy.lora_rank, policy.lora_alpha = args.rank, args.alpha
    spec = model_spec(policy)
    engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-lora-"), threads=2, max_batch=32)
    engine.load_policy(spec, wire_tensors(policy.model))
    train(policy, engine, args.steps, 2e-4, lora=True)
    publisher = Publisher(seeder=None, run_id="bench", full_every=10, dtype="f16", lora=True)
    publisher.base = 0  # as after the run's first (full) publication
    tensors = publisher.snapshot(policy.model)
    adapters, _ = build_version("bench", 1, tensors, adapter_base=0)
    t = time.perf_counter()
    raw = rebuild_raw(adapters.manifest, adapters.chunks)
    engine.load_adapters(spec, float_tensors(adapters.manifest, raw))
    result["lora_apply_s"] = round(time.perf_counter() - t, 4)
    result["lora_version_bytes"] = adapters.manifest.payload_size
    result["lora_params"] = sum(a.size for a in tensors.values())
    adapter_floats = float_tensors(adapters.manifest, raw)
    swaps = []
    for _ in range(args.swaps):
        t = time.perf_counter()
        engine.load_adapters(spec, adapter_floats)
        swaps.append(time.perf_counter() - t)
    result["swap_ms_median"] = round(1000 * statistics.median(swaps), 1)
    result["swap_ms_max"] = round(1000 * max(swaps), 1)
    engine.close()
    result["lora_of_bf16_checkpoint"] = round(result["lora_version_bytes"] / result["bf16_checkpoint_bytes"], 4)
    result["lora_of_full_delta"] = round(result["lora_version_bytes"] / result["full_delta_bytes"], 4)
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
