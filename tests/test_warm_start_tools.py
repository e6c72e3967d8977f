"""scripts/warm_start_tools.py: demonstrations played and replayed by the calculator's tool environment, then
cross-entropy on the model's turns only, saved as a folder `--model` loads."""

import json

import pytest
import torch

from envs.calculator import evaluate
from learner.config import LearnerConfig, ModelConfig
from learner.train.models import load_policy, load_run_policy
from scripts.warm_start_tools import demonstrations, main  # tests/__init__.py puts the repo root on sys.path


def test_demonstrations_call_the_tool_then_answer_with_its_result():
    cfg = LearnerConfig()
    cfg.model.model, cfg.env.env = "tiny", "calculator-tools"
    cfg.sampler.max_new_tokens = 128  # the tiny model's tokenizer spells the call out nearly letter by letter
    policy = load_run_policy(cfg.model, 0)
    shown = demonstrations(cfg, policy, 3, seed=1)  # each replayed with return 1 inside
    assert len(shown) == 3
    for episode in shown:
        call, result, answer = episode.spans  # the model's call, the tool's result, the model's answer
        turns = [episode.completion_ids[:call], episode.completion_ids[call + result :]]
        assert turns[0][-1] == turns[1][-1] == policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
        call_text, answer_text = (policy.tokenizer.decode(t[:-1]) for t in turns)
        expression = json.loads(call_text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert expression["name"] == "calculate"
        value = evaluate(expression["arguments"]["expression"])[0]
        assert answer_text == f"The answer is {value}."
        assert str(value) in policy.tokenizer.decode(episode.completion_ids[call : call + result])


def test_the_warm_start_lowers_the_loss_and_writes_a_folder_the_learner_loads(tmp_path, capsys):
    out = tmp_path / "warm"
    main(["--model", "tiny", "--out", str(out), "--episodes", "4", "--epochs", "4", "--batch", "4", "--lr", "3e-3",
          "--max-new-tokens", "128", "--max-episode-tokens", "512"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == 4 and summary["last_loss"] < summary["first_loss"]
    policy = load_policy(str(out), tmp_path / "cache")
    assert policy.tool_format == ("hermes", False)
    untrained = load_run_policy(ModelConfig(model="tiny"), 0).model.state_dict()
    moved = [name for name, w in policy.model.state_dict().items() if not torch.equal(w, untrained[name])]
    assert moved  # the folder holds the trained weights, not the random ones it started from
    with pytest.raises(SystemExit, match="exists"):  # nothing is overwritten
        main(["--model", "tiny", "--out", str(out)])
    with pytest.raises(SystemExit, match="at least 1"):
        main(["--model", "tiny", "--out", str(tmp_path / "other"), "--episodes", "0"])
    with pytest.raises(SystemExit, match="env-args"):
        main(["--model", "tiny", "--out", str(tmp_path / "other"), "--env-args", "digits"])
