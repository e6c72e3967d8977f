"""`echo-rl bench sampler`: our batched llama.cpp sampler against llama-cpp-python's own API.

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

    from learner.models import export_tensors, load_policy, model_spec
    from learner.tasks import make_task
    from p2p.messages import GenerationRequest, SamplingParams
    from worker.engines.llamacpp import LlamaCppEngine

    policy = load_policy(model, cache_dir)
    task = make_task("arithmetic")
    rng = random.Random(0)
    prompt_ids = [policy.render_prompt(task.sample(rng).prompt) for _ in range(prompts)]

    work = tempfile.mkdtemp(prefix="echo-bench-")
    ours = LlamaCppEngine(work, threads=threads, max_batch=max_batch)
    ours.load_policy(model_spec(policy), export_tensors(policy.model))
    gguf_path = f"{work}/policy.gguf"
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    requests = [GenerationRequest(p, group_size) for p in prompt_ids]
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
