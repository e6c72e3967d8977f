"""`echo-rl` as a user runs it: real subprocesses, tiny model, real llama.cpp."""

import dataclasses
import json

import pytest

from tests.conftest import run_cli, weights_moved


def start(run_dir, *args: str):
    """`echo-rl learner start --colocated --model tiny --run-dir RUN_DIR ARGS`."""
    return run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run_dir), *args)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_colocated_run_and_exact_resume(tmp_path):
    run = tmp_path / "R"
    res = start(run, "--task", "arithmetic", "--steps", "4")
    assert res.returncode == 0, res.stderr
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step-000004" / "model.safetensors").exists()
    first = metrics(run)

    res = start(run, "--task", "arithmetic", "--steps", "6", "--resume")
    assert res.returncode == 0, res.stderr
    m = metrics(run)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5, 6]
    assert m[:4] == first
    assert m[5]["wall_s"] > m[3]["wall_s"]  # wall time continues across the restart
    for key in ("reward_mean", "accuracy", "loss", "kl", "clip_frac", "tokens", "seconds"):
        assert key in m[-1]
    assert set(m[-1]["seconds"]) >= {"generate", "score", "train", "export"}


def test_resume_is_exact(tmp_path):
    """6 steps straight equal 3 steps + resume + 3 steps, on a task where the tiny model does learn."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 40}) + "\n" for i in range(5)))
    common = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii"]
    common += ["--checkpoint-every", "3", "--max-new-tokens", "24"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert start(straight, *common, "--steps", "6").returncode == 0
    assert start(split, *common, "--steps", "3").returncode == 0
    res = start(split, *common, "--steps", "6", "--resume")
    assert res.returncode == 0, res.stderr
    a, b = metrics(straight), metrics(split)
    assert sum(x["trained_tokens"] for x in a) > 0  # rewards differ within groups: it really trains
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"] and x["tokens"] == y["tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)


def test_dynamic_sampling_trains_on_groups_with_signal(tmp_path):
    """Equal-reward groups are replaced by new prompts until P groups carry signal (or the rounds run out);
    the reward counts every group generated, so the filter does not bias it."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 40}) + "\n" for i in range(5)))
    common = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii", "--max-new-tokens", "8"]
    common += ["--steps", "3", "--prompts-per-step", "3", "--group-size", "2"]  # half the pairs agree
    assert start(tmp_path / "dyn", *common, "--sampling-rounds", "3").returncode == 0
    assert start(tmp_path / "plain", *common, "--no-dynamic-sampling").returncode == 0
    dyn, plain = metrics(tmp_path / "dyn"), metrics(tmp_path / "plain")
    assert all(m["groups"] == 3 for m in plain)
    for m in dyn:
        with_signal = m["groups"] - m["equal_reward_groups"]
        assert m["groups"] in (3, 6, 9) and (with_signal >= 3 or m["groups"] == 9)
        assert m["trained_tokens"] > 0
    assert any(m["groups"] > 3 for m in dyn)


@pytest.mark.parametrize("task", ["countdown", "sokoban", "knights-knaves"])
def test_every_task_runs_and_the_weights_move_exactly_when_there_is_signal(tmp_path, task):
    """A random tiny model rarely solves these tasks, so a group mostly has equal rewards (no signal, no
    update); what must hold is that each step is scored by the task's reward and trained iff it has signal."""
    res = start(tmp_path / task, "--task", task, "--steps", "2", "--prompts-per-step", "2", "--group-size", "4")
    assert res.returncode == 0, res.stderr
    ms = metrics(tmp_path / task)
    assert len(ms) == 2
    for m in ms:
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["groups"] >= 2 and m["tokens"] > 0
        assert (m["trained_tokens"] > 0) == (m["groups"] > m["equal_reward_groups"])
    assert weights_moved(tmp_path / task) == any(m["trained_tokens"] > 0 for m in ms)


@pytest.mark.parametrize(
    "options",
    [
        ["--objective", "cispo", "--correction", "icepop", "--loss-norm", "constant", "--no-advantage-std"],
        ["--objective", "gspo", "--correction", "seq_mask", "--loss-norm", "sequence", "--minibatches", "2"],
    ],
)
def test_objectives_and_corrections_train_a_run(tmp_path, options):
    """The objectives other than the default and their corrections, through `learner start` as a user names
    them: every step is finite, the weights move."""
    res = start(tmp_path / "R", "--task", "arithmetic", "--steps", "2", *options)
    assert res.returncode == 0, res.stderr
    ms = metrics(tmp_path / "R")
    assert len(ms) == 2 and all(m["skipped_updates"] == 0 and 0.0 <= m["dropped_frac"] <= 1.0 for m in ms)
    assert json.loads((tmp_path / "R" / "config.json").read_text())["grpo"]["objective"] == options[1]
    assert weights_moved(tmp_path / "R")


def test_a_reasoning_gym_task_trains_colocated(tmp_path):
    res = start(tmp_path / "R", "--task", "reasoning-gym:basic_arithmetic", "--task-args", "min_terms=2",
                "--steps", "2", "--max-new-tokens", "8")  # fmt: skip
    assert res.returncode == 0, res.stderr
    ms = metrics(tmp_path / "R")
    assert len(ms) == 2 and all(0.0 <= m["reward_mean"] <= 1.0 and m["tokens"] > 0 for m in ms)
    res = start(tmp_path / "bad", "--task", "reasoning-gym:basic_arithmetic", "--task-args", "min_terms=0")
    assert res.returncode != 0 and "min_terms must be positive" in res.stderr and "Traceback" not in res.stderr


def test_transformers_engine_runs(tmp_path):
    args = ["--engine", "transformers", "--steps", "1", "--prompts-per-step", "1", "--group-size", "2"]
    res = start(tmp_path / "hf", *args, "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-size", "1"], "grpo.group_size: must be >= 2"),
        (["--lr", "fast"], "grpo.lr"),
        (["--model", "/no/such/model"], "neither a known name"),
        (["--task", "chess"], "unknown task 'chess'"),
        (["--config", "/no/such.toml"], "does not exist"),
        (["--resume"], "no checkpoint"),
    ],
)
def test_bad_input_gives_one_line_error(tmp_path, args, message):
    res = start(tmp_path / "r", "--steps", "1", *args)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_existing_run_is_not_overwritten(tmp_path):
    run = tmp_path / "R"
    assert start(run, "--steps", "1").returncode == 0
    before = (run / "metrics.jsonl").read_text()
    res = start(run, "--steps", "1")
    assert res.returncode == 2 and "already holds a run" in res.stderr
    assert (run / "metrics.jsonl").read_text() == before


def test_help_lists_only_working_commands():
    res = run_cli("--help")
    assert res.returncode == 0
    assert "learner" in res.stdout and "bench" in res.stdout
    res = run_cli("learner", "start", "--help")
    for flag in ("--colocated", "--resume", "--config", "--group-size", "--lr", "--task-args", "--engine"):
        assert flag in res.stdout


def test_a_checkpoint_that_cannot_be_written_stops_with_one_line(tmp_path):
    run = tmp_path / "R"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")  # as good as a full disk for the learner
    res = start(run, "--steps", "2", "--checkpoint-every", "1")
    lines = [ln for ln in res.stderr.strip().splitlines() if "error:" in ln]
    assert res.returncode == 2 and len(lines) == 1 and "could not write checkpoint" in lines[0], res.stderr
    assert "--resume" in lines[0] and len(metrics(run)) == 1  # the step's metrics were kept


def test_help_shows_tables_types_and_defaults():
    """`learner start --help` and `worker join --help` show every config table as a section, each option's
    type and its default (`\\[run]`, written for rich's markup, reads `[run]`), and `echo-rl --help` lists
    the commands in the order a user meets them."""
    from echo_cli.config import sections
    from learner.config import LearnerConfig
    from worker.config import WorkerRootConfig

    for command, root in ((["learner", "start"], LearnerConfig), (["worker", "join"], WorkerRootConfig)):
        res = run_cli(*command, "--help", columns=200)
        assert res.returncode == 0, res.stderr
        for table, cls in sections(root).items():
            assert f"[{table}] table" in res.stdout, table
            options = res.stdout[res.stdout.index("--config") : res.stdout.index("--help")]
            assert "[" + table + "]" in options, options
            defaults = cls()
            for field in dataclasses.fields(cls):
                if field.type in ("int", "float"):  # each one's line names its type and its default
                    flag = "--" + field.name.replace("_", "-")
                    line = next(ln for ln in res.stdout.splitlines() if f" {flag} " in ln)
                    assert field.type.upper().replace("INT", "INTEGER") in line, line
                    tail = res.stdout[res.stdout.index(f" {flag} ") :]
                    assert f"[default: {getattr(defaults, field.name)}]" in " ".join(tail.split())[:400], flag
    top = run_cli("--help", columns=200).stdout
    order = [
        top.index(f"│ {name} ")
        for name in ("learner", "worker", "status", "report", "eval", "export", "plan", "simulate", "bench", "secret")
    ]
    assert order == sorted(order), top


def test_every_help_reads_whole_at_80_columns():
    """No option name cut ("--grad-checkpointi…", #34), no line wider than the terminal and no argument
    shown as `{target}`, for every command and group (echo_cli.help)."""
    import click
    import typer

    from echo_cli.app import app

    def commands(command, path):
        yield path
        for name, sub in getattr(command, "commands", {}).items():
            yield from commands(sub, [*path, name])

    for path in commands(typer.main.get_command(app), []):
        res = run_cli(*path, "--help", columns=80)
        assert res.returncode == 0, (path, res.stderr)
        lines = res.stdout.splitlines()
        assert "…" not in res.stdout and max(map(len, lines)) <= 80, (path, res.stdout)
        assert "{" not in lines[0], (path, lines[0])  # arguments read as users type them: TARGET, not {target}
        command = typer.main.get_command(app)
        for name in path:
            command = command.commands[name]
        if not isinstance(command, click.Group) and not hasattr(command, "commands"):
            for param in command.params:  # every option's every name is there whole
                for flag in [*param.opts, *param.secondary_opts]:  # (an argument's name: upper case)
                    assert (flag if flag.startswith("-") else flag.upper()) in res.stdout, (path, flag)
