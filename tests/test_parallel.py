"""Data-parallel training (FSDP2 over gloo, two CPU ranks) against one process on the same data."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from learner.train.models import tiny_policy

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def test_two_ranks_and_one_sharded_rank_train_like_one_process(tmp_path):
    """FSDP2 over two ranks, and over one (torchrun --nproc-per-node 1: sharded, in a process group)."""
    one = tmp_path / "one.pt"
    run([sys.executable, "tests/dp_steps.py", str(one)], tmp_path)
    a = torch.load(one)
    init = tiny_policy(0).model.state_dict()
    moved = max(float((t - init[name]).abs().max()) for name, t in a["state"].items())
    assert moved > 1e-3  # training moved the weights far beyond the tolerance below
    for ranks in (2, 1):
        out = tmp_path / f"ranks{ranks}.pt"
        run([*torchrun(ranks), "tests/dp_steps.py", str(out)], tmp_path)
        b = torch.load(out)
        assert set(a["state"]) == set(b["state"])
        for name, t in a["state"].items():
            assert torch.allclose(t, b["state"][name], atol=1e-5, rtol=1e-4), name
        for sa, sb in zip(a["stats"], b["stats"], strict=True):
            assert sa["trained_tokens"] == sb["trained_tokens"]
            for key in ("loss", "grad_norm", "clip_frac"):
                assert abs(sa[key] - sb[key]) < 1e-4 * max(1.0, abs(sa[key])), key


def test_two_ranks_train_in_bf16_mixed_precision(tmp_path):
    """FSDP2's MixedPrecisionPolicy: bf16 compute, float32 master weights that move as in float32."""
    fp32, bf16 = tmp_path / "fp32.pt", tmp_path / "bf16.pt"
    run([sys.executable, "tests/dp_steps.py", str(fp32)], tmp_path)
    run([*torchrun(2), "tests/dp_steps.py", str(bf16), "bf16"], tmp_path)
    a, b = torch.load(fp32), torch.load(bf16)
    init = tiny_policy(0).model.state_dict()
    assert all(t.dtype == torch.float32 for t in b["state"].values())
    for sa, sb in zip(a["stats"], b["stats"], strict=True):
        assert sb["skipped_updates"] == 0 and abs(sa["loss"] - sb["loss"]) < 0.05 * max(1.0, abs(sa["loss"]))
    # every weight the float32 run moved, the bf16 run moved the same way
    delta_a = torch.cat([(t - init[n]).flatten() for n, t in a["state"].items()])
    delta_b = torch.cat([(b["state"][n] - init[n]).flatten() for n in a["state"]])
    assert float(torch.nn.functional.cosine_similarity(delta_a, delta_b, dim=0)) > 0.9


def test_torchrun_learner_trains_with_remote_workers_and_resumes(swarm):
    """Two ranks under torchrun: rank 0 owns the swarm host and feeds both; checkpoints resume on one rank."""
    data = swarm.tmp / "short.jsonl"  # a reward the random tiny model earns half the time: it really trains
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 40}) + "\n" for i in range(5)))
    args = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii", "--checkpoint-every", "3"]
    learner = swarm.learner("--steps", "6", *args, ranks=2)
    swarm.worker("w1"), swarm.worker("w2")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 7))  # one line per step: rank 0 alone writes
    assert sum(m["trained_tokens"] for m in metrics) > 0
    assert (swarm.run_dir / "checkpoints" / "step-000006" / "model.safetensors").exists()
    assert re.search(r"now on v[1-9]", swarm.log("w1") + swarm.log("w2"))

    # the 2-rank checkpoint resumes in one process (optimizer state is keyed by parameter name);
    # the workers find the restarted learner by themselves
    learner = swarm.learner("--steps", "8", *args, "--resume")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    assert [m["step"] for m in swarm.metrics()] == list(range(1, 9))
    assert "resumed from" in swarm.log("learner")
