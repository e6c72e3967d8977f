"""`echo-rl bench sampler`: our batched llama.cpp sampler against llama-cpp-python's own API;
`echo-rl bench engines`: the worker's engines on CPU and GPU side by side.

Both run the same F16 GGUF (written from the learner's float weights), the same prompts, the same
number of completions, the same token budget, temperature 1 and the same thread count, in one process
one after the other.
"""

from __future__ import annotations

import json
import random
import tempfile
import time

from rich.console import Console
from rich.table import Table


def run_sampler_bench(
    model: str, prompts: int, group_size: int, max_new_tokens: int, threads: int, max_batch: int,
    cache_dir: str, json_out: bool,
) -> dict:  # fmt: skip
    import llama_cpp

    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.engines.llamacpp import LlamaCppEngine

    policy = load_policy(model, cache_dir)
    task = make_task("arithmetic")
    rng = random.Random(0)
    prompt_ids = [policy.render_prompt(task.sample(rng).prompt) for _ in range(prompts)]

    work = tempfile.mkdtemp(prefix="echo-bench-")
    ours = LlamaCppEngine(work, threads=threads, max_batch=max_batch)
    ours.load_policy(model_spec(policy), wire_tensors(policy.model))
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
    max_batch: int, cache_dir: str, json_out: bool,
) -> list[dict]:  # fmt: skip
    """Worker tokens/s of each engine on the same prompts, draws and token budget, one after the other
    in one process: llama.cpp on the CPU and offloaded to its GPU backend, transformers on CPU and CUDA.
    An engine this machine cannot run (no GPU backend, no CUDA) is reported as such, not measured."""
    import torch

    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.config import ConfigError
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.engines import make_engine
    from worker.engines.llamacpp import gpu_backend

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
        engine = make_engine(
            engine_name, tempfile.mkdtemp(prefix="echo-bench-"), threads, max_batch, gpu_layers, device
        )
        engine.load_policy(spec, tensors)
        engine.generate(requests[:1], SamplingParams(1.0, 1.0, 4, 0))  # warm-up: context, kernels
        t = time.perf_counter()
        groups = engine.generate(requests, params)
        seconds = time.perf_counter() - t
        tokens = sum(len(c.tokens) for g in groups for c in g)
        results.append({"engine": name, "tokens": tokens, "seconds": round(seconds, 3),
                        "tokens_per_s": round(tokens / seconds, 1), "backend": engine.backend()})  # fmt: skip
        if hasattr(engine, "close"):
            engine.close()
    if json_out:
        print(json.dumps(results))
        return results
    table = Table(title=f"worker engines, {model}, {prompts} prompts x {group_size}, <= {max_new_tokens} tokens")
    for col in ("engine", "runs on", "completion tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="left" if col in ("engine", "runs on") else "right")
    for r in results:
        if r["tokens_per_s"] is None:
            table.add_row(r["engine"], r["note"], "-", "-", "-")
        else:
            where = " ".join(str(v) for k, v in r["backend"].items() if k in ("backend", "gpu"))
            table.add_row(r["engine"], where, str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}")
    Console().print(table)
    return results


def run_codec_bench(model: str, lrs: list[float], steps: int, cache_dir: str, json_out: bool) -> list[dict]:
    """Train `steps` real GRPO steps per learning rate and measure the bf16 XOR-delta of each version.

    Reports, per lr: bytes on the wire for the version after step 1 (vs the initial weights), after step
    `steps` (vs the version before it) and for the cumulative delta v_steps vs v_0, each as a fraction
    of the full bf16 checkpoint, with encode and decode seconds.
    """
    from learner.config import GRPOConfig
    from learner.orchestrate.rollouts import score_groups
    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.trainer import GRPOTrainer
    from learner.train.wire_weights import wire_dtypes, wire_tensors
    from p2p.messages import GenerationRequest, SamplingParams
    from p2p.versions import build_version, rebuild_raw
    from worker.engines.llamacpp import LlamaCppEngine

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
        rng = random.Random(0)
        for step in range(1, steps + 1):
            engine.load_policy(spec, wire_tensors(policy.model))
            problems = [task.sample(rng) for _ in range(4)]
            prompts = [policy.render_prompt(p.prompt) for p in problems]
            requests = [GenerationRequest(p, 8, k) for k, p in enumerate(prompts)]
            groups = engine.generate(requests, SamplingParams(1.0, 1.0, 48, step))
            scored = score_groups(task, policy, problems, prompts, groups, version=step - 1)
            trainer.step([r for g in scored for r in g])
            pv, raw, enc, dec = bf16_version(policy, step, (step - 1, previous))
            if step in (1, steps):
                rows.append(_codec_row(lr, f"v{step} vs v{step - 1}", pv, len(raw), enc, dec))
            if step == steps and steps > 1:
                cum, _, enc, dec = bf16_version(policy, step, (0, raw0))
                rows.append(_codec_row(lr, f"v{step} vs v0", cum, len(raw), enc, dec))
            previous = raw
        engine.close()
    rows.insert(0, _codec_row(None, "full snapshot", full, len(raw0), full_enc, full_dec))
    if json_out:
        print(json.dumps(rows))
        return rows
    table = Table(title=f"bf16 policy versions on the wire, {model}")
    for col in ("lr", "payload", "bytes", "of full bf16", "encode s", "decode s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['lr']:g}" if r["lr"] else "-", r["payload"], f"{r['bytes']:,}", f"{100 * r['fraction']:.2f}%",
            f"{r['encode_s']:.2f}", f"{r['decode_s']:.2f}",
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


def run_verify_bench(
    model: str, prompts: int, group_size: int, max_new_tokens: int, top_p: float, wire_dtype: str, threads: int,
    cache_dir: str, json_out: bool, temperatures: list[float], tolerance: float = 0.02, draw_tolerance: float = 0.02,
) -> dict:  # fmt: skip
    """Calibrate rollout verification (learner.orchestrate.verify): per group, the logprob divergence d and the draw
    miss m of honest llama.cpp rollouts against forgeries, at each temperature.

    Honest: the llama.cpp engine samples from the published 16-bit weights (F16 GGUF, as a worker does)
    with the lease's draws (p2p.draws). Forged from the same groups: logprobs all 0, logprobs jittered by
    0.1 nats; and text with exact logprobs (what the sampling proof must catch): unsampled random tokens,
    completions sampled with another seed, one token of every completion changed, and completions of
    another policy (weights with 1% relative noise, same draws). "caught" is the share of groups with
    d > tolerance or m > draw_tolerance.
    """
    import copy

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from learner.orchestrate.rollouts import Rollout
    from learner.orchestrate.verify import RolloutVerifier, merged_weights, replay_sampling
    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.messages import GenerationRequest, SamplingParams
    from p2p.weights import to_float32
    from worker.engines.llamacpp import LlamaCppEngine

    policy = load_policy(model, cache_dir)
    spec = model_spec(policy)
    task = make_task("arithmetic")
    rng = random.Random(0)
    prompt_ids = [policy.render_prompt(task.sample(rng).prompt) for _ in range(prompts)]
    tensors = wire_tensors(policy.model, wire_dtype)
    config = copy.deepcopy(policy.model.config)
    exact = AutoModelForCausalLM.from_config(config).float().eval()  # what a forger computes logprobs with
    exact.load_state_dict(merged_weights(tensors, None, 0.0), strict=False)
    torch.set_num_threads(threads)
    noise = np.random.default_rng(7)
    perturbed = {
        n: (a.astype(np.float32) * (1 + 0.01 * noise.standard_normal(a.shape))).astype(a.dtype)
        if a.dtype != np.uint16 else a
        for n, a in tensors.items()
    }  # fmt: skip
    seed = 12345

    def sample(weights: dict, temperature: float, seed: int) -> list[list]:
        engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-verify-"), threads=threads, max_batch=32)
        engine.load_policy(spec, {n: to_float32(a) for n, a in weights.items()})
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        groups = engine.generate([GenerationRequest(p, group_size, k) for k, p in enumerate(prompt_ids)], params)
        engine.close()
        return groups

    results = {}
    for temperature in temperatures:
        verifier = RolloutVerifier(
            lambda: AutoModelForCausalLM.from_config(config), temperature, top_p, 1, 0.0, tolerance, draw_tolerance
        )
        verifier.remember(0, tensors, None)

        def exact_logprobs(prompt: list[int], tokens: list[int], temperature: float = temperature) -> list[float]:
            with torch.no_grad():
                return replay_sampling(exact, [Rollout(prompt, tokens, [], 0.0)], temperature, top_p)[0][0].tolist()

        def measure(groups: list[list], forge, verifier=verifier) -> list[tuple[float, float]]:
            out = []
            for k, (prompt, group) in enumerate(zip(prompt_ids[: len(groups)], groups, strict=True)):
                r = np.random.default_rng(k)
                rollouts = [Rollout(prompt, *forge(prompt, c, r), 0.0, 0.0, 0) for c in group]
                out.append(verifier.measure(0, seed, k, rollouts))
            return out

        def changed_one(prompt, c, r):
            tokens = list(c.tokens)
            i = int(r.integers(len(tokens)))
            tokens[i] = (tokens[i] + 1 + int(r.integers(spec.vocab_size - 1))) % spec.vocab_size
            return tokens, exact_logprobs(prompt, tokens)

        def unsampled(prompt, c, r):
            tokens = [int(t) for t in r.integers(3, spec.vocab_size, len(c.tokens))]
            return tokens, exact_logprobs(prompt, tokens)

        honest_groups = sample(tensors, temperature, seed)
        measure(honest_groups[:1], lambda p, c, r: (c.tokens, c.logprobs))  # warm-up: builds the verifier's model
        tick = time.perf_counter()
        honest = measure(honest_groups, lambda p, c, r: (c.tokens, c.logprobs))
        check_s = (time.perf_counter() - tick) / len(honest_groups)
        rows = {
            "honest": honest,
            "logprobs all 0": measure(honest_groups, lambda p, c, r: (c.tokens, [0.0] * len(c.tokens))),
            "logprobs jittered 0.1 nats": measure(
                honest_groups,
                lambda p, c, r: (c.tokens, list(np.minimum(0, c.logprobs + r.normal(0, 0.1, len(c.tokens))))),
            ),
            "unsampled tokens, exact logprobs": measure(honest_groups, unsampled),
            "another seed, exact logprobs": measure(
                sample(tensors, temperature, seed + 1), lambda p, c, r: (c.tokens, exact_logprobs(p, c.tokens))
            ),
            "one token changed, exact logprobs": measure(honest_groups, changed_one),
            "other policy (1% noise), same draws": measure(
                sample(perturbed, temperature, seed), lambda p, c, r: (c.tokens, c.logprobs)
            ),
        }
        results[str(temperature)] = {
            "seconds_per_group_checked": round(check_s, 3),
            "tokens_per_group": sum(len(c.tokens) for g in honest_groups for c in g) / len(honest_groups),
            "rows": {
                name: {
                    "d_median": round(float(np.median([d for d, _ in v])), 5), "d_max": round(max(d for d, _ in v), 5),
                    "m_median": round(float(np.median([m for _, m in v])), 5), "m_max": round(max(m for _, m in v), 5),
                    "caught": sum(d > tolerance or m > draw_tolerance for d, m in v) / len(v),
                }
                for name, v in rows.items()
            },
        }  # fmt: skip
    result = {
        "model": model, "prompts": prompts, "group_size": group_size, "max_new_tokens": max_new_tokens,
        "top_p": top_p, "wire_dtype": wire_dtype, "tolerance": tolerance, "draw_tolerance": draw_tolerance,
        "temperatures": results,
    }  # fmt: skip
    if json_out:
        print(json.dumps(result))
        return result
    for temperature, r in results.items():
        table = Table(
            title=f"{model}, T {temperature}, top_p {top_p}: logprob divergence d (nats/token), draw miss m per group"
        )
        for col in ("rollouts", "d median", "d max", "m median", "m max", "caught"):
            table.add_column(col, justify="left" if col == "rollouts" else "right")
        for name, row in r["rows"].items():
            table.add_row(name, f"{row['d_median']:.5f}", f"{row['d_max']:.5f}", f"{row['m_median']:.5f}",
                          f"{row['m_max']:.5f}", f"{row['caught']:.0%}")  # fmt: skip
        Console().print(table)
        Console().print(
            f"verifying one group of {group_size} took {r['seconds_per_group_checked']:.3f} s "
            f"({r['tokens_per_group']:.0f} tokens); caught: d > {tolerance} or m > {draw_tolerance}"
        )
    return result
