"""The research loop as a user runs it: held-out evaluation in a run and on its checkpoints, and exports that
transformers, peft and llama.cpp load with the checkpoint's logits."""

import json

import numpy as np
import pytest
import torch

from tests.conftest import run_cli

EVAL_KEYS = ("task", "prompts", "k", "accuracy", "pass_at_k", "reward_mean", "greedy_reward_mean")


def write_jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": 0}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 4-step co-located LoRA run of the tiny model on a task it learns, evaluated every 2 steps on prompts
    it never trains on, with a reward that any change of a completion's text changes (tests.rewards)."""
    root = tmp_path_factory.mktemp("lora")
    train = write_jsonl(root / "train.jsonl", [f"Say {i}." for i in range(5)])
    held_out = write_jsonl(root / "eval.jsonl", [f"Tell me about {w}." for w in "abcdefgh"])
    run_dir = root / "R"
    res = run_cli(
        "learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run_dir), "--lora-rank", "4",
        "--lr", "1e-2", "--task", f"jsonl:{train}", "--task-args", "reward=tests.rewards:starts_ascii",
        "--eval-every", "2", "--eval-task", f"jsonl:{held_out}", "--eval-task-args", "reward=tests.rewards:text_hash",
        "--eval-prompts", "8", "--eval-samples", "4", "--steps", "4", "--checkpoint-every", "2",
        "--keep-checkpoints", "3", "--max-new-tokens", "12",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return run_dir


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_policy(run_dir, step):
    """The policy of a run's checkpoint, as the learner held it (LoRA adapters on their base)."""
    from echo_cli.research import checkpoint_config
    from learner.train.checkpoint import load_weights
    from learner.train.models import load_run_policy

    checkpoint, cfg = checkpoint_config(run_dir, step, {})
    policy = load_run_policy(cfg.model, cfg.run.seed)
    load_weights(checkpoint, policy.model)
    return policy.model.eval(), policy.render_prompt("What is 12 + 7? Think, then answer.")


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()  # [T, V]


def test_evaluation_in_the_run_matches_echo_rl_eval_on_its_checkpoints(lora_run):
    rows = metrics(lora_run)
    assert [r["step"] for r in rows if "eval" in r] == [2, 4]
    assert "eval_initial" in rows[0] and all("eval_initial" not in r for r in rows[1:])
    for row in rows[1::2]:
        res = run_cli("eval", str(lora_run), "--step", str(row["step"]), "--json")
        assert res.returncode == 0, res.stderr
        standalone = json.loads(res.stdout)
        assert {k: standalone[k] for k in EVAL_KEYS} == {k: row["eval"][k] for k in EVAL_KEYS}
    assert rows[-1]["eval"]["prompts"] == 8 and rows[-1]["eval"]["k"] == 4
    evals = [rows[0]["eval_initial"], rows[1]["eval"], rows[3]["eval"]]
    assert len({e["reward_mean"] for e in evals}) == 3  # each evaluation saw the policy of its step


@pytest.mark.parametrize("adapters", [False, True])
def test_exported_hf_folder_loads_with_the_checkpoints_logits(lora_run, tmp_path, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    res = run_cli("export", str(lora_run), "--format", "hf", "--out", str(out), *(["--adapters"] * adapters))
    assert res.returncode == 0, res.stderr
    model, ids = checkpoint_policy(lora_run, None)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    if adapters:
        loaded = PeftModel.from_pretrained(loaded, out / "adapter")
    assert np.abs(logits_of(loaded.eval(), ids) - logits_of(model, ids)).max() < 1e-5


@pytest.mark.parametrize("adapters", [False, True])
def test_exported_gguf_loads_in_llamacpp_with_the_checkpoints_logits(lora_run, tmp_path, adapters):
    import llama_cpp

    out = tmp_path / "gguf"
    res = run_cli("export", str(lora_run), "--format", "gguf", "--out", str(out), *(["--adapters"] * adapters))
    assert res.returncode == 0, res.stderr
    model, ids = checkpoint_policy(lora_run, None)
    lora = {"lora_path": str(out / "adapter.gguf")} if adapters else {}
    llm = llama_cpp.Llama(str(out / "model.gguf"), n_ctx=256, logits_all=True, verbose=False, **lora)
    llm.eval(ids)
    ours = np.array(llm.scores[: len(ids)])  # [T, V]
    ref = logits_of(model, ids)
    assert np.abs(ours - ref).max() < 1e-2  # F16 weights against float32
    assert np.array_equal(ours.argmax(axis=1), ref.argmax(axis=1))


def test_full_weight_run_exports_and_refuses_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "R"
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run_dir), "--steps", "1")
    assert res.returncode == 0, res.stderr
    res = run_cli("export", str(run_dir), "--format", "hf", "--adapters")
    assert res.returncode == 2 and "trained all weights" in res.stderr
    res = run_cli("export", str(run_dir / "checkpoints" / "step-000001"), "--format", "hf", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)["out"]
    assert out == str(run_dir / "export" / "step-000001-hf")
    model, ids = checkpoint_policy(run_dir, 1)
    assert np.abs(logits_of(AutoModelForCausalLM.from_pretrained(out).eval(), ids) - logits_of(model, ids)).max() < 1e-5
    res = run_cli("export", str(run_dir), "--format", "hf")
    assert res.returncode == 2 and "already exists" in res.stderr  # an export is never overwritten


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "jsonl:tests/data/none.jsonl", "--eval-every", "1"], "does not exist"),
        (["--eval-every", "-1"], "eval.eval_every"),
        (["--eval-task-args", "max_value=5"], "needs --eval-task"),
        (["--eval-every", "1", "--eval-task", "chess"], "unknown task 'chess'"),
        (["--eval-every", "3", "--publish-every", "2", "--staleness", "2", "--swarm"], "multiple of --publish-every"),
    ],
)
def test_bad_evaluation_settings_are_one_line_errors(tmp_path, args, message):
    colocated = ["--colocated"] if "--swarm" not in args else []
    args = [a for a in args if a != "--swarm"]
    res = run_cli("learner", "start", *colocated, "--model", "tiny", "--run-dir", str(tmp_path / "R"), *args)
    assert res.returncode == 2 and message in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1


def test_a_jsonl_task_has_no_held_out_split_to_evaluate_on(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", ["Say 1."])
    args = ["--task", f"jsonl:{data}", "--eval-every", "1", "--run-dir", str(tmp_path / "R")]
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", *args)
    assert res.returncode == 2 and "pass --eval-task jsonl:EVAL_PATH" in res.stderr


def test_eval_names_a_missing_checkpoint(tmp_path):
    res = run_cli("eval", str(tmp_path))
    assert res.returncode == 2 and "holds no checkpoint" in res.stderr


def test_a_swarm_evaluates_on_workers_as_echo_rl_eval_does(swarm, tmp_path):
    """--eval-every in a swarm: the held-out set goes to both workers as one lease each (every group verified), the
    initial, every 2nd and the last version are evaluated, and the figures of the last one equal
    `echo-rl eval` on its checkpoint: the same prompts and draws, sampled by llama.cpp from the same weights."""
    train = write_jsonl(tmp_path / "train.jsonl", [f"Say {i}." for i in range(5)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [f"Tell me about {w}." for w in "abcdefgh"])
    learner = swarm.learner(
        "--steps", "4", "--task", f"jsonl:{train}", "--task-args", "reward=tests.rewards:starts_ascii",
        "--eval-every", "2", "--eval-task", f"jsonl:{held_out}", "--eval-task-args", "reward=tests.rewards:text_hash",
        "--eval-prompts", "8", "--eval-samples", "3", "--verify-first", "1000",  # every training group verified too
    )  # fmt: skip
    swarm.worker("w1")
    swarm.worker("w2")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    rows = swarm.metrics()
    initial = [r["eval_initial"] for r in rows if "eval_initial" in r]
    evals = [e["version"] for r in rows for e in [*r.get("eval_earlier", []), *([r["eval"]] if "eval" in r else [])]]
    assert [e["version"] for e in initial] == [0] and len(evals) == 2 and 2 <= evals[0] <= 3, (initial, evals)
    assert evals[-1] == 4 and rows[-1]["eval"]["version"] == 4  # the run's end waited for its last evaluation
    res = run_cli("eval", str(swarm.run_dir), "--step", "4", "--json")
    assert res.returncode == 0, res.stderr
    standalone = json.loads(res.stdout)
    assert {k: standalone[k] for k in EVAL_KEYS} == {k: rows[-1]["eval"][k] for k in EVAL_KEYS}
    assert rows[-1]["groups_dropped_flagged"] == 0 and "flagged" not in swarm.log("learner")
    verdicts = [v for r in rows for e in [r.get("eval"), r.get("eval_initial")] if e for v in e["verification"]]
    assert verdicts and all(v["checked"] == v["groups"] == 16 for v in verdicts)  # every group of every answer
    assert len(rows[-1]["eval"]["verification"]) == 2  # both workers reach the last version: both answer
    from echo_cli.status import evaluation_line

    done = {"pending": [], "leased": None, "issued": 3, "expired": 0, "last": rows[-1]["eval"]}
    assert evaluation_line(done).startswith("v4: acc ") and "pass@3" in evaluation_line(done)


def test_the_verifier_flags_a_greedy_completion_that_is_not_greedy(tiny):
    """Greedy completions have no draws to replay: each token must be the most likely one under the version."""
    from learner.orchestrate.rollouts import Rollout
    from learner.orchestrate.verify import RolloutVerifier
    from learner.train.wire_weights import wire_tensors

    model = tiny.model.eval()
    verifier = RolloutVerifier(lambda: type(model)(model.config), 1.0, 1.0, first=1, fraction=1.0,
                               tolerance=0.02, draw_tolerance=0.02)  # fmt: skip
    verifier.remember(0, wire_tensors(model), None)
    prompt, tokens = tiny.render_prompt("Say 1."), []
    with torch.no_grad():
        for _ in range(6):  # greedy decoding in float32
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    honest = [Rollout(prompt, tokens, [0.0] * 6, 0.0, 0.0, 0)]
    assert verifier.check_greedy("honest", 0, honest) < 1e-6 and "honest" not in verifier.flagged
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:3]])).logits[0, -1]
    forged = tokens[:3] + [int(logits.argmin())] + tokens[4:]  # the least likely token in place of the 4th
    assert verifier.check_greedy("forger", 0, [Rollout(prompt, forged, [0.0] * 6, 0.0, 0.0, 0)]) > 0.25
    assert "not the most likely" in verifier.flagged["forger"]
