"""`import echo_rl`: the worked example of docs/api.md runs as written, and the primitives do what a step does."""

import json
import re
import subprocess
import sys

import torch

from tests.conftest import ROOT


def test_the_docs_example_runs(tmp_path):
    """The Python blocks of docs/api.md, in order, as one script in an empty folder."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), flags=re.S)
    assert len(blocks) >= 3
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    res = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert [int(s) for s in re.findall(r"^step (\d+): reward", out, flags=re.M)] == [1, 2, 3, 4]
    records = [json.loads(ln) for ln in (tmp_path / "runs/api-train/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval" in r] == [2, 4] and records[0]["eval_initial"]["prompts"] == 16
    assert len(re.findall(r"^step \d+: loss", out, flags=re.M)) == 3 and "greedy: " in out
    assert (tmp_path / "runs/api-primitives/checkpoints/step-000003/model.safetensors").exists()
    assert [int(s) for s in re.findall(r"^swarm step (\d+):", out, flags=re.M)] == [1, 2, 3]


def test_forward_backward_and_optim_step_are_one_training_step(tiny):
    """Gradient accumulated by forward_backward and applied by optim_step: the same weights as trainer.step."""
    import copy

    from learner.config import GRPOConfig
    from learner.orchestrate.rollouts import Rollout
    from learner.train.trainer import GRPOTrainer

    rng = torch.Generator().manual_seed(0)
    rollouts = []
    for _ in range(4):
        prompt = torch.randint(0, 200, (6,), generator=rng).tolist()
        for k in range(4):
            tokens = torch.randint(0, 200, (5 + k,), generator=rng).tolist()
            rollouts.append(Rollout(prompt, tokens, [-5.0] * len(tokens), 0.0, advantage=(k - 1.5) / 1.1, version=0))
    cfg = GRPOConfig(lr=1e-3)
    a, b = copy.deepcopy(tiny.model), copy.deepcopy(tiny.model)
    stepped = GRPOTrainer(a, cfg, temperature=1.0).step(rollouts)
    trainer = GRPOTrainer(b, cfg, temperature=1.0)
    accumulated = trainer.forward_backward(rollouts)
    applied = trainer.optim_step()
    assert accumulated["loss"] == stepped["loss"] and applied["grad_norm"] == stepped["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert any(
        not torch.equal(x, y) for x, y in zip(a.state_dict().values(), tiny.model.state_dict().values(), strict=True)
    )
