"""Tool calling (envs.tools): calls read in each released chat template's own format, tools offered and results
written as the template writes them, episodes with tool calls replayed, and a peer's forged result caught."""

import dataclasses
import json
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from envs import EnvError, EnvSpec, Step, make_env
from envs.calculator import calculate
from envs.chat import ChatFormat
from envs.episode import EpisodeRules, ReplayError, play_episodes, replay_episode
from envs.tools import MAX_CALLS, MAX_RESULT, ToolCall, ToolEnv, parse_hermes, parse_llama3_json, parse_mistral
from learner.tasks.environment import EnvironmentTask
from learner.train.chat_templates import render_user_turn, tool_format, tool_frame
from learner.train.models import chat_format, load_policy, tiny_tokenizer
from p2p.messages import GenerationRequest, SamplingParams
from tests.conftest import run_cli
from tests.families import save_family
from tests.test_envs import scripted

TEMPLATES = Path(__file__).resolve().parent.parent / ".venv" / "share" / "llama.cpp-templates"  # scripts/setup.sh
# released chat templates: (file, the tool-call format echo-rl reads, whether the template writes the tools)
RELEASED = [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", True),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", True),
    ("Qwen-QwQ-32B.jinja", "hermes", True),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", True),  # results in a `tool` turn
    ("ibm-granite-granite-4.0.jinja", "hermes", True),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_json", True),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json", True),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral", True),  # [TOOL_CALLS]name[ARGS]{...}
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral", True),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "hermes", False),  # results carry the call's id: generic
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "hermes", False),  # likewise
    ("GLM-4.6.jinja", "hermes", False),  # <tool_call> with XML arguments inside: not read, generic
    ("Qwen3-Coder.jinja", "hermes", False),  # <tool_call><function=...>: likewise
    ("google-gemma-2-2b-it.jinja", "hermes", False),
    ("microsoft-Phi-3.5-mini-instruct.jinja", "hermes", False),
    ("HuggingFaceTB-SmolLM3-3B.jinja", "hermes", False),
]
SCHEMA = get_json_schema(calculate)


def released(name: str):
    tok = tiny_tokenizer()
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def test_hermes_calls_are_read_and_malformed_ones_say_why():
    text = ('<think>plan</think><tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'
            "<tool_call>{bad</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"name": "calculate", "arguments": {"expression": "9"}}')  # fmt: skip
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("calculate", {"expression": "2*3"}), ToolCall("calculate", {"expression": "4"})]
    assert [c.error is not None for c in calls[2:]] == [True, True, False]  # the unclosed last call counts
    assert parse_hermes("The answer is 6.") == []
    deep = "<tool_call>" + '{"name": "f", "arguments": ' + '{"a": ' * 40 + "1" + "}" * 41 + "</tool_call>"
    assert parse_hermes(deep)[0].error  # nested past MAX_DEPTH
    assert parse_hermes("<tool_call>" + "[" * 100_000 + "</tool_call>")[0].error  # no RecursionError
    many = "".join('<tool_call>{"name": "f", "arguments": {}}</tool_call>' for _ in range(1000))
    assert len(parse_hermes(many)) == MAX_CALLS + 1  # read no further than what is refused


def test_mistral_calls_are_read_in_both_of_its_forms():
    text = ('[TOOL_CALLS]calculate[ARGS]{"expression": "2*3"}[TOOL_CALLS]calculate[CALL_ID]a1b2C3d4e[ARGS]'
            '{"expression": "4"}[TOOL_CALLS]calculate[ARGS]{bad[TOOL_CALLS]just words')  # fmt: skip
    calls = parse_mistral(text)
    assert [c.arguments for c in calls[:2]] == [{"expression": "2*3"}, {"expression": "4"}]
    assert all(c.name == "calculate" for c in calls[:2]) and calls[2].error and calls[3].error
    nemo = '[TOOL_CALLS][{"name": "calculate", "arguments": {"expression": "1"}, "id": "abcdefghi"}]'
    assert parse_mistral(nemo) == [ToolCall("calculate", {"expression": "1"})]
    assert parse_mistral("It is 6.") == [] and parse_mistral("[TOOL_CALLS]" + "[" * 100_000)[0].error
    assert len(parse_mistral('[TOOL_CALLS]f[ARGS]{}' * 1000)) == MAX_CALLS + 1  # refused as one, at the env
    assert parse_mistral("[TOOL_CALLS]" + " " * 20_000)[0].error  # linear: no backtracking over the blanks


def test_deep_json_in_a_call_is_refused_alike_whatever_the_stack():
    """How deep a JSON decoder gets depends on the machine's stack: a worker and the learner must read a deeply
    nested call the same way, so nesting past MAX_DEPTH + 2 is refused before decoding."""
    texts = ["[TOOL_CALLS][" + "[" * 950 + "]" * 950 + "]", "<tool_call>" + '{"a": ' * 950 + "1" + "}" * 950,
             '{"name": "f", "parameters": ' + "[" * 950 + "]" * 950 + "}"]  # fmt: skip
    parsers = [parse_mistral, parse_hermes, parse_llama3_json]

    def deeper(n, parse, text):
        return parse(text) if n == 0 else deeper(n - 1, parse, text)

    for parse, text in zip(parsers, texts, strict=True):
        assert parse(text) == deeper(300, parse, text) and parse(text)[0].error


def test_llama3_calls_are_a_bare_json_answer():
    text = '{"name": "calculate", "parameters": {"expression": "1;2"}}; {"name": "calculate", "parameters": {}}'
    assert parse_llama3_json(text) == [ToolCall("calculate", {"expression": "1;2"}), ToolCall("calculate", {})]
    assert parse_llama3_json("It is 6. {not a call}") == []
    assert parse_llama3_json('{"name": "calculate", "parameters": {"expression": "2"}} and then')[1].error
    assert parse_llama3_json("{" * 50_000)[0].error


class Tools(ToolEnv):
    def __init__(self) -> None:
        def add(a: int, b: int = 1) -> int:
            """Add.

            Args:
                a: first
                b: second
            """
            return a + b

        def fail(x: str) -> str:
            """Fail.

            Args:
                x: anything
            """
            raise RuntimeError("tool broke\nsecond line")

        def big(x: str) -> str:
            """Big.

            Args:
                x: anything
            """
            return x * 10_000

        self.tools = (add, fail, big)
        self.call_cost = 0.25


def test_a_call_that_cannot_run_is_the_models_mistake_shown_as_its_result():
    env = Tools()
    calls = [ToolCall("add", {"a": 2}), ToolCall("add", {"a": 2, "b": 5}), ToolCall("add", {"b": 1}),
             ToolCall("add", {"a": "2"}), ToolCall("add", {"a": True}), ToolCall("add", {"a": 1, "c": 1}),
             ToolCall("nope", {}), ToolCall("", {}, "the call is not valid JSON")]  # fmt: skip
    step = env.call_tools(calls)
    assert step.reward == -0.25 * len(calls) and not step.done
    assert step.tool_results[:2] == ("3", "7")
    assert [r.split(":")[0] for r in step.tool_results[2:]] == ["error"] * 6
    assert "needs the argument 'a'" in step.tool_results[2] and "must be an integer" in step.tool_results[3]
    assert "must be an integer" in step.tool_results[4] and "no argument 'c'" in step.tool_results[5]
    assert "there is no tool 'nope'; the tools are add, fail, big" in step.tool_results[6]
    (broke,) = env.call_tools([ToolCall("fail", {"x": ""})]).tool_results
    assert broke == "error: RuntimeError: tool broke"  # one line
    (long,) = env.call_tools([ToolCall("big", {"x": "ab"})]).tool_results
    assert len(long) == MAX_RESULT
    refused = env.call_tools([ToolCall("add", {"a": 1})] * (MAX_CALLS + 1))
    assert refused.tool_results == (f"error: at most {MAX_CALLS} tool calls per turn",)
    # a lone surrogate a call's JSON may carry ("\ud800") is shown escaped, so the result can be tokenized
    (echo,) = env.call_tools(parse_hermes('<tool_call>{"name": "big", "arguments": {"x": "\\ud800"}}')).tool_results
    assert echo.startswith("\\ud800\\ud800") and chat_format(load_policy("tiny", "unused")).tool_result_ids((echo,), [])
    (padded,) = env.call_tools([ToolCall("big", {"x": " "})]).tool_results
    assert padded == ""  # results are stripped: some templates strip a tool message


def test_a_tool_returning_what_json_cannot_write_is_the_environments_bug():
    env = Tools()
    env.tools = (lambda x: {1, 2},)
    env.tools[0].__name__ = "sets"
    with pytest.raises(EnvError, match="tool sets returned a set: a tool returns a str or plain JSON values"):
        env.call_tools([ToolCall("sets", {"x": 1})])


@pytest.mark.parametrize(("template", "fmt", "in_template"), RELEASED, ids=[r[0].split(".jinja")[0] for r in RELEASED])
def test_each_released_template_offers_the_tools_and_writes_results_as_it_would(template, fmt, in_template):
    tok = released(template)
    assert tool_format(tok) == (fmt, in_template)
    prompt = render_user_turn(tok, "What is 12 * 7?", (SCHEMA,), in_template)
    assert "calculate" in prompt and "What is 12 * 7?" in prompt
    assert ("<tool_call>" in prompt) == (fmt == "hermes") and ("integers, + - * /" in prompt)
    if not in_template:
        return
    frame, quoted = tool_frame(tok)
    model, results = "Let me call it.", ["84", 'line one\n"two"']
    messages = [{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": model}]
    messages += [{"role": "tool", "content": r} for r in results]
    full = tok.apply_chat_template(messages, tools=[SCHEMA], tokenize=False, add_generation_prompt=True)
    shown = [json.dumps(r, ensure_ascii=False) for r in results] if quoted else results
    assert quoted == (fmt == "llama3_json")  # Llama 3.1's template: tojson
    # (the prompt is the conversation's start, but for a reasoning template's opening of the assistant turn)
    assert full[: full.index(model)].startswith(prompt[: prompt.rindex("What is 12 * 7?")])
    assert full[full.index(model) + len(model) :] == frame[0] + frame[1].join(shown) + frame[2]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 with Qwen3's own tokenizer and its released chat template, saved as a user's folder."""
    folder = save_family("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3", tokenizer="qwen3")
    policy = load_policy(str(folder), "unused")
    policy.tokenizer.chat_template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    policy.tokenizer.save_pretrained(folder)
    return load_policy(str(folder), "unused"), folder


def tool_episode(policy, turns, args=None):
    args = {"digits": 2, "terms": 2, "call_cost": 0.125, **(args or {})}
    rules = EpisodeRules(EnvSpec("calculator-tools", args, 4, 600, 96), make_env("calculator-tools", args),
                         chat_format(policy))  # fmt: skip
    task = EnvironmentTask(rules)
    problem = task.sample(__import__("random").Random(3))
    expr = problem.prompt.split("What is ")[1].split("?")[0]
    request = GenerationRequest(policy.render_prompt(problem.prompt, problem.tools), 1, 0, episode=problem.answer)
    [[episode]] = play_episodes(scripted(rules.chat, turns(expr)), [request], SamplingParams(max_new_tokens=96), rules)
    return rules, problem, episode, expr


def test_a_qwen3_episode_calls_the_tool_in_its_template_and_replays(qwen3):
    policy, _ = qwen3
    assert policy.tool_format == ("hermes", True)

    def turns(expr):
        call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
        return [f"<think>\nI should compute.\n</think>\n\n<tool_call>\n{call}\n</tool_call>",
                '<tool_call>\n{"name": "calculate", "arguments": {"expr": "1"}}\n</tool_call>',
                f"It is {int(calculate(expr))}."]  # fmt: skip

    rules, problem, episode, expr = tool_episode(policy, turns)
    value = calculate(expr)
    assert "<tools>" in policy.tokenizer.decode(policy.render_prompt(problem.prompt, problem.tools))
    assert len(episode.spans) == 5 and episode.finish_reason == "stop" and episode.reward == 1.0 - 2 * 0.125
    text = policy.tokenizer.decode(episode.tokens)
    assert f"<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert "error: calculate has no argument 'expr'" in text
    assert replay_episode(episode, problem.answer, rules).reward == episode.reward
    # a worker that changes a tool's result is caught: the learner's replay calls the tool itself
    lie = policy.tokenizer.encode(str(int(value) + 1), add_special_tokens=False)
    at = text.index(f"<tool_response>\n{value}")
    start = len(policy.tokenizer.encode(text[: at + len("<tool_response>\n")], add_special_tokens=False))
    forged = episode.tokens[:start] + lie + episode.tokens[start + len(policy.tokenizer.encode(value)) :]
    spans = list(episode.spans)
    spans[1] += len(forged) - len(episode.tokens)
    bad = type(episode)(forged, [0.0] * len(forged), episode.finish_reason, spans, episode.reward)
    with pytest.raises(ReplayError, match="observation after turn 0 is not the environment's"):
        replay_episode(bad, problem.answer, rules)


def test_a_llama3_template_episode_reads_bare_json_calls():
    policy = load_policy("tiny", "unused")
    policy.tokenizer.chat_template = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()

    def turns(expr):
        return [json.dumps({"name": "calculate", "parameters": {"expression": expr}}), "So it is 0."]

    rules, problem, episode, expr = tool_episode(policy, turns)
    assert rules.chat.tool_format == "llama3_json" and rules.chat.tool_json
    text = policy.tokenizer.decode(episode.tokens)
    assert f'<|start_header_id|>ipython<|end_header_id|>\n\n"{calculate(expr)}"<|eot_id|>' in text
    assert episode.reward == replay_episode(episode, problem.answer, rules).reward == -0.125 + (calculate(expr) == "0")


def test_a_ministral_template_episode_reads_its_tool_calls_tokens():
    policy = load_policy("tiny", "unused")
    policy.tokenizer.chat_template = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()

    def turns(expr):
        return ['[TOOL_CALLS]calculate[ARGS]' + json.dumps({"expression": expr}), "So it is 0."]

    rules, problem, episode, expr = tool_episode(policy, turns)
    assert rules.chat.tool_format == "mistral" and not rules.chat.tool_json
    text = policy.tokenizer.decode(episode.tokens)
    assert f"[TOOL_RESULTS]{calculate(expr)}[/TOOL_RESULTS]" in text and len(episode.spans) == 3
    assert episode.reward == replay_episode(episode, problem.answer, rules).reward == -0.125 + (calculate(expr) == "0")


def test_the_tool_format_travels_to_workers_and_bad_values_are_refused(qwen3):
    chat = chat_format(qwen3[0])
    assert ChatFormat.from_wire(chat.to_wire()) == chat and chat.tool_frame is not None
    for key, value in [("tool_format", "python"), ("tool_format", ["hermes"]), ("tool_json", 1),
                       ("tool_frame", ["a", "b"]), ("tool_frame", ["x" * 5000, "", ""])]:  # fmt: skip
        with pytest.raises(EnvError, match="tool"):
            ChatFormat.from_wire({**chat.to_wire(), key: value})


def test_a_tool_without_a_docstring_is_refused_at_start():
    class NoDoc(ToolEnv):
        def __init__(self) -> None:
            self.tools = (lambda x: x,)

        def reset(self, seed: int) -> str:
            return "hi"

        def step(self, action: str) -> Step:
            return Step(done=True)

    rules = EpisodeRules(EnvSpec("nodoc"), NoDoc, chat_format(load_policy("tiny", "unused")))
    with pytest.raises(EnvError, match="tool '<lambda>' needs type hints and a docstring"):
        EnvironmentTask(rules)


def test_a_tool_environment_trains_colocated_with_qwen3s_template(qwen3, tmp_path):
    _, folder = qwen3
    run = tmp_path / "R"
    res = run_cli("learner", "start", "--colocated", "--model", str(folder), "--run-dir", str(run), "--env",
                  "calculator-tools", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                  "--max-new-tokens", "24")  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2] and all(m["turns_per_episode"] >= 1 for m in rows)


def test_the_python_tool_runs_code_in_a_sandbox_with_limits():
    env = make_env("python", {"timeout_s": 1.0, "memory_mb": 128})()
    (run_python,) = env.tools
    assert get_json_schema(run_python)["function"]["name"] == "run_python"
    assert run_python("print(sum(map(int, str(2**100))))") == "115\n"
    for code, why in [
        ("while True: pass", "ran past its 1 s"),
        ("x = bytearray(10**9)", "MemoryError"),
        ("import socket; socket.create_connection(('10.0.0.1', 80), timeout=0.5)", "Network is unreachable"),
        ("open('/usr/x', 'w')", "Read-only file system"),
        (f"open({str(TEMPLATES / 'x')!r}, 'w')", "No such file or directory"),  # not mounted: no home, no checkout
        ("open('/tmp/big', 'w').write('x' * (2 << 20))", "File too large"),
        ("import os\nwhile True: os.fork()", "Resource temporarily unavailable"),
        ("print('x' * 10**6)", "x" * 100),
        ("open('/dev/shm/x', 'w')", "Read-only file system"),
        ("import os; print(sorted(os.listdir('/')), open('/proc/1/environ').read())", "'usr']"),
        ("import ctypes; print(ctypes.CDLL(None).unshare(0x10000000), ctypes.get_errno())", "-1"),  # no userns
    ]:
        out = run_python(code)
        assert why in out and len(out) <= 2000 + 100, (code, out[-300:])
    assert run_python("pass") == "(the program printed nothing: print the result)"
    shown = run_python("import os; print(os.listdir('/')); print(open('/proc/1/environ').read())")
    listing, environ = shown.split("\n")[:2]
    assert set(eval(listing)) <= {"bin", "dev", "lib", "lib64", "proc", "tmp", "usr"}  # no home, no run directory
    assert "HOME" not in environ and "PATH" not in environ  # nothing of the learner's environment
    assert "error" in run_python("print('\\x00')".replace("\\x00", "\x00"))  # a NUL: refused before it runs
    problem = env.reset(3)
    assert "Use the run_python tool" in problem and env.step(f"It is {env.answer}.").reward == 1.0


def test_the_python_environment_trains_hosted_only(tmp_path):
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--env", "python", "--run-dir",
                  str(tmp_path / "R"))  # fmt: skip
    assert res.returncode == 2 and "not reproducible" in res.stderr and "--env-host learner" in res.stderr
    run = tmp_path / "S"
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--env", "python", "--env-host", "learner",
                  "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                  "--run-dir", str(run))  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]


def test_a_verifiers_tool_environment_plays_in_qwen3s_format_and_replays(qwen3):
    """tests/vf_tools.py, a verifiers 0.4 toolset: its schema goes into Qwen3's tool section, the model's
    <tool_call> runs the toolset's method in-process, its result comes back as Qwen3's tool message, the
    rubric scores the trace (right answer 1 + a tool result holding it 0.5); a forged result is caught."""
    policy, _ = qwen3
    rules = EpisodeRules(EnvSpec("verifiers:tests.vf_tools", {}, 4, 600, 96), make_env("verifiers:tests.vf_tools"),
                         chat_format(policy))  # fmt: skip
    problem = EnvironmentTask(rules).sample(__import__("random").Random(3))
    [schema] = problem.tools
    prompt = policy.tokenizer.decode(policy.render_prompt(problem.prompt, problem.tools))
    assert '"name": "calc_add"' in prompt and "<tools>" in prompt
    a, b = (int(n) for n in problem.prompt.removeprefix("What is ").split("?")[0].split(" + "))
    call = json.dumps({"name": "calc_add", "arguments": {"a": a, "b": b}})
    turns = [f"<tool_call>\n{call}\n</tool_call>", f"The sum is {a + b}."]
    request = GenerationRequest(policy.render_prompt(problem.prompt, problem.tools), 1, 0, episode=problem.answer)
    [[episode]] = play_episodes(scripted(rules.chat, turns), [request], SamplingParams(max_new_tokens=96), rules)
    assert episode.finish_reason == "stop" and len(episode.spans) == 3 and episode.reward == 1.5
    text = policy.tokenizer.decode(episode.tokens)
    assert f"<|im_start|>user\n<tool_response>\n{a + b}\n</tool_response><|im_end|>\n" in text
    assert replay_episode(episode, problem.answer, rules).reward == 1.5
    lie = episode.tokens.index(policy.tokenizer.encode(str(a + b), add_special_tokens=False)[0], episode.spans[0])
    forged = dataclasses.replace(episode, tokens=[*episode.tokens])
    forged.tokens[lie] += 1
    with pytest.raises(ReplayError, match="observation after turn 0 is not the environment's"):
        replay_episode(forged, problem.answer, rules)
