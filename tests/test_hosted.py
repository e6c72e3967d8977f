"""Hosted environments (--env-host learner): the learner steps the environment, workers ask it for every
observation, so an environment that is not reproducible trains, and a worker that alters what it was told is
still caught (learner.orchestrate.hosting, envs.episode.HostedEpisode)."""

import dataclasses
import json

import pytest

from envs import EnvSpec, make_env
from envs.episode import EpisodeRules, ReplayError, generate_rollouts, replay_episode
from learner.orchestrate.hosting import EpisodeHost
from learner.rollout_source import RolloutSource
from learner.tasks.environment import EnvironmentTask
from learner.train.models import chat_format
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import (
    EnvStepReply,
    EnvStepRequest,
    EpisodeTurn,
    GenerationRequest,
    GroupSubmission,
    MessageError,
    RolloutSubmission,
    SamplingParams,
)
from tests.conftest import run_cli
from tests.test_envs import scripted

NOISY = "tests.bad_envs:Noisy"


def hosted_rules(tiny, name=NOISY, **budgets):
    spec = EnvSpec(name, {}, **{"max_turns": 4, "max_tokens": 400, "turn_tokens": 32, **budgets}, hosted=True)
    learner = EpisodeRules(spec, make_env(name), chat_format(tiny))
    worker = EpisodeRules.of(EnvSpec.from_wire(spec.to_wire()), learner.chat)
    return learner, worker


def host_for(learner_rules, requests, worker="w1", lease=7, others=None):
    leases = {lease: (worker, list(requests)), **(others or {})}  # the live leases: id -> (worker, requests)
    return EpisodeHost(learner_rules, 1 << 20, leases.get)


def play_through(host, worker_rules, requests, turns, worker="w1", lease=7):
    def remote(batch):
        return EnvStepReply.from_wire(host.step(worker, EnvStepRequest(lease, batch).to_wire()), len(batch)).steps

    return generate_rollouts(scripted(worker_rules.chat, turns), requests, SamplingParams(max_new_tokens=32),
                             worker_rules, remote)  # fmt: skip


def test_a_worker_plays_a_hosted_episode_without_the_environment(tiny):
    learner, worker = hosted_rules(tiny)
    assert worker.make_env is None  # nothing of it runs on the worker: not even its module is imported
    requests = [GenerationRequest(tiny.render_prompt("Say a number."), 2, 0, episode=5)]
    host = host_for(learner, requests)
    [group] = play_through(host, worker, requests, ["1", "two", "3"])
    for episode in group:
        assert len(episode.spans) == 5 and episode.finish_reason == "stop" and episode.reward == 2.0
        assert "nonce" in worker.chat.tokenizer.decode(episode.tokens)
    assert group[0].tokens != group[1].tokens  # the observations differ: nothing here is reproducible
    with pytest.raises(ReplayError):  # so replaying it, as a worker-stepped environment is checked, fails
        replay_episode(group[0], 5, dataclasses.replace(learner, spec=dataclasses.replace(learner.spec, hosted=False)))
    source = RolloutSource(EnvironmentTask(learner), tiny)
    host.check(7, RolloutSubmission(7, 0, [GroupSubmission(0, group)]))  # the episodes the learner hosted
    assert source.returns(None, group).values == [2.0, 2.0]


@pytest.mark.parametrize("forge", ["observation", "reward", "turns", "unplayed"])
def test_a_worker_that_alters_a_hosted_episode_is_caught(tiny, forge):
    learner, worker = hosted_rules(tiny)
    requests = [GenerationRequest(tiny.render_prompt("Say a number."), 2, 0, episode=5)]
    host = host_for(learner, requests)
    [group] = play_through(host, worker, requests, ["1", "2", "3"])
    first = group[0]
    if forge == "observation":
        tokens = list(first.tokens)
        tokens[first.spans[0] + 3] = (tokens[first.spans[0] + 3] + 1) % 200
        group[0] = dataclasses.replace(first, tokens=tokens)
    elif forge == "reward":
        group[0] = dataclasses.replace(first, reward=first.reward + 1)
    elif forge == "turns":
        group[0] = dataclasses.replace(first, spans=first.spans[:-2], tokens=first.tokens[: -first.spans[-1] - 1])
    if forge == "unplayed":  # a lease the learner never hosted (or no longer does): refused, not a forgery
        with pytest.raises(BadRequest, match="not hosted here"):
            host.check(8, RolloutSubmission(8, 0, [GroupSubmission(0, group)]))
        return
    with pytest.raises(ReplayError, match="the learner hosted"):
        host.check(7, RolloutSubmission(7, 0, [GroupSubmission(0, group)]))


def test_the_host_steps_only_its_workers_episodes_in_order(tiny):
    learner, _ = hosted_rules(tiny)
    requests = [GenerationRequest(tiny.render_prompt("Say a number."), 2, 0, episode=5)]
    host = host_for(learner, requests)
    stop = learner.chat.stop_ids[0]
    turn = learner.chat.tokenizer.encode("1", add_special_tokens=False).ids + [stop]

    def step(*turns, worker="w1", lease=7):
        return host.step(worker, EnvStepRequest(lease, [EpisodeTurn(*t) for t in turns]).to_wire())

    first = step((0, 0, 0, turn))
    assert step((0, 0, 0, turn)) == first  # the same turn again (a lost reply): the same answer
    with pytest.raises(Misbehaviour, match="another worker's"):
        step((0, 0, 1, turn), worker="w2")
    with pytest.raises(BadRequest, match="not a live lease of yours"):
        step((0, 0, 1, turn), lease=8)
    with pytest.raises(BadRequest, match="two turns in one request"):
        step((0, 1, 0, turn), (0, 1, 0, turn))
    host._leases[7].lock.acquire()  # a step of this lease under way: the next is refused, not queued
    with pytest.raises(BadRequest, match="under way"):
        step((0, 1, 0, turn))
    host._leases[7].lock.release()
    for t, why in [
        ((0, 0, 0, [stop]), "not episode 0's next"),  # turn 0 again, but another one
        ((0, 0, 2, turn), "not episode 0's next"),  # skipping a turn
        ((0, 2, 0, turn), "not in lease 7"),  # a completion the group does not have
        ((1, 0, 0, turn), "not in lease 7"),
        ((0, 1, 0, turn * 2), "past a stop token"),
        ((0, 1, 0, turn[:-1]), "without a stop token"),
        ((0, 1, 0, [1 << 21]), "below the vocabulary"),
    ]:
        with pytest.raises(BadRequest, match=why):
            step(t)
    for turns in ([[0, 0, 0, "tokens"]], [[0, 0, 0, turn * 40]], [], [[0, 0, 0]]):  # past the turn's budget too
        with pytest.raises(MessageError):
            host.step("w1", {"lease": 7, "turns": turns})
    assert step((0, 0, 1, turn))["steps"][0][1] is False  # the episode goes on


def test_a_workers_new_lease_closes_its_last_and_a_broken_environment_ends_its_episode(tiny):
    learner, worker = hosted_rules(tiny)
    requests = [GenerationRequest(tiny.render_prompt("Say a number."), 1, 0, episode=5)]
    host = host_for(learner, requests, others={9: ("w1", requests)})
    play_through(host, worker, requests, ["1", "2", "3"], lease=7)
    play_through(host, worker, requests, ["1", "2", "3"], lease=9)  # a worker holds one live lease: 7 is over
    with pytest.raises(BadRequest, match="not hosted here"):
        host.check(7, RolloutSubmission(7, 0, []))
    broken = dataclasses.replace(learner, make_env=lambda: 1 / 0)
    [[episode]] = play_through(host_for(broken, requests), worker, requests, ["1", "2"])
    assert episode.finish_reason == "error" and len(episode.spans) == 1


def test_a_hosted_environment_trains_through_a_worker_and_a_forger_is_flagged(swarm, tmp_path):
    learner = swarm.learner("--env", NOISY, "--env-host", "learner", "--steps", "2", "--max-episode-tokens", "200",
                            "--verify-first", "0", "--verify-fraction", "0")  # fmt: skip
    swarm.forger("observation")
    honest = swarm.worker("honest")  # no --allow-env: a hosted environment's code runs on the learner only
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    honest.terminate()
    text = " ".join(swarm.log("learner").split())
    assert "flagged: an episode does not replay: the episode's tokens are not those of the episode the learner" in text
    rows = swarm.metrics()
    assert [m["step"] for m in rows] == [1, 2] and all(m["turns_per_episode"] >= 1 for m in rows)
    assert any(r["groups_accepted"] for r in rows[-1]["workers"].values())  # the honest worker's


def test_a_swarm_evaluates_a_hosted_environment_on_a_worker(swarm):
    learner = swarm.learner("--env", NOISY, "--env-host", "learner", "--steps", "2", "--max-episode-tokens", "200",
                            "--eval-every", "2", "--eval-prompts", "3", "--eval-samples", "2",
                            "--verify-first", "1000")  # fmt: skip
    worker = swarm.worker("w1")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    worker.terminate()
    rows = swarm.metrics()
    assert rows[-1]["eval"]["version"] == 2 and rows[-1]["eval"]["turns_mean"] == 3
    assert rows[-1]["groups_dropped_flagged"] == 0 and "flagged" not in swarm.log("learner")


def test_hosting_is_refused_where_it_cannot_work(tmp_path):
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--env-host", "learner", "--run-dir",
                  str(tmp_path / "S"))  # fmt: skip
    assert res.returncode == 2 and "env.env_host: needs --env" in res.stderr


def test_a_hosted_environment_trains_colocated(tmp_path):
    run = tmp_path / "R"
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--env", NOISY, "--env-host", "learner",
                  "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                  "--eval-every", "2", "--run-dir", str(run))  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2] and rows[-1]["eval"]["turns_mean"] == 3


def test_a_hosted_verifiers_tool_environment_trains_through_a_worker_that_lacks_it(swarm):
    """A verifiers taskset hosted by the learner (for one whose rubric asks a judge or the network): the
    learner's step threads drive each episode's rollout; the worker has no --allow-env and runs none of it."""
    learner = swarm.learner("--env", "verifiers:tests.vf_tools", "--env-host", "learner", "--steps", "2",
                            "--max-turns", "3", "--max-episode-tokens", "200", "--verify-first", "1000")  # fmt: skip
    worker = swarm.worker("w1")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    worker.terminate()
    rows = swarm.metrics()
    assert [m["step"] for m in rows] == [1, 2] and all(m["turns_per_episode"] >= 1 for m in rows)
    assert rows[-1]["groups_dropped_flagged"] == 0 and rows[-1]["failed_episodes"] == 0
