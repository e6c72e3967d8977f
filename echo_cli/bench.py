"""`echo-rl bench sampler`: our batched llama.cpp sampler against llama-cpp-python's own API;
`echo-rl bench engines`: the worker's engines on CPU and GPU side by side.

Both run the same F16 GGUF (written from the learner's float weights), the same prompts, the same
number of completions, the same token budget, temperature 1 and the same thread count, in one process
one after the other.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def run_sampler_bench(
    model: str, prompts: int, group_size: int, max_new_tokens: int, threads: int, max_batch: int,
    cache_dir: str, json_out: bool,
) -> dict:  # fmt: skip
    import llama_cpp

    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import send_to_sampler
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.engines.llamacpp import LlamaCppEngine

    policy = load_policy(model, cache_dir)
    task = make_task("arithmetic")
    rng = random.Random(0)
    prompt_ids = [policy.render_prompt(task.sample(rng).prompt) for _ in range(prompts)]

    work = tempfile.mkdtemp(prefix="echo-bench-")
    ours = LlamaCppEngine(work, threads=threads, max_batch=max_batch)
    send_to_sampler(ours, model_spec(policy), policy.model)
    gguf_path = f"{work}/policy.gguf"
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    requests = [GenerationRequest(p, group_size, k) for k, p in enumerate(prompt_ids)]
    ours.generate(requests[:1], SamplingParams(1.0, 1.0, 4, 0))  # warm-up: context creation
    t = time.perf_counter()
    groups = ours.generate(requests, params)
    ours_s = time.perf_counter() - t
    ours_tokens = sum(len(c.tokens) for g in groups for c in g)
    ours.close()

    llm = llama_cpp.Llama(
        model_path=gguf_path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False
    )
    llm.create_completion(prompt_ids[0], max_tokens=4, temperature=1.0, seed=0)  # warm-up
    t = time.perf_counter()
    theirs_tokens = 0
    for i, p in enumerate(prompt_ids):
        for j in range(group_size):
            out = llm.create_completion(
                p,
                max_tokens=max_new_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                repeat_penalty=1.0,
                seed=i * 1000 + j,
            )  # plain temperature sampling, as ours
            theirs_tokens += out["usage"]["completion_tokens"]
    theirs_s = time.perf_counter() - t

    result = {
        "model": model,
        "prompts": prompts,
        "group_size": group_size,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "ours_tokens": ours_tokens,
        "ours_seconds": round(ours_s, 3),
        "ours_tokens_per_s": round(ours_tokens / ours_s, 1),
        "llama_cpp_python_tokens": theirs_tokens,
        "llama_cpp_python_seconds": round(theirs_s, 3),
        "llama_cpp_python_tokens_per_s": round(theirs_tokens / theirs_s, 1),
    }
    result["ratio"] = round(result["ours_tokens_per_s"] / result["llama_cpp_python_tokens_per_s"], 2)
    if json_out:
        print(json.dumps(result))
        return result
    table = Table(title=f"sampler throughput, {model}, {prompts} prompts x {group_size}, <= {max_new_tokens} tokens")
    for col in ("sampler", "completion tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="right" if col != "sampler" else "left")
    table.add_row(
        "echo-rl llama.cpp (batched, with logprobs)",
        str(ours_tokens),
        f"{ours_s:.2f}",
        f"{result['ours_tokens_per_s']:.1f}",
    )
    table.add_row(
        "llama-cpp-python create_completion (no logprobs)", str(theirs_tokens), f"{theirs_s:.2f}",
        f"{result['llama_cpp_python_tokens_per_s']:.1f}",
    )  # fmt: skip
    Console().print(table)
    Console().print(f"ratio: [bold]{result['ratio']:.2f}x[/]")
    return result


ENGINES = {  # name: (engine, gpu_layers, device)
    "llamacpp-cpu": ("llamacpp", 0, "cpu"),
    "llamacpp-gpu": ("llamacpp", -1, "cpu"),
    "transformers-cpu": ("transformers", 0, "cpu"),
    "transformers-cuda": ("transformers", 0, "cuda"),
}


def run_engines_bench(
    names: list[str], model: str, prompts: int, group_size: int, max_new_tokens: int, threads: int,
    max_batch: int, cache_dir: str, json_out: bool, quants: tuple[str, ...] = (),
) -> list[dict]:  # fmt: skip
    """Worker tokens/s of each engine on the same prompts, draws and token budget, one after the other
    in one process: llama.cpp on the CPU and offloaded to its GPU backend, transformers on CPU and CUDA.
    An engine this machine cannot run (no GPU backend, no CUDA) is reported as such, not measured.
    `quants` (worker.quantize formats): each llama.cpp engine again on llama.cpp's quantization of the
    weights, with the seconds to quantize and the GGUF's bytes (what the weights take in memory). Each
    llama.cpp row also draws every group alone (`alone_tokens_per_s`), as a quantized worker does."""
    import torch

    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.config import ConfigError
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.engines import make_engine
    from worker.engines.llamacpp import gpu_backend
    from worker.quantize import quantize_gguf
    from worker.sampling import generate_alone

    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise ConfigError(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    policy = load_policy(model, cache_dir)
    spec, tensors = model_spec(policy), wire_tensors(policy.model)
    rng = random.Random(0)
    task = make_task("arithmetic")
    requests = [GenerationRequest(policy.render_prompt(task.sample(rng).prompt), group_size, k) for k in range(prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    available = {"llamacpp-gpu": bool(gpu_backend()), "transformers-cuda": torch.cuda.is_available()}
    results = []
    for name in names:
        engine_name, gpu_layers, device = ENGINES[name]
        if not available.get(name, True):
            results.append({"engine": name, "tokens_per_s": None, "note": "not available on this machine"})
            continue
        work = Path(tempfile.mkdtemp(prefix="echo-bench-"))
        engine = make_engine(engine_name, str(work), threads, max_batch, gpu_layers, device)
        engine.load_policy(spec, tensors)
        for fmt in ("f16", *quants) if engine_name == "llamacpp" else (None,):
            row = {"engine": name if fmt in (None, "f16") else f"{name} {fmt}"}  # F16: the engine as it runs
            if fmt not in (None, "f16"):
                row["quantize_s"] = round(quantize_gguf(work / "policy.gguf", work / f"{fmt}.gguf", fmt, threads), 2)
                engine.load_gguf(work / f"{fmt}.gguf", spec.eos_ids)
            if fmt is not None:
                row["gguf_bytes"] = (work / ("policy.gguf" if fmt == "f16" else f"{fmt}.gguf")).stat().st_size
            engine.generate(requests[:1], SamplingParams(1.0, 1.0, 4, 0))  # warm-up: context, kernels
            t = time.perf_counter()
            groups = engine.generate(requests, params)
            seconds = time.perf_counter() - t
            tokens = sum(len(c.tokens) for g in groups for c in g)
            if fmt is not None:  # each group in a wave of its own: how a quantized worker draws (exact replay)
                t = time.perf_counter()
                alone = sum(len(c.tokens) for g in generate_alone(engine.generate, requests, params) for c in g)
                row["alone_tokens_per_s"] = round(alone / (time.perf_counter() - t), 1)
            results.append({**row, "tokens": tokens, "seconds": round(seconds, 3),
                            "tokens_per_s": round(tokens / seconds, 1), "backend": engine.backend()})  # fmt: skip
        if hasattr(engine, "close"):
            engine.close()
    if json_out:
        print(json.dumps(results))
        return results
    table = Table(title=f"worker engines, {model}, {prompts} prompts x {group_size}, <= {max_new_tokens} tokens")
    for col in ("engine", "runs on", "completion tokens", "seconds", "tokens/s", "alone tok/s", "weights MiB"):
        table.add_column(col, justify="left" if col in ("engine", "runs on") else "right")
    for r in results:
        if r["tokens_per_s"] is None:
            table.add_row(r["engine"], r["note"], "-", "-", "-", "-", "-")
        else:
            where = " ".join(str(v) for k, v in r["backend"].items() if k in ("backend", "gpu"))
            size = f"{r['gguf_bytes'] / 2**20:.0f}" if "gguf_bytes" in r else "-"
            alone = f"{r['alone_tokens_per_s']:.1f}" if "alone_tokens_per_s" in r else "-"
            table.add_row(r["engine"], where, str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
                          alone, size)  # fmt: skip
    Console().print(table)
    return results


def run_codec_bench(
    model: str, lrs: list[float], steps: int, cache_dir: str, json_out: bool, quants: tuple[str, ...] = ()
) -> list[dict]:
    """Train `steps` real GRPO steps per learning rate and measure the bf16 XOR-delta of each version.

    Reports, per lr: bytes on the wire for the version after step 1 (vs the initial weights), after step
    `steps` (vs the version before it) and for the cumulative delta v_steps vs v_0, each as a fraction
    of the full bf16 checkpoint, with encode and decode seconds. `quants` (worker.quantize formats): each
    version also written as an F16 GGUF and quantized by llama.cpp (the seconds a quantized worker spends per
    version, or a learner publishing that format), its tensors' bytes delta-coded against the previous
    version's the same way (what the learner would ship per format instead of one bf16 delta).
    """
    from learner.config import GRPOConfig
    from learner.orchestrate.rollouts import score_groups
    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.trainer import GRPOTrainer
    from learner.train.wire_weights import send_to_sampler, wire_dtypes, wire_tensors
    from p2p.messages import GenerationRequest, SamplingParams
    from p2p.versions import build_version, rebuild_raw
    from worker.engines.llamacpp import LlamaCppEngine
    from worker.gguf_writer import write_gguf
    from worker.quantize import quantize_gguf

    def quantized_version(f16, version, fmt, work, base):
        """`fmt`'s quantization of the F16 GGUF `f16`, its tensors as uint8 arrays built as a version (a delta
        against `base`) like bf16_version."""
        import gguf
        import numpy as np

        seconds = quantize_gguf(f16, work / f"{fmt}.gguf", fmt)
        stored = gguf.GGUFReader(work / f"{fmt}.gguf").tensors
        tensors = {t.name: np.asarray(t.data).view(np.uint8).ravel() for t in stored}
        t = time.perf_counter()
        pv, raw = build_version("codec-bench", version, tensors, base=base)
        return pv, raw, seconds, time.perf_counter() - t

    def bf16_version(policy, version, base):
        tensors = wire_tensors(policy.model, "bf16")  # what the publisher sends with --wire-dtype bf16
        t = time.perf_counter()
        pv, raw = build_version("codec-bench", version, tensors, wire_dtypes(tensors), base=base)
        encode_s = time.perf_counter() - t
        t = time.perf_counter()
        rebuild_raw(pv.manifest, pv.chunks, base[1] if base else None)
        return pv, raw, encode_s, time.perf_counter() - t

    rows = []
    task = make_task("arithmetic", {"ops": "+", "max_value": 20})
    for lr in lrs:
        policy = load_policy(model, cache_dir)
        spec = model_spec(policy)
        engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-codec-"), threads=2, max_batch=32)
        trainer = GRPOTrainer(policy.model, GRPOConfig(lr=lr, skip_equal_groups=False), temperature=1.0)
        full, raw0, full_enc, full_dec = bf16_version(policy, 0, None)
        previous = raw0
        work = Path(engine.work_dir)
        f16 = write_gguf(work / "f16.gguf", spec, wire_tensors(policy.model, "f16")) if quants else None
        held = {fmt: quantized_version(f16, 0, fmt, work, None)[1] for fmt in quants}  # each format's v0
        rng = random.Random(0)
        for step in range(1, steps + 1):
            send_to_sampler(engine, spec, policy.model)
            problems = [task.sample(rng) for _ in range(4)]
            prompts = [policy.render_prompt(p.prompt) for p in problems]
            requests = [GenerationRequest(p, 8, k) for k, p in enumerate(prompts)]
            groups = engine.generate(requests, SamplingParams(1.0, 1.0, 48, step))
            scored = score_groups(task, policy, problems, prompts, groups, version=step - 1)
            trainer.step([r for g in scored for r in g])
            pv, raw, enc, dec = bf16_version(policy, step, (step - 1, previous))
            if step in (1, steps):
                rows.append(_codec_row(lr, f"v{step} vs v{step - 1}", pv, len(raw), enc, dec))
            f16 = write_gguf(work / "f16.gguf", spec, wire_tensors(policy.model, "f16")) if quants else None
            for fmt in quants:  # each from the one F16 GGUF of this version
                qv, held_raw, quantize_s, enc = quantized_version(f16, step, fmt, work, (step - 1, held[fmt]))
                if step in (1, steps):
                    row = _codec_row(lr, f"{fmt} v{step} vs v{step - 1}", qv, len(raw), enc, 0.0)
                    del row["decode_s"]  # not measured: the worker would load the file as it is
                    rows.append(row | {"quantize_s": round(quantize_s, 3), "format_bytes": len(held_raw)})
                held[fmt] = held_raw
            if step == steps and steps > 1:
                cum, _, enc, dec = bf16_version(policy, step, (0, raw0))
                rows.append(_codec_row(lr, f"v{step} vs v0", cum, len(raw), enc, dec))
            previous = raw
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    rows.insert(0, _codec_row(None, "full snapshot", full, len(raw0), full_enc, full_dec))
    if json_out:
        print(json.dumps(rows))
        return rows
    table = Table(title=f"policy versions on the wire (bf16 deltas; --quant: quantized files' deltas), {model}")
    for col in ("lr", "payload", "bytes", "of full bf16", "encode s", "decode s", "quantize s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['lr']:g}" if r["lr"] else "-", r["payload"], f"{r['bytes']:,}", f"{100 * r['fraction']:.2f}%",
            f"{r['encode_s']:.2f}", f"{r['decode_s']:.2f}" if "decode_s" in r else "-",
            f"{r['quantize_s']:.2f}" if "quantize_s" in r else "-",
        )  # fmt: skip
    Console().print(table)
    return rows


def _codec_row(lr: float | None, payload: str, pv, raw_size: int, encode_s: float, decode_s: float) -> dict:
    return {
        "lr": lr,
        "payload": payload,
        "bytes": pv.manifest.payload_size,
        "raw_bytes": raw_size,
        "fraction": pv.manifest.payload_size / raw_size,
        "encode_s": round(encode_s, 3),
        "decode_s": round(decode_s, 3),
    }
