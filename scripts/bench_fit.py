"""`echo-rl fit`'s learner estimate against the measured peak of real training steps.

    .venv/bin/python scripts/bench_fit.py [--tokens 1024] [--only smollm2,qwen3-0.6b] [--json]

Each case runs in its own process: a randomly initialised model of the case's config (float32, as the
learner trains), learner.train.trainer.GRPOTrainer with micro_batch_tokens = --tokens, and two steps on
synthetic sequences that fill every micro-batch (4 sequences of tokens / 4). The measured figure is the
peak resident set during the steps (learner.train.devices.peak_memory) less the process's resident set
before the model was built (Python, torch); the estimate is learner.train.fit's weights, gradients, AdamW,
activations and output layer for the same config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = {  # name: (config class, its arguments, learner flags)
    "smollm2": ("smollm2-135m", {}, {}),
    "smollm2-ckpt": ("smollm2-135m", {}, {"grad_checkpointing": True}),
    "smollm2-lora16": ("smollm2-135m", {}, {"lora_rank": 16}),
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                   num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   tie_word_embeddings=True), {}),
    "qwen3-moe-small": ("Qwen3MoeConfig", dict(vocab_size=32000, hidden_size=512, intermediate_size=1024,
                        moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=64, num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1), {}),
}  # fmt: skip


def config_of(name: str, kwargs: dict) -> object:
    import transformers

    if name == "smollm2-135m":
        from learner.train.models import load_model_config

        return load_model_config(name, "~/.cache/echo-rl")
    return getattr(transformers, name)(**kwargs)


def measure(case: str, tokens: int) -> dict:
    """One case, in this process: the estimate and the measured peak of two training steps (GiB)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from learner.config import GRPOConfig
    from learner.orchestrate.rollouts import Rollout
    from learner.train.devices import current_gib, enable_grad_checkpointing, peak_memory
    from learner.train.fit import RunShape, learner_memory, model_shape
    from learner.train.lora import add_lora
    from learner.train.trainer import GRPOTrainer

    name, kwargs, flags = CASES[case]
    config = config_of(name, kwargs)
    torch.manual_seed(0)
    baseline = current_gib()
    model = AutoModelForCausalLM.from_config(config).float()
    if flags.get("lora_rank"):
        add_lora(model, flags["lora_rank"], 32.0)
    if flags.get("grad_checkpointing"):
        enable_grad_checkpointing(model)
    trainer = GRPOTrainer(model, GRPOConfig(micro_batch_tokens=tokens, skip_equal_groups=False), temperature=1.0)
    rng = random.Random(0)
    length = tokens // 4
    vocab = config.vocab_size

    def sequence(k: int) -> Rollout:
        ids = [rng.randrange(vocab) for _ in range(length)]
        return Rollout(ids[:32], ids[32:], [-1.0] * (length - 32), 0.0, advantage=1.0 if k % 2 else -1.0)

    with peak_memory(torch.device("cpu")) as peak:
        for _ in range(2):
            trainer.step([sequence(k) for k in range(4)])
    shape = model_shape(config)
    run = RunShape(lora_rank=flags.get("lora_rank", 0), micro_batch_tokens=tokens,
                   grad_checkpointing=flags.get("grad_checkpointing", False), colocated=True)  # fmt: skip
    parts = learner_memory(shape, run)
    parts.pop("sampler")
    gib = {k: v / 2**30 for k, v in parts.items() if v}
    measured = peak["peak_gib"] - baseline
    estimate = sum(gib.values())
    return {"case": case, "tokens": tokens, "estimate_gib": estimate, "measured_gib": measured, "parts_gib": gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="micro_batch_tokens, filled by every micro-batch")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case, args.tokens)))
        return
    rows = []
    for case in args.only.split(","):
        out = subprocess.run([sys.executable, __file__, "--case", case, "--tokens", str(args.tokens)],
                             capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        if out.returncode != 0:
            sys.exit(f"{case} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not args.json:
            r = rows[-1]
            ratio = r["measured_gib"] / r["estimate_gib"]
            print(f"{case:18s} N={r['tokens']:5d}  estimate {r['estimate_gib']:6.2f} GiB  measured "
                  f"{r['measured_gib']:6.2f} GiB  ratio {ratio:.2f}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
