"""`echo-rl bench verify`: calibrate rollout verification (learner.orchestrate.verify) on honest llama.cpp rollouts
against forgeries, and the forgery a draw check must not let through in bulk (steered_completion)."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def steered_completion(
    model, prompt: list[int], length: int, seed: int, group: int, completion: int, temperature: float, top_p: float,
    band: float, eos: set[int],
) -> list[int]:  # fmt: skip
    """A forgery the draw check must not let through in bulk: a completion written token by token with the
    policy's own weights, each token the least likely one whose inverse-CDF interval lies within `band` of
    the lease's draw (p2p.draws.uniform), where an honest sampler would take the token containing the draw.
    Where the policy is flat, many intervals lie within a band of probability mass, so this steers freely."""
    import numpy as np
    import torch

    from p2p.draws import uniform
    from worker.sampling import policy_distribution

    tokens: list[int] = []
    past, feed = None, prompt
    with torch.no_grad():
        for position in range(length):
            out = model(input_ids=torch.tensor([feed]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            probs, _ = policy_distribution(out.logits[0, -1:].double().numpy(), temperature, top_p)
            p = probs[0]
            cdf = np.cumsum(p)
            u = uniform(seed, group, completion, position) * cdf[-1]
            miss = np.maximum(np.maximum(cdf - p - u, u - cdf), 0.0)  # distance of u from each interval
            near = np.nonzero((miss <= band) & (p > 0))[0]
            token = int(near[np.argmin(p[near])])
            tokens.append(token)
            feed = [token]
            if token in eos:
                break
    return tokens


def run_verify_bench(
    model: str, prompts: int, group_size: int, max_new_tokens: int, top_p: float, wire_dtype: str, threads: int,
    cache_dir: str, json_out: bool, temperatures: list[float], tolerance: float = 0.02, draw_tolerance: float = 0.02,
    off_draw_tolerance: float = 0.05, quants: tuple[str, ...] = (), steered_rows: bool = True,
) -> dict:  # fmt: skip
    """Calibrate rollout verification (learner.orchestrate.verify): per group, the logprob divergence d and the draw
    miss m of honest llama.cpp rollouts against forgeries, at each temperature.

    Honest: the llama.cpp engine samples from the published 16-bit weights (F16 GGUF, as a worker does)
    with the lease's draws (p2p.draws). Forged from the same groups: logprobs all 0, logprobs jittered by
    0.1 nats; and text with exact logprobs (what the sampling proof must catch): unsampled random tokens,
    completions sampled with another seed, one token of every completion changed, and completions of
    another policy (weights with 1% relative noise, same draws), and completions steered token by token within
    a band of the draws (steered_completion). "caught" is the share of groups with d > tolerance,
    m > draw_tolerance or o (the share of tokens off their draws) > off_draw_tolerance.

    `quants` (worker.quantize formats): honest workers running llama.cpp's quantization of the same version,
    replayed with the F16 weights and with the quantized ones read back, an F16 worker claiming the format,
    and how far llama.cpp's own logprobs of the same tokens move when the decode batch holds 8 sequences
    instead of up to 32 (`batch_dependence`, nats/token; F16's beside it). Then each group drawn in a wave of its
    own and replayed by llama.cpp in that layout (worker.sampling.replay_wave, same build, same file): the honest
    worker, an F16 worker claiming the format and one of the format claiming F16, its logprobs jittered, and
    text of another seed with that seed's own logprobs.
    """
    import copy

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from learner.orchestrate.replay_torch import merged_weights, replay_sampling
    from learner.orchestrate.rollouts import Rollout
    from learner.orchestrate.verify import Replay, RolloutVerifier, divergence, draw_miss, off_draw
    from learner.tasks import make_task
    from learner.train.models import load_policy, model_spec
    from learner.train.wire_weights import wire_tensors
    from p2p.config import ConfigError
    from p2p.messages import GenerationRequest, SamplingParams
    from p2p.weights import to_float32
    from worker.engines.llamacpp import LlamaCppEngine
    from worker.gguf_writer import unsupported_by_llama_layout
    from worker.quantize import dequantized_weights, quantize_gguf, tensor_types
    from worker.sampling import replay_wave

    policy = load_policy(model, cache_dir)
    spec = model_spec(policy)
    if quants and (reason := unsupported_by_llama_layout(spec)):  # before the hours of the other rows
        raise ConfigError(f"--quant reads quantized weights back in the llama layout only, not {reason}")
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

    quantized: dict[str, dict] = {}  # format -> its GGUF, weights read back, quantize seconds, GGUF bytes

    def sample(weights: dict, temperature: float, seed: int, fmt: str = "f16", max_batch: int = 32) -> list[list]:
        work = tempfile.mkdtemp(prefix="echo-verify-")
        engine = LlamaCppEngine(work, threads=threads, max_batch=max_batch)
        engine.load_policy(spec, {n: to_float32(a) for n, a in weights.items()})
        if fmt != "f16":
            if fmt not in quantized:
                path = f"{work}/{fmt}.gguf"
                seconds = quantize_gguf(f"{work}/policy.gguf", path, fmt, threads)
                read_back = dequantized_weights(path, spec, {n: a.shape for n, a in tensors.items()})
                quantized[fmt] = {
                    "path": path,
                    "seconds": seconds,
                    "types": tensor_types(path),
                    "weights": {n: read_back.get(n, to_float32(a)) for n, a in tensors.items()},
                }
            engine.load_gguf(quantized[fmt]["path"], spec.eos_ids)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
        groups = engine.generate([GenerationRequest(p, group_size, k) for k, p in enumerate(prompt_ids)], params)
        engine.close()
        return groups

    results = {}
    wave_s: list[float] = []  # seconds per group of each wave replay
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

        def wave_measure(
            groups: list[list], path: str, forge=lambda p, c, r: (c.tokens, c.logprobs), temperature=temperature
        ) -> list:
            """Each group (drawn in a wave of its own), forged, replayed by llama.cpp on the GGUF at `path` in that
            wave's layout: d, m and o as the verifier computes them."""
            engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-verify-"), threads=threads, max_batch=group_size)
            engine.load_gguf(path, spec.eos_ids)
            params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
            tick, out = time.perf_counter(), []
            for k, (prompt, group) in enumerate(zip(prompt_ids[: len(groups)], groups, strict=True)):
                r = np.random.default_rng(k)
                forged = [forge(prompt, c, r) for c in group]
                replays = replay_wave(engine, GenerationRequest(prompt, len(group), k), [t for t, _ in forged], params)
                reported = [x for _, logprobs in forged for x in logprobs]
                recomputed = torch.tensor([[x for w in replays for x in w.logprobs]], dtype=torch.float64)
                misses = torch.tensor([[x for w in replays for x in w.misses]], dtype=torch.float64)
                out.append(Replay(divergence(reported, recomputed), draw_miss(misses), off_draw(misses)))
            wave_s.append((time.perf_counter() - tick) / len(groups))
            engine.close()
            return out

        def changed_one(prompt, c, r):
            tokens = list(c.tokens)
            i = int(r.integers(len(tokens)))
            tokens[i] = (tokens[i] + 1 + int(r.integers(spec.vocab_size - 1))) % spec.vocab_size
            return tokens, exact_logprobs(prompt, tokens)

        def unsampled(prompt, c, r):
            tokens = [int(t) for t in r.integers(3, spec.vocab_size, len(c.tokens))]
            return tokens, exact_logprobs(prompt, tokens)

        def steered(groups: list[list], band: float, temperature: float = temperature, verifier=verifier) -> list:
            """Each completion rewritten by steered_completion, with exact logprobs."""
            out = []
            for k, (prompt, group) in enumerate(zip(prompt_ids[: len(groups)], groups, strict=True)):
                rollouts = []
                for j, c in enumerate(group):
                    tokens = steered_completion(
                        exact, prompt, len(c.tokens), seed, k, j, temperature, top_p, band, set(spec.eos_ids)
                    )  # fmt: skip
                    rollouts.append(Rollout(prompt, tokens, exact_logprobs(prompt, tokens), 0.0, 0.0, 0))
                out.append(verifier.measure(0, seed, k, rollouts))
            return out

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
        if steered_rows:  # token by token in transformers: hours for SmolLM2 on 2 cores
            rows[f"steered within {0.9 * draw_tolerance:g} of the draws"] = steered(honest_groups, 0.9 * draw_tolerance)
            rows["steered within 0.02 of the draws"] = steered(honest_groups, 0.02)
        batch_dependence = {"f16": logprob_shift(honest_groups, sample(tensors, temperature, seed, max_batch=8))}
        f16_alone = sample(tensors, temperature, seed, max_batch=group_size) if quants else []  # a wave per group
        for fmt in quants:
            quant_groups = sample(tensors, temperature, seed, fmt)
            quant_verifier = RolloutVerifier(
                lambda: AutoModelForCausalLM.from_config(config), temperature, top_p, 1, 0.0, tolerance,
                draw_tolerance,
            )  # fmt: skip
            quant_verifier.remember(0, quantized[fmt]["weights"], None)
            rows[f"{fmt} worker, replayed with F16 weights"] = measure(
                quant_groups, lambda p, c, r: (c.tokens, c.logprobs)
            )
            rows[f"{fmt} worker, replayed with {fmt} weights"] = measure(
                quant_groups, lambda p, c, r: (c.tokens, c.logprobs), quant_verifier
            )
            rows[f"F16 worker claiming {fmt}"] = measure(
                honest_groups, lambda p, c, r: (c.tokens, c.logprobs), quant_verifier
            )
            batch_dependence[fmt] = logprob_shift(quant_groups, sample(tensors, temperature, seed, fmt, max_batch=8))
            alone = sample(tensors, temperature, seed, fmt, max_batch=group_size)  # each group a wave of its own
            path, f16_path = quantized[fmt]["path"], str(Path(quantized[fmt]["path"]).parent / "policy.gguf")
            rows[f"{fmt} worker, wave replayed"] = wave_measure(alone, path)
            rows[f"{fmt} worker, logprobs jittered 0.01 nats, wave replayed"] = wave_measure(
                alone, path,
                lambda p, c, r: (c.tokens, list(np.minimum(0, c.logprobs + r.normal(0, 0.01, len(c.tokens))))),
            )  # fmt: skip
            rows[f"{fmt} worker, another seed's text and logprobs, wave replayed"] = wave_measure(
                sample(tensors, temperature, seed + 1, fmt, max_batch=group_size), path
            )
            rows[f"F16 worker claiming {fmt}, wave replayed"] = wave_measure(f16_alone, path)
            rows[f"{fmt} worker claiming F16, wave replayed"] = wave_measure(alone, f16_path)
        results[str(temperature)] = {
            "batch_dependence": batch_dependence,
            "seconds_per_group_checked": round(check_s, 3),
            "seconds_per_group_wave_replayed": round(float(np.mean(wave_s)), 3) if wave_s else None,
            "tokens_per_group": sum(len(c.tokens) for g in honest_groups for c in g) / len(honest_groups),
            "rows": {name: _verify_row(v, tolerance, draw_tolerance, off_draw_tolerance) for name, v in rows.items()},
        }  # fmt: skip
        wave_s.clear()
    result = {
        "model": model, "prompts": prompts, "group_size": group_size, "max_new_tokens": max_new_tokens,
        "top_p": top_p, "wire_dtype": wire_dtype, "tolerance": tolerance, "draw_tolerance": draw_tolerance,
        "off_draw_tolerance": off_draw_tolerance, "temperatures": results,
        "quantized": {
            fmt: {"quantize_s": round(q["seconds"], 2), "bytes": Path(q["path"]).stat().st_size, "types": q["types"]}
            for fmt, q in quantized.items()
        },
    }  # fmt: skip
    if json_out:
        print(json.dumps(result))
        return result
    for temperature, r in results.items():
        table = Table(
            title=f"{model}, T {temperature}, top_p {top_p}: logprob divergence d (nats/token), draw miss m per group"
        )
        for col in ("rollouts", "d median", "d max", "m median", "m max", "o median", "o max", "caught"):
            table.add_column(col, justify="left" if col == "rollouts" else "right")
        for name, row in r["rows"].items():
            table.add_row(name, f"{row['d_median']:.5f}", f"{row['d_max']:.5f}", f"{row['m_median']:.5f}",
                          f"{row['m_max']:.5f}", f"{row['o_median']:.3f}", f"{row['o_max']:.3f}",
                          f"{row['caught']:.0%}")  # fmt: skip
        Console().print(table)
        for fmt, q in result["quantized"].items():
            types = ", ".join(f"{n} x {k}" for k, n in q["types"].items())
            Console().print(f"{fmt}: llama.cpp quantized the F16 GGUF in {q['quantize_s']:.2f} s to "
                            f"{q['bytes'] / 2**20:.0f} MiB ({types})")  # fmt: skip
        if len(r["batch_dependence"]) > 1:
            Console().print(
                "llama.cpp's logprobs of the same tokens, decode batches of 8 against up to 32 sequences: "
                + ", ".join(f"{fmt} {shift:.5f}" for fmt, shift in r["batch_dependence"].items())
                + " nats/token"
            )
        Console().print(
            f"verifying one group of {group_size} took {r['seconds_per_group_checked']:.3f} s "
            f"({r['tokens_per_group']:.0f} tokens); caught: d > {tolerance}, m > {draw_tolerance} "
            f"or o > {off_draw_tolerance}"
        )
        if r["seconds_per_group_wave_replayed"] is not None:
            Console().print(f"a wave replay by llama.cpp took {r['seconds_per_group_wave_replayed']:.3f} s per group")
    return result


def logprob_shift(a: list[list], b: list[list]) -> float:
    """Mean |log mu_a - log mu_b| over the tokens two generations of the same groups share (each completion's
    common prefix: the same draws give the same tokens until the logprobs move a token across a border)."""
    import numpy as np

    diffs: list[float] = []
    for group_a, group_b in zip(a, b, strict=True):
        for x, y in zip(group_a, group_b, strict=True):
            n = 0
            while n < min(len(x.tokens), len(y.tokens)) and x.tokens[n] == y.tokens[n]:
                n += 1
            diffs += list(np.abs(np.array(x.logprobs[:n]) - np.array(y.logprobs[:n])))
    return round(float(np.mean(diffs)), 5) if diffs else 0.0


def _verify_row(replays: list, tolerance: float, draw_tolerance: float, off_draw_tolerance: float) -> dict:
    """One row of the verify benchmark: d, m and o (learner.orchestrate.verify.Replay) over its groups."""
    import numpy as np

    def stat(name: str) -> tuple[float, float]:
        values = [getattr(r, name) for r in replays]
        return round(float(np.median(values)), 5), round(max(values), 5)

    (d_med, d_max), (m_med, m_max), (o_med, o_max) = stat("divergence"), stat("draw_miss"), stat("off_draw")
    caught = [
        r.divergence > tolerance or r.draw_miss > draw_tolerance or r.off_draw > off_draw_tolerance for r in replays
    ]
    return {
        "d_median": d_med, "d_max": d_max, "m_median": m_med, "m_max": m_max, "o_median": o_med, "o_max": o_max,
        "caught": sum(caught) / len(caught),
    }  # fmt: skip
