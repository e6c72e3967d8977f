"""Multi-turn environments through the swarm: a real learner and workers play episodes, the learner replays
them, and a worker that alters an observation or a return is flagged like any other forger."""

import json

import pytest

from tests.conftest import EVERY_ENV, run_cli


@pytest.mark.parametrize("env", EVERY_ENV)
def test_every_environment_trains_through_a_worker(swarm, env):
    learner = swarm.learner("--env", env, "--steps", "2", "--max-episode-tokens", "200", "--verify-first", "100")
    worker = swarm.worker("w1", *(["--allow-env", env] if ":" in env else []))
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    worker.terminate()
    metrics = swarm.metrics()
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["turns_per_episode"] >= 1 and m["tokens_per_episode"] >= m["model_tokens_per_episode"] > 0
        assert m["groups_dropped_flagged"] == 0
    [row] = metrics[-1]["workers"].values()
    assert row["groups_accepted"] >= 4, row
    res = run_cli("report", str(swarm.run_dir), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["summary"]["turns_per_episode_last10"] >= 1
    assert (swarm.run_dir / "report" / "episodes.png").stat().st_size > 1000


def test_a_swarm_evaluates_an_environment_on_a_worker_as_echo_rl_eval_does(swarm):
    """--eval-every with --env in a swarm: a worker plays the held-out episodes (greedy ones at temperature 0),
    the learner replays and verifies them, and the figures equal `echo-rl eval` on the checkpoint."""
    env = "tests.bad_envs:Flaky"
    learner = swarm.learner(
        "--env", env, "--steps", "2", "--max-episode-tokens", "200", "--eval-every", "2", "--eval-prompts", "4",
        "--eval-samples", "2", "--verify-first", "1000",
    )  # fmt: skip
    worker = swarm.worker("w1", "--allow-env", env)
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    worker.terminate()
    rows = swarm.metrics()
    assert rows[0]["eval_initial"]["version"] == 0 and rows[-1]["eval"]["version"] == 2
    assert rows[-1]["groups_dropped_flagged"] == 0 and "flagged" not in swarm.log("learner")
    res = run_cli("eval", str(swarm.run_dir), "--json")
    assert res.returncode == 0, res.stderr
    keys = ["accuracy", "pass_at_k", "reward_mean", "greedy_reward_mean", "greedy_len_mean", "turns_mean"]
    assert {k: json.loads(res.stdout)[k] for k in keys} == {k: rows[-1]["eval"][k] for k in keys}


def test_a_worker_refuses_a_plugin_environment_it_was_not_allowed(swarm):
    learner = swarm.learner("--env", "examples.guess_env:GuessEnv", "--steps", "1")
    worker = swarm.worker("w1")
    assert worker.wait(120) == 2
    lines = [ln for ln in swarm.log("w1").splitlines() if "--allow-env" in ln]
    assert lines and "examples.guess_env:GuessEnv" in lines[-1], swarm.log("w1")[-2000:]
    assert learner.poll() is None
    res = run_cli("status", "--learner", swarm.addr, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["environment"]["name"] == "examples.guess_env:GuessEnv"
    res = run_cli("status", "--learner", swarm.addr, columns=200)
    assert "examples.guess_env:GuessEnv (no step yet)" in res.stdout


@pytest.mark.parametrize("forge", ["observation", "reward"])
def test_a_worker_that_alters_episodes_is_flagged(swarm, forge, tmp_path):
    learner = swarm.learner("--env", "sokoban", "--steps", "2", "--max-episode-tokens", "200", "--verify-first", "0",
                            "--verify-fraction", "0")  # fmt: skip
    swarm.forger(forge)
    honest = swarm.worker("honest")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    honest.terminate()
    text = " ".join(swarm.log("learner").split())
    assert "flagged: an episode does not replay" in text, text[-3000:]
    reason = "observation after turn 0" if forge == "observation" else "claims reward"
    assert reason in text
    assert any(r["groups_accepted"] for r in swarm.metrics()[-1]["workers"].values())  # the honest worker's
