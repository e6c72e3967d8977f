"""Bytes per policy version on the wire, side by side for every encoding, on the same real training run.

    .venv/bin/python scripts/bench_wire.py [--steps 8] [--lr 2e-5] [--json]

SmolLM2-135M trains `--steps` GRPO steps on arithmetic (rollouts sampled by llama.cpp, the demo's
learning rate). After every step each option publishes the new weights as the learner's Publisher does
(learner/orchestrate/publisher.py: carry, then an XOR-zstd delta against the option's previous
version): f16 and bf16, every change (topk 1) or only the largest share of each matrix's changes
(topk < 1, the rest carried forward). Reported per option: mean bytes of a delta version, as a share
of the bf16 checkpoint (2 bytes per parameter), and the lag the workers' weights have behind the
learner's after the last step, |W - W_pub| / |W - W_0| over the weight matrices with W and W_0 rounded
to the option's 16-bit format (0: none; 1: as far behind as the whole run moved).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import numpy as np
import torch
from grpo_steps import train  # scripts/grpo_steps.py

from learner.orchestrate.publisher import Publisher
from learner.train.models import load_policy, model_spec
from learner.train.wire_weights import send_to_sampler, wire_tensors
from p2p.weights import to_float32
from worker.engines.llamacpp import LlamaCppEngine


def matrices(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: to_float32(a) for n, a in tensors.items() if a.ndim >= 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5, help="lr of the steps (the demo's, full weights)")
    parser.add_argument("--topk", default="1,0.05,0.02,0.01,0.005", help="comma-separated topk shares")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    policy = load_policy(args.model, "~/.cache/echo-rl")
    engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-wire-"), threads=2, max_batch=32)
    send_to_sampler(engine, model_spec(policy), policy.model)
    options = [(dtype, float(k)) for dtype in ("f16", "bf16") for k in args.topk.split(",")]
    publishers = {o: Publisher(seeder=None, run_id="bench", full_every=10**6, dtype=o[0], topk=o[1]) for o in options}
    sizes: dict = {o: [] for o in options}
    start = {dtype: matrices(publishers[(dtype, 1.0)].snapshot(policy.model)) for dtype in ("f16", "bf16")}

    def publish(step: int) -> None:
        for option, publisher in publishers.items():
            pv = publisher.encode(step, publisher.carry(publisher.snapshot(policy.model)))
            if step > 0:
                sizes[option].append(pv.manifest.payload_size)
        print(
            f"step {step}: "
            + ", ".join(f"{o[0]} topk {o[1]:g} {sizes[o][-1] / 1e6:.2f} MB" for o in options if sizes[o]),
            flush=True,
        )

    publish(0)
    train(policy, engine, args.steps, args.lr, lora=False, on_step=publish)
    engine.close()
    checkpoint = sum(a.size * 2 for a in wire_tensors(policy.model).values())
    rows = []
    for option, publisher in publishers.items():  # lag in the wire format: 16-bit rounding is not lag
        now = matrices(publisher.snapshot(policy.model))
        moved = np.sqrt(sum(float(((now[n] - start[option[0]][n]) ** 2).sum()) for n in now))
        sent = matrices(publisher.sent) if publisher.sent else now
        lag = np.sqrt(sum(float(((now[n] - sent[n]) ** 2).sum()) for n in now))
        mean = statistics.mean(sizes[option])
        rows.append({
            "wire": option[0], "topk": option[1], "delta_mb_mean": round(mean / 1e6, 2),
            "of_bf16_checkpoint": round(mean / checkpoint, 4), "lag": round(lag / moved, 3) if moved else 0.0,
        })  # fmt: skip
    result = {"steps": args.steps, "lr": args.lr, "bf16_checkpoint_mb": round(checkpoint / 1e6, 1), "options": rows}
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
