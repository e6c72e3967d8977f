"""Export a run's checkpoint in every format and compare each export's logits with the checkpoint's own.

    .venv/bin/python scripts/check_export.py runs/eval-smollm2 [--step N]

Loads the checkpoint as the learner holds it (float32, LoRA adapters on their base), writes `echo-rl
export`'s formats into a temporary folder (hf and gguf; a LoRA run also with --adapters), loads each with
the tool it is for (transformers, peft, llama.cpp) and prints one JSON object: per format the largest
|logit difference| over a prompt's positions and whether every position's argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--prompt", default="What is 17 + 25? End your answer with the number.")
    args = parser.parse_args()

    import llama_cpp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from echo_cli.research import checkpoint_config, export_checkpoint
    from learner.train.checkpoint import load_weights
    from learner.train.models import load_run_policy

    checkpoint, cfg = checkpoint_config(args.run_dir, args.step, {})
    policy = load_run_policy(cfg.model, cfg.run.seed)
    load_weights(checkpoint, policy.model)
    ids = policy.render_prompt(args.prompt)
    with torch.no_grad():
        reference = policy.model.eval()(torch.tensor([ids])).logits[0].numpy()  # [T, V]

    def compare(logits: np.ndarray) -> dict:
        return {
            "max_abs_diff": float(np.abs(logits - reference).max()),
            "argmax_agrees": bool(np.array_equal(logits.argmax(axis=1), reference.argmax(axis=1))),
        }

    results: dict = {"checkpoint": str(checkpoint), "tokens": len(ids), "lora_rank": cfg.model.lora_rank}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("hf", "gguf"):
            for adapters in (False, True) if cfg.model.lora_rank else (False,):
                out = Path(tmp) / f"{fmt}{'-adapters' if adapters else ''}"
                export_checkpoint(cfg, checkpoint, fmt, adapters, out)
                if fmt == "hf":
                    model = AutoModelForCausalLM.from_pretrained(out)
                    if adapters:
                        model = PeftModel.from_pretrained(model, out / "adapter")
                    with torch.no_grad():
                        logits = model.eval()(torch.tensor([ids])).logits[0].numpy()
                else:
                    lora = {"lora_path": str(out / "adapter.gguf")} if adapters else {}
                    llm = llama_cpp.Llama(str(out / "model.gguf"), n_ctx=512, logits_all=True, verbose=False, **lora)
                    llm.eval(ids)
                    logits = np.array(llm.scores[: len(ids)])
                    del llm
                results[out.name] = compare(logits)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
