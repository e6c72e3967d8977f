"""Multi-turn environments: the built-in games and tool, plugins, playing and replaying episodes, and the
trainer's zero gradient on observation tokens."""

import dataclasses
import json
import random
import sys
from collections import deque

import pytest
import torch

from echo_cli.status import environment_line
from envs import EnvError, EnvSpec, Step, make_env
from envs.calculator import CalcError, CalculatorEnv, evaluate
from envs.episode import EpisodeRules, ReplayError, play_episodes, replay_episode
from envs.kuhn_poker import KuhnPokerEnv
from envs.sokoban import MOVES, SokobanEnv, move, parse
from envs.tools import ToolCall
from learner.config import GRPOConfig
from learner.evaluation import held_out_problems
from learner.orchestrate.journal import group_of, group_record
from learner.orchestrate.rollouts import Rollout, ScoredGroup, score_groups
from learner.orchestrate.verify import RolloutVerifier
from learner.run import episode_metrics
from learner.tasks import Problem
from learner.tasks.environment import EnvironmentTask
from learner.tasks.split import split_task
from learner.train.models import chat_format, model_spec, tiny_policy
from learner.train.trainer import GRPOTrainer, completion_logprobs
from learner.train.wire_weights import send_to_sampler, wire_tensors
from p2p.messages import (
    Completion,
    GenerationRequest,
    MessageError,
    RolloutSubmission,
    SamplingParams,
    sampled_positions,
)
from tests.bad_envs import Broken
from tests.conftest import EVERY_ENV, run_cli


def rules_for(policy, name, args=None, **budgets) -> EpisodeRules:
    spec = EnvSpec(name, args or {}, **{"max_turns": 4, "max_tokens": 400, "turn_tokens": 64, **budgets})
    return EpisodeRules(spec, make_env(name, args), chat_format(policy))


def scripted(chat, turns: list[str]):
    """An engine's generate() that writes `turns` in order, per episode, each ended with a stop token."""
    done: dict[tuple[int, int], int] = {}

    def generate(requests, params):
        out = []
        for r in requests:
            group = []
            for j in range(r.group_size):
                k = done.get((r.group, r.completion + j), 0)
                done[(r.group, r.completion + j)] = k + 1
                tokens = chat.tokenizer.encode(turns[k], add_special_tokens=False).ids + [chat.stop_ids[0]]
                tokens = tokens[: params.max_new_tokens]
                finish = "stop" if tokens[-1] in chat.stop_ids else "length"
                group.append(Completion(tokens, [-1.0] * len(tokens), finish))
            out.append(group)
        return out

    return generate


def test_calculator_evaluates_exactly_within_its_limits():
    assert evaluate("12 * 34 + 5")[0] == 413
    assert evaluate("-(7 - 10) ** 3 // 2")[0] == 13
    assert evaluate("1 / 3")[0] * 3 == 1
    for bad, why in [
        ("__import__('os').system('ls')", "not allowed"),
        ("open('/etc/passwd')", "not allowed"),
        ("x + 1", "not allowed"),
        ("2 ** 1000", "exponents"),
        ("99 ** 40", "digits"),
        ("9" * 61, "digits"),
        ("10 ** 30 * 10 ** 30 * 10", "digits"),
        ("1 / 0", "division by zero"),
        ("1 +" * 80 + "1", "characters"),
        ("[1, 2]", "not allowed"),
        ("2 ** (1/2)", "exponents"),
    ]:
        with pytest.raises(CalcError, match=why):
            evaluate(bad)
    with pytest.raises(CalcError):
        evaluate("-3 + 4", "+-*/")  # countdown's operators: no negation


def test_calculator_episode_calls_the_tool_then_answers(tiny):
    rules = rules_for(tiny, "calculator", {"digits": 2, "terms": 2})
    env = CalculatorEnv(digits=2, terms=2)
    prompt_text = env.reset(5)
    expr = prompt_text.split("What is ")[1].split("?")[0]
    value = int(evaluate(expr)[0])
    request = GenerationRequest(tiny.render_prompt(prompt_text), 1, 0, episode=5)
    turns = [f"Let me compute.\ncalc: {expr}", f"The answer is {value}."]
    [[episode]] = play_episodes(scripted(rules.chat, turns), [request], SamplingParams(max_new_tokens=24), rules)
    assert len(episode.spans) == 3 and episode.finish_reason == "stop" and episode.reward == 1.0
    observation = episode.tokens[episode.spans[0] : episode.spans[0] + episode.spans[1]]
    assert f"calc: {value}" in rules.chat.tokenizer.decode(observation, skip_special_tokens=False)
    assert replay_episode(episode, 5, rules).reward == 1.0
    [[wrong]] = play_episodes(
        scripted(rules.chat, [f"It is {value + 1}."]), [request], SamplingParams(max_new_tokens=24), rules
    )
    assert wrong.spans == [len(wrong.tokens)] and wrong.reward == 0.0


def solve(board: str) -> str:
    """The shortest solution of a small Sokoban board, by breadth-first search (for the test)."""
    walls, goals, boxes, player = parse(board)
    start = (frozenset(boxes), player)
    seen, queue = {start: ""}, deque([start])
    while queue:
        state = queue.popleft()
        if state[0] == goals:
            return seen[state]
        for d in MOVES:
            nxt = move(walls, state[0], state[1], d)
            if nxt not in seen:
                seen[nxt] = seen[state] + d
                queue.append(nxt)
    raise AssertionError("unsolvable board")


def test_sokoban_is_played_a_few_moves_per_turn(tiny):
    env = SokobanEnv(moves_per_turn=2)
    prompt = env.reset(11)
    solution = solve(prompt.split("\n\n", 1)[1])
    chunks = [solution[i : i + 2] for i in range(0, len(solution), 2)]
    rules = rules_for(tiny, "sokoban", {"moves_per_turn": 2}, max_turns=len(chunks) + 1, max_tokens=2000)
    request = GenerationRequest(tiny.render_prompt(prompt), 1, 0, episode=11)
    [[episode]] = play_episodes(scripted(rules.chat, chunks), [request], SamplingParams(), rules)
    assert (len(episode.spans) + 1) // 2 == len(chunks) and episode.reward == 1.0
    # every observation shows the board after the turn's moves
    first_obs = episode.tokens[episode.spans[0] : episode.spans[0] + episode.spans[1]]
    assert f"After {chunks[0]}:" in rules.chat.tokenizer.decode(first_obs)


def test_kuhn_poker_pays_by_the_rules():
    """Every deal and seat: a model that always calls or checks; the pot goes to the higher card."""
    for seed in range(60):
        env = KuhnPokerEnv()
        env.reset(seed)
        mine, theirs = env.cards
        step = env.step("I call." if env._legal()[0] == "call" else "check")
        for _ in range(3):
            if step.done:
                break
            step = env.step("call" if "call" in step.observation else "check")
        assert step.done and step.reward in (-2.0, -1.0, 1.0, 2.0)
        if env.history[-1] != "fold":  # a showdown
            assert (step.reward > 0) == ("JQK".index(mine) > "JQK".index(theirs))
    env = KuhnPokerEnv(seat="first", retries=0)
    env.reset(1)
    assert env.step("raise!").reward == -1.0  # no legal move: a fold


def tiny_engine(policy, tmp_path):
    from worker.engines.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(tmp_path / "engine", threads=2, max_batch=8)
    send_to_sampler(engine, model_spec(policy), policy.model)
    return engine


@pytest.fixture(scope="module")
def played(tiny, tmp_path_factory):
    """Sokoban episodes of the tiny random model through llama.cpp: it writes no moves, so every turn gets an
    observation and episodes run to max_turns (several turns each)."""
    rules = rules_for(tiny, "sokoban", max_turns=3, turn_tokens=12)
    engine = tiny_engine(tiny, tmp_path_factory.mktemp("played"))
    seeds = [101, 202]
    requests = [
        GenerationRequest(tiny.render_prompt(make_env("sokoban")().reset(s)), 3, k, episode=s)
        for k, s in enumerate(seeds)
    ]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=99)
    groups = play_episodes(engine.generate, requests, params, rules)
    engine.close()
    return rules, requests, params, groups


def test_replay_accepts_honest_episodes_and_catches_changes(played):
    rules, requests, _, groups = played
    for request, group in zip(requests, groups, strict=True):
        for episode in group:
            assert len(episode.spans) == 5 and episode.finish_reason == "length"  # 3 turns, 2 observations
            assert len(episode.logprobs) == len(episode.tokens)
            replayed = replay_episode(episode, request.episode, rules)
            assert replayed.turns == 3 and replayed.reward == episode.reward == 0.0
    episode, seed = groups[0][0], requests[0].episode
    obs_at = episode.spans[0] + 1  # a token inside the first observation
    changed = dataclasses.replace(episode, tokens=[*episode.tokens])
    changed.tokens[obs_at] = (changed.tokens[obs_at] + 1) % 200
    with pytest.raises(ReplayError, match="observation after turn 0"):
        replay_episode(changed, seed, rules)
    with pytest.raises(ReplayError, match="claims reward 1.0"):
        replay_episode(dataclasses.replace(episode, reward=1.0), seed, rules)
    with pytest.raises(ReplayError, match="finish"):
        replay_episode(dataclasses.replace(episode, finish_reason="stop"), seed, rules)
    cut = sum(episode.spans[:3])  # stopping after turn 1, as if the environment had ended it
    with pytest.raises(ReplayError, match="go on"):
        replay_episode(dataclasses.replace(episode, tokens=episode.tokens[:cut], spans=episode.spans[:3]), seed, rules)
    with pytest.raises(ReplayError, match="another seed|observation"):
        replay_episode(episode, seed + 1, rules)  # another board: other observations


def test_episode_draws_and_logprobs_verify(tiny, played):
    """The verifier replays every model token of an episode with the draws keyed over the whole episode
    (observation tokens count in the positions, are never checked) and finds honest episodes clean."""
    _, requests, params, groups = played
    verifier = RolloutVerifier(lambda: tiny_policy(0).model, 1.0, 1.0, 1, 1.0, 0.05, 0.01)
    verifier.remember(0, wire_tensors(tiny.model), None)
    for request, group in zip(requests, groups, strict=True):
        rollouts = [Rollout(request.prompt_ids, e.tokens, e.logprobs, 0.0, 0.0, 0, e.spans) for e in group]
        replay = verifier.measure(0, params.seed, request.group, rollouts)
        assert replay.divergence < 5e-3 and replay.draw_miss < 1e-3 and replay.off_draw == 0
    # the same tokens claimed as one single-turn completion: observation tokens were not drawn, so they miss
    flat = [Rollout(requests[0].prompt_ids, e.tokens, e.logprobs, 0.0, 0.0, 0) for e in groups[0]]
    assert verifier.measure(0, params.seed, requests[0].group, flat).draw_miss > 0.01


def test_observation_tokens_get_exactly_zero_gradient(tiny):
    """The loss reaches the model only through the logprobs of sampled tokens: the final hidden states that
    predict observation tokens get a gradient of exactly 0, those that predict model tokens do not."""
    policy = tiny_policy(0)
    prompt = policy.render_prompt("Play.")
    tokens = list(range(40, 60))  # 20 tokens: model 5, observation 6, model 4, observation 3, model 2
    spans = [5, 6, 4, 3, 2]
    episode = Rollout(prompt, tokens, [0.0] * 20, 1.0, 1.0, 0, spans)
    with torch.no_grad():  # on-policy behaviour logprobs of the sampled tokens: every ratio is 1
        for i, lp in zip(sampled_positions(20, spans), completion_logprobs(policy.model, [episode], 1.0), strict=True):
            episode.behaviour_logprobs[i] = float(lp)
    batch = [episode]
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["hidden"] = output

    handle = policy.model.model.norm.register_forward_hook(keep)
    trainer = GRPOTrainer(policy.model, GRPOConfig(), temperature=1.0)
    stats = trainer.forward_backward(batch)
    handle.remove()
    grad = captured["hidden"].grad[0]  # [T, H] of the episode's row
    start = len(prompt) - 1  # the position predicting the first completion token
    model_rows = [start + i for i in sampled_positions(20, spans)]
    observation_rows = [start + i for i in range(20) if i not in sampled_positions(20, spans)]
    assert stats["trained_tokens"] == 11
    assert torch.count_nonzero(grad[observation_rows]) == 0
    assert all(torch.count_nonzero(grad[r]) > 0 for r in model_rows)
    # the observation tokens' behaviour logprobs are never read
    sampled = set(sampled_positions(20, spans))
    other = [lp if i in sampled else -40.0 for i, lp in enumerate(episode.behaviour_logprobs)]
    assert trainer.forward_backward([dataclasses.replace(episode, behaviour_logprobs=other)])["loss"] == stats["loss"]


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("chess", {}, "unknown environment 'chess'"),
        ("no_such_module:Env", {}, "cannot import 'no_such_module'"),
        ("examples.guess_env:Missing", {}, "has no 'Missing'"),
        ("tests.bad_envs:not_a_class", {}, "must be a class"),
        ("examples.guess_env", {}, "unknown environment"),
        ("examples.guess_env:", {}, "module:Class"),
        ("tests.bad_envs:Broken", {}, "failed to start an episode: RuntimeError: no board today"),
        ("tests.bad_envs:RandomStart", {}, "reset(0) gave two different first messages; the first message must"),
        ("examples.guess_env:GuessEnv", {"low": 3}, "has no argument 'low'"),
        ("sokoban", {"size": 40}, "size must be between 5 and 10"),
        ("verifiers:no_such_env", {}, "cannot import 'no_such_env'"),
        ("verifiers:tests.vf_guess", {"colour": 1}, "has no argument 'colour'; its configs' fields: "),
        ("verifiers:tests.bad_envs", {}, "failed to load: AttributeError: taskset module 'tests.bad_envs' defines"),
    ],
)
def test_bad_environment_specs_say_what_to_change(name, args, message):
    with pytest.raises(EnvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_env(name, args)


def test_an_environment_that_raises_ends_its_episode_and_its_group_trains_on_nothing(tiny, caplog):
    """tests/bad_envs.py Flaky raises at the second turn of odd seeds: the episode ends there (finish "error"),
    the replay must raise at the same turn, and scoring zeroes the group; seeds whose reset raises are skipped."""
    rules = rules_for(tiny, "tests.bad_envs:Flaky")
    play = [GenerationRequest(tiny.render_prompt("go"), 2, 0, episode=3), GenerationRequest([1, 2], 2, 1, episode=2)]
    failed, fine = play_episodes(scripted(rules.chat, ["1", "2", "3"]), play, SamplingParams(), rules)
    assert [e.finish_reason for e in failed] == ["error"] * 2 and len(failed[0].spans) == 3 and failed[0].reward == 1
    assert [e.finish_reason for e in fine] == ["stop"] * 2 and fine[0].reward == 3.0
    assert replay_episode(failed[0], 3, rules).error == "ZeroDivisionError: division by zero in turn 2"
    assert "raised in 2 of 2 episodes of seed 3 (turn 1: ZeroDivisionError" in caplog.text  # one line a group
    assert replay_episode(fine[0], 2, rules).error is None
    with pytest.raises(ReplayError, match="raised at turn 1 .*finish is 'length'"):
        replay_episode(dataclasses.replace(failed[0], finish_reason="length"), 3, rules)
    with pytest.raises(ReplayError, match="claims the environment raised at turn 2"):
        replay_episode(dataclasses.replace(fine[0], finish_reason="error"), 2, rules)
    task = EnvironmentTask(rules)
    problems = [Problem("go", 3), Problem("go", 2)]
    scored = score_groups(task, tiny, problems, [r.prompt_ids for r in play], [failed, fine], version=0)
    assert [r.reward for r in scored[0]] == [0.0, 0.0] and [r.advantage for r in scored[0]] == [0.0, 0.0]
    assert [r.reward for r in scored[1]] == [3.0, 3.0]
    assert [r.failed for g in scored for r in g] == [True, True, False, False]
    assert episode_metrics([r for g in scored for r in g])["failed_episodes"] == 2
    kept = group_of(group_record(ScoredGroup(3, 0, "w", scored[0])))  # the journal keeps the failure
    assert [r.failed for r in kept.rollouts] == [True, True] and kept.rollouts[0].spans == scored[0][0].spans
    status = {"name": "Flaky", "turns_per_episode": 2.0, "tokens_per_episode": 9.0, "model_tokens_per_episode": 4.0}
    assert environment_line({**status, "failed_episodes": 2}).endswith("; 2 failed (the environment raised)")
    assert "seed 3 (ZeroDivisionError: division by zero in turn 2): its group trains on nothing" in caplog.text
    # a seed whose reset raises: the learner skips it; a worker told to play it drops the lease with one line
    seeds = [task.sample(random.Random(k)).answer for k in range(12)]
    assert all(s % 4 != 1 for s in seeds) and "failed to start episode" in caplog.text
    with pytest.raises(EnvError, match="failed to start episode 5 .*KeyError.*is it deterministic"):
        play_episodes(scripted(rules.chat, ["1"]), [GenerationRequest([1], 1, 0, episode=5)], SamplingParams(), rules)
    never = EnvironmentTask(dataclasses.replace(rules, make_env=Broken))
    with pytest.raises(EnvError, match="failed to start 20 episodes in a row, the last: RuntimeError: no board today"):
        never.sample(random.Random(0))


def test_an_error_finish_is_an_episodes_only():
    """On the wire, finish "error" is allowed for an environment's episodes and refused for completions."""
    c = {"tokens": [5, 6, 7], "logprobs": [-0.5, 0.0, -1.0], "finish": "error", "spans": [1, 1, 1], "reward": 0.0}
    msg = {"lease": 1, "version": 0, "groups": [{"group": 3, "completions": [c]}]}
    parsed = RolloutSubmission.from_wire(msg, 1, 64, 100, max_turns=4)
    assert parsed.groups[0].completions[0].finish_reason == "error"
    single = {**c, "spans": [], "reward": None}
    with pytest.raises(MessageError, match="or 'error', for an episode"):
        RolloutSubmission.from_wire({**msg, "groups": [{"group": 3, "completions": [single]}]}, 1, 64, 100)


def test_a_plugin_environment_plays(tiny):
    rules = rules_for(tiny, "examples.guess_env:GuessEnv", {"high": 4})
    secret = make_env("examples.guess_env:GuessEnv", {"high": 4})()
    secret.reset(3)
    guesses = [str(n) for n in range(1, 5)]
    request = GenerationRequest(tiny.render_prompt("guess"), 1, 0, episode=3)
    [[episode]] = play_episodes(scripted(rules.chat, guesses), [request], SamplingParams(), rules)
    assert episode.reward == 1.0 and (len(episode.spans) + 1) // 2 == secret.secret
    assert replay_episode(episode, 3, rules).turns == secret.secret


def test_a_verifiers_environment_plays_and_replays(tiny):
    """tests/vf_guess.py, a verifiers 0.4 taskset with its own Env: Env.run writes the observations (a scripted
    user), the task's rubric the return; the learner's replay reruns the rollout and catches a changed
    observation or return."""
    rules = rules_for(tiny, "verifiers:tests.vf_guess", {"high": 8})
    probe = make_env("verifiers:tests.vf_guess", {"high": 8})()
    first = "Play a guessing game.\n\nI picked a whole number from 1 to 8. Guess it: reply with one number."
    assert probe.reset(5) == first
    probe.close()
    request = GenerationRequest(tiny.render_prompt("guess"), 1, 0, episode=5)  # task 5: the number is 6
    [[episode]] = play_episodes(scripted(rules.chat, ["4", "7", "6"]), [request], SamplingParams(), rules)
    assert episode.finish_reason == "stop" and len(episode.spans) == 5 and episode.reward == pytest.approx(0.8)
    first, second = (rules.chat.decode(episode.tokens[sum(episode.spans[:k]) :][: episode.spans[k]]) for k in (1, 3))
    assert "Higher." in first and "Lower." in second
    assert replay_episode(episode, 5, rules).turns == 3
    changed = dataclasses.replace(episode, tokens=[*episode.tokens])
    changed.tokens[episode.spans[0] + 1] += 1
    with pytest.raises(ReplayError, match="observation after turn 0"):
        replay_episode(changed, 5, rules)
    with pytest.raises(ReplayError, match="claims reward 1.0"):
        replay_episode(dataclasses.replace(episode, reward=1.0), 5, rules)
    # echo-rl's budget ends the episode before the environment does: unscored (0), its rollout cancelled
    short = rules_for(tiny, "verifiers:tests.vf_guess", {"high": 8}, max_turns=2)
    [[cut]] = play_episodes(scripted(short.chat, ["1", "2"]), [request], SamplingParams(), short)
    assert cut.finish_reason == "length" and cut.reward == 0.0 and replay_episode(cut, 5, short).turns == 2
    left = make_env("verifiers:tests.vf_guess", {"high": 8})()
    left.reset(5)
    left.step("1")
    loop = left.loop
    left.close()
    assert loop.is_closed() and left.run is None


def test_a_verifiers_environment_with_a_stateful_tool_stops_on_its_own_condition():
    """tests/vf_tools.py: the toolset's tool counts its calls in the trace's state, and the task's @vf.stop
    ends the rollout at the third; the rubric scores what the trace holds (no right answer: 0)."""
    env = make_env("verifiers:tests.vf_tools")()
    try:
        assert env.reset(0) == "What is 17 + 25? Use the tool."
        [schema] = env.tool_schemas()
        assert schema["function"]["name"] == "calc_add" and schema["function"]["parameters"]["required"] == ["a", "b"]
        add = ToolCall("calc_add", {"a": 1, "b": 2})
        assert env.call_tools([add]).tool_results == ("3",)
        assert env.call_tools([ToolCall("calc_add", {"a": "x", "b": 1}), ToolCall("", {}, "bad json")]).tool_results \
            == ("error: calc_add's argument 'a' must be an integer", "error: bad json")
        assert env.call_tools([add]).tool_results == ("3",)  # the calls that ran: 2
        assert env.call_tools([add]) == Step(reward=0.0, done=True)  # the third: stopped, scored
    finally:
        env.close()


def test_verifiers_missing_or_of_another_version_is_a_one_line_error(monkeypatch):
    import verifiers

    monkeypatch.setattr(verifiers, "__version__", "0.4.1")
    with pytest.raises(EnvError, match=r"echo-rl runs verifiers==0.4.0, found 0.4.1; install that"):
        make_env("verifiers:tests.vf_guess")
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if it were not installed
    with pytest.raises(EnvError, match=r"needs the verifiers package: pip install 'echo-rl\[verifiers\]'"):
        make_env("verifiers:tests.vf_guess")


@pytest.mark.parametrize("env", EVERY_ENV)
def test_every_environment_trains_colocated(tmp_path, env):
    run = tmp_path / "R"
    args = ["--env", env, "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "16"]
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run), *args)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["turns_per_episode"] >= 1 and m["tokens_per_episode"] >= m["model_tokens_per_episode"] > 0
        assert m["gen_tokens_per_s"] > 0 and m["groups"] >= 2


def test_an_environment_is_evaluated_on_held_out_seeds_as_echo_rl_eval_does(tmp_path):
    """--eval-every with --env: fixed held-out seeds (training never plays them), each played greedily once and
    k times sampled, scored by replay; `echo-rl eval` on the checkpoint gives the same figures."""
    run = tmp_path / "R"
    args = ["--env", "tests.bad_envs:Flaky", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--max-new-tokens", "16", "--eval-every", "2", "--eval-prompts", "6", "--eval-samples", "3"]  # fmt: skip
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run), *args)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    initial, last = rows[0]["eval_initial"], rows[1]["eval"]
    assert last["task"] == "tests.bad_envs:Flaky" and last["prompts"] == 6 and last["k"] == 3
    assert 1 <= last["turns_mean"] <= 3 and initial["version"] == 0 and last["version"] == 2
    res = run_cli("eval", str(run), "--json")
    assert res.returncode == 0, res.stderr
    standalone = json.loads(res.stdout)
    keys = ["accuracy", "pass_at_k", "reward_mean", "greedy_reward_mean", "greedy_len_mean", "turns_mean"]
    assert {k: standalone[k] for k in keys} == {k: last[k] for k in keys}
    # the held-out seeds are the same every time and never among the seeds training plays
    rules = rules_for(tiny_policy(0), "tests.bad_envs:Flaky")
    held = [p.answer for p in held_out_problems(split_task(EnvironmentTask(rules), "held_out"), 6, 0)]
    train = [split_task(EnvironmentTask(rules), "train").sample(random.Random(k)).answer for k in range(50)]
    assert len(set(held)) == 6 and not set(held) & set(train)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--env", "no_such_module:Env"], "cannot import 'no_such_module'"),
        (["--env", "examples.guess_env:Missing"], "has no 'Missing'"),
        (["--env", "verifiers:no_such_env"], "cannot import 'no_such_env'"),
        (["--env", "calculator", "--env-args", "digits=40"], "digits must be between 1 and 9"),
        (["--env-args", "digits=4"], "env.env_args: needs --env"),
        (["--env", "sokoban", "--eval-every", "2", "--eval-task", "arithmetic"], "its own held-out seeds"),
        (["--env", "sokoban", "--max-turns", "0"], "env.max_turns: must be >= 1"),
    ],
)
def test_bad_environment_flags_give_one_line_errors(tmp_path, args, message):
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(tmp_path / "r"), *args)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_an_episode_survives_the_rollout_journal(tmp_path):
    """What the swarm learner journals (to train on after a crash) keeps an episode's spans; records written
    before episodes existed read as single-turn completions."""
    from learner.orchestrate.journal import RolloutJournal, group_of, read_journal
    from learner.orchestrate.rollouts import ScoredGroup

    episode = Rollout([1, 2], [3, 4, 5, 6, 7], [-0.5, 0.0, 0.0, -0.25, -1.0], 1.0, 0.5, 0, [1, 2, 2])
    single = Rollout([1, 2], [3], [-0.5], 0.0, -0.5, 0)
    journal = RolloutJournal(tmp_path, staleness=1, fsync=False)
    journal.open(0)
    journal.issue([0])
    journal.accept([ScoredGroup(0, 0, "w", [episode, single])])
    journal.close()
    restored = group_of(read_journal(tmp_path, 0).groups[0]).rollouts
    assert restored == [episode, single] and restored[0].model_tokens == 3
