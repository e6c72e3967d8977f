"""OpenEnv environments (`--env openenv:URL`, envs/openenv_env.py): a server the tests run on 127.0.0.1
(tests/openenv_server.py, a guessing game with a random nonce in every observation after the first) trains
co-located and through a worker, hosted by the learner, since nothing could replay it."""

import json
import random

import pytest

from envs import EnvError, Step, make_env
from tests.conftest import run_cli

# the test server's uvicorn runs websockets' legacy protocol (tests/openenv_server.py says why)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server_url():
    from tests.openenv_server import serve

    url, server = serve()
    yield url
    server.should_exit = True


def test_an_openenv_episode_is_a_session_of_its_server(server_url):
    factory = make_env(f"openenv:{server_url}")
    first, second = factory(), factory()  # two sessions at once: each has its own game
    try:
        assert first.reset(3) == "Guess my number from 1 to 4. Reply with one number."
        second.reset(3)
        secret = random.Random(3).randint(1, 4)  # the server's draw for seed 3
        wrong = first.step(str(secret % 4 + 1))
        assert wrong.observation.startswith(("higher", "lower")) and (wrong.reward, wrong.done) == (0.0, False)
        assert first.step(f"It is {secret}.") == Step("", 1.0, True)
        step = second.step("no idea")
        assert step.observation.startswith("no number") and step.reward == 0.0 and not step.done
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"observation_field": "text"}, "its observations have no field 'text' (they have: done, metadata, prompt"),
        ({"action_field": "text"}, "its actions have no field 'text' (they have: message, metadata); set --env-args"),
        ({"timeout_s": 0}, "timeout_s is a number of seconds in (0, 3600]"),
        ({"port": 1}, "has no argument 'port'; allowed: action_field"),
    ],
)
def test_an_openenv_server_that_does_not_fit_is_refused_in_one_line(server_url, args, problem):
    with pytest.raises(EnvError, match="^[^\n]*$") as err:
        make_env(f"openenv:{server_url}", args)
    assert problem in str(err.value)


def test_an_openenv_name_must_be_a_reachable_server():
    with pytest.raises(EnvError, match="name the server as openenv:http://HOST:PORT"):
        make_env("openenv:127.0.0.1:8000")
    with pytest.raises(EnvError, match=r"no OpenEnv schema at http://127.0.0.1:9/schema \(URLError"):
        make_env("openenv:http://127.0.0.1:9")


def test_an_openenv_environment_trains_colocated_only_hosted(server_url, tmp_path):
    args = ["learner", "start", "--colocated", "--model", "tiny", "--env", f"openenv:{server_url}", "--steps", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--max-turns", "3"]  # fmt: skip
    res = run_cli(*args, "--run-dir", str(tmp_path / "S"))
    assert res.returncode == 2 and "is not reproducible" in res.stderr and "--env-host learner" in res.stderr
    run = tmp_path / "R"
    res = run_cli(*args, "--env-host", "learner", "--eval-every", "2", "--eval-prompts", "2", "--run-dir", str(run))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2] and all(m["turns_per_episode"] >= 1 for m in rows)
    assert rows[-1]["eval"]["turns_mean"] >= 1 and rows[-1]["failed_episodes"] == 0


def test_an_openenv_environment_trains_through_a_worker(server_url, swarm):
    learner = swarm.learner("--env", f"openenv:{server_url}", "--env-host", "learner", "--steps", "2",
                            "--max-turns", "3", "--max-episode-tokens", "200", "--verify-first", "1000")  # fmt: skip
    worker = swarm.worker("w1")  # no --allow-env, no openenv on its side: the learner is the server's client
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    worker.terminate()
    rows = swarm.metrics()
    assert [m["step"] for m in rows] == [1, 2] and all(m["turns_per_episode"] >= 1 for m in rows)
    assert rows[-1]["groups_dropped_flagged"] == 0 and rows[-1]["failed_episodes"] == 0
    assert "flagged" not in swarm.log("learner")
