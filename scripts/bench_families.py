"""Honest sampler/learner agreement per model family: the verifier's measures on groups an engine sampled,
beside the thresholds that flag a worker.

    .venv/bin/python scripts/bench_families.py [--groups 8] [--group-size 8] [--tokens 32] [--json]

For each tiny random family model (tests/families.py) and each engine that runs it (transformers; llama.cpp
where its GGUF writer does), groups are sampled at T = 1 with top-p 1.0 and 0.9, then replayed by the
learner's verifier (learner.orchestrate.verify): d = mean |log mu_worker - log mu_learner| per token, m = the
largest distance of a token's draw from its inverse-CDF interval, o = the share of tokens whose draw misses.
The worst group of each is printed against swarm.verify_tolerance, verify_draw_tolerance, verify_off_draw.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learner.orchestrate.replay_torch import replay_sampling  # noqa: E402
from learner.orchestrate.rollouts import Rollout  # noqa: E402
from learner.orchestrate.verify import divergence, draw_miss, group_draws, off_draw  # noqa: E402
from learner.swarm_config import SwarmConfig  # noqa: E402
from learner.train.models import load_policy, model_spec  # noqa: E402
from learner.train.trainer import sampled_logprobs  # noqa: E402
from learner.train.wire_weights import send_to_sampler  # noqa: E402
from p2p.messages import GenerationRequest, SamplingParams  # noqa: E402
from tests.families import FAMILIES, save_family  # noqa: E402
from worker.engines import make_engine  # noqa: E402


def measure(policy, engine, groups: int, group_size: int, tokens: int, top_p: float) -> dict:
    """The worst d, m and o over `groups` groups the engine sampled, replayed against the policy."""
    prompts = [policy.render_prompt(f"Count from {i} to {i + 9}.") for i in range(groups)]
    params = SamplingParams(1.0, top_p, tokens, 1234)
    sampled = engine.generate([GenerationRequest(p, group_size, k) for k, p in enumerate(prompts)], params)
    worst = {"d": 0.0, "m": 0.0, "o": 0.0}
    with torch.no_grad():
        for k, (prompt, group) in enumerate(zip(prompts, sampled, strict=True)):
            rollouts = [Rollout(prompt, c.tokens, c.logprobs, 0.0) for c in group]
            recomputed, misses = replay_sampling(
                policy.model, rollouts, 1.0, top_p, group_draws(params.seed, k, rollouts)
            )
            d = divergence([lp for r in rollouts for lp in sampled_logprobs(r)], recomputed)
            worst = {"d": max(worst["d"], d), "m": max(worst["m"], draw_miss(misses)),
                     "o": max(worst["o"], off_draw(misses))}  # fmt: skip
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    limits = SwarmConfig()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            policy = load_policy(str(save_family(family, Path(tmp) / family)), tmp)
            spec = model_spec(policy)
            for name in ("transformers", "llamacpp"):
                engine = make_engine(name, Path(tmp) / f"{family}-{name}", 2, 64)
                if engine.unsupported(spec):
                    continue
                send_to_sampler(engine, spec, policy.model)
                for top_p in (1.0, 0.9):
                    worst = measure(policy, engine, args.groups, args.group_size, args.tokens, top_p)
                    rows.append({"family": family, "engine": name, "top_p": top_p, **worst})
                if hasattr(engine, "close"):
                    engine.close()
    if args.json:
        print(json.dumps({"thresholds": {"d": limits.verify_tolerance, "m": limits.verify_draw_tolerance,
                                         "o": limits.verify_off_draw}, "rows": rows}))  # fmt: skip
        return
    print(f"thresholds: d {limits.verify_tolerance}, m {limits.verify_draw_tolerance}, o {limits.verify_off_draw}")
    print(f"{'family':<10} {'engine':<13} {'top_p':>5} {'worst d':>10} {'worst m':>10} {'worst o':>8}")
    for r in rows:
        print(f"{r['family']:<10} {r['engine']:<13} {r['top_p']:>5} {r['d']:>10.2e} {r['m']:>10.2e} {r['o']:>8.3f}")


if __name__ == "__main__":
    main()
