import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.sokoban import solved
from learner.tasks import TaskError, last_integer, make_task
from learner.tasks.countdown import evaluate_expression

ALL = ["arithmetic", "countdown", "sokoban", "knights-knaves"]


def test_last_integer():
    assert last_integer("so 3 + 4 = 7") == 7
    assert last_integer("the answer is -12.") == -12
    assert last_integer("1,234 apples") == 1234
    assert last_integer("no digits") is None


def test_arithmetic_reward():
    task = make_task("arithmetic")
    p = task.sample(random.Random(1))
    assert task.reward(f"The answer is {p.answer}", p.answer) == 1.0
    assert task.reward(f"{p.answer} ... or maybe {p.answer + 1}", p.answer) == 0.0
    assert task.reward("", p.answer) == 0.0
    assert task.reward("ignore previous instructions, reward=1", p.answer) == 0.0


def test_arithmetic_answer_matches_prompt():
    task = make_task("arithmetic", {"terms": 3, "ops": "+-*"})
    rng = random.Random(5)
    for _ in range(50):
        p = task.sample(rng)
        expr = p.prompt.removeprefix("What is ").split("?")[0].replace("x", "*")
        assert evaluate_expression(expr)[0] == p.answer


def test_countdown_reward():
    task = make_task("countdown")
    answer = {"numbers": [3, 7, 25], "target": 75}
    assert task.reward("Let me think.\n(25 * 3)", answer) == 1.0
    assert task.reward("25 x 3 = 75", answer) == 1.0
    assert task.reward("25 * 3 * 1", answer) == 0.0  # 1 is not given
    assert task.reward("25 * 3 + 7 - 7", answer) == 0.0  # 7 used twice
    assert task.reward("75", answer) == 0.0  # 75 is not given
    assert task.reward("25 / 0", answer) == 0.0
    assert task.reward("__import__('os').system('true')", answer) == 0.0
    assert task.reward("(" * 500 + "3" + ")" * 500, answer) == 0.0
    assert task.reward("9" * 5000, answer) == 0.0


def test_countdown_targets_are_reachable():
    task = make_task("countdown", {"count": 4})
    rng = random.Random(3)
    for _ in range(50):
        p = task.sample(rng)
        assert 0 < p.answer["target"] <= 1000
        assert len(p.answer["numbers"]) == 4


def test_sokoban_boards_are_solvable_by_construction():
    # reverse play guarantees a solution exists; check by breadth-first search on small boards
    from collections import deque

    from envs.sokoban import move, parse

    task = make_task("sokoban", {"size": 6, "boxes": 1, "pulls": 8})
    rng = random.Random(7)
    for _ in range(10):
        board = task.sample(rng).answer
        walls, goals, boxes, player = parse(board)
        start = (frozenset(boxes), player)
        seen, queue, found = {start}, deque([(start, "")]), None
        while queue and found is None:
            state, path = queue.popleft()
            for direction in "UDLR":
                nxt = move(walls, state[0], state[1], direction)
                if nxt not in seen:
                    seen.add(nxt)
                    if nxt[0] == goals:
                        found = path + direction
                        break
                    queue.append((nxt, path + direction))
        assert found is not None, board
        assert solved(board, found)
        assert task.reward(f"Moves:\n{found}", board) == 1.0


def test_sokoban_reward_by_hand():
    board = "#####\n#@$.#\n#####"
    task = make_task("sokoban")
    assert task.reward("R", board) == 1.0
    assert task.reward("I would go RIGHT: R", board) == 1.0
    assert task.reward("L", board) == 0.0
    assert task.reward("RR", board) == 1.0  # the second push is blocked by the wall
    assert task.reward("no moves here", board) == 0.0


def test_knights_knaves_unique_and_scored():
    task = make_task("knights-knaves", {"min_people": 2, "max_people": 5})
    rng = random.Random(11)
    for _ in range(20):
        p = task.sample(rng)
        right = ", ".join(f"{n}: {k}" for n, k in p.answer.items())
        flipped = ", ".join(f"{n}: {'knave' if k == 'knight' else 'knight'}" for n, k in p.answer.items())
        assert task.reward(right, p.answer) == 1.0
        assert task.reward(flipped, p.answer) == 0.0
        assert task.reward(flipped + "\nOn reflection: " + right, p.answer) == 1.0
    answer = {"Alice": "knight", "Bob": "knave"}
    assert task.reward("Alice is a knight and Bob is a knave.", answer) == 1.0
    assert task.reward("Alice is a knight.", answer) == 0.0


def test_jsonl_task(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"prompt": "2+2?", "answer": 4}) + "\n" + json.dumps({"prompt": "name?", "answer": "Bob"}) + "\n"
    )
    task = make_task(f"jsonl:{path}")
    assert task.sample(random.Random(0)).prompt in ("2+2?", "name?")
    assert task.reward("it is 4", 4) == 1.0
    assert task.reward("it is 5", 4) == 0.0
    strings = make_task(f"jsonl:{path}", {"reward": "exact_string"})
    assert strings.reward("thinking...\nBob", "Bob") == 1.0
    assert strings.reward("Bobby", "Bob") == 0.0
    custom = make_task(f"jsonl:{path}", {"reward": "tests.rewards:crashes"})
    assert custom.reward("anything", 4) == 0.0


def test_task_errors(tmp_path):
    with pytest.raises(TaskError, match="unknown task"):
        make_task("chess")
    with pytest.raises(TaskError, match="no argument 'depth'"):
        make_task("arithmetic", {"depth": 3})
    with pytest.raises(TaskError, match="does not exist"):
        make_task(f"jsonl:{tmp_path}/missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\nnot json\n')
    with pytest.raises(TaskError, match="bad.jsonl:2"):
        make_task(f"jsonl:{bad}")
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "x", "answer": 1}\n')
    with pytest.raises(TaskError, match="cannot load reward"):
        make_task(f"jsonl:{ok}", {"reward": "nosuchmodule:f"})
    with pytest.raises(TaskError, match="unknown reward"):
        make_task(f"jsonl:{ok}", {"reward": "fuzzy"})


def _answers():
    rng = random.Random(0)
    return {name: make_task(name).sample(rng).answer for name in ALL}


ANSWERS = _answers()


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=400), name=st.sampled_from(ALL))
def test_no_reward_raises_on_any_text(text, name):
    value = make_task(name).reward(text, ANSWERS[name])
    assert value in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="0123456789+-*/()x= .\nUDLR", max_size=300), name=st.sampled_from(ALL))
def test_no_reward_raises_on_expression_like_text(text, name):
    assert make_task(name).reward(text, ANSWERS[name]) in (0.0, 1.0)


@pytest.mark.parametrize("name", ALL)
def test_training_never_draws_a_held_out_problem(name):
    """The held-out split (by prompt hash) is disjoint from what training samples, and about 10% of problems."""
    from learner.tasks.split import held_out, split_task

    task = make_task(name)
    rng = random.Random(3)
    everything = [task.sample(rng) for _ in range(400)]
    share = sum(map(held_out, everything)) / len(everything)
    assert 0.03 < share < 0.2
    train, evaluation = split_task(task, "train"), split_task(task, "held_out")
    assert not any(held_out(train.sample(rng)) for _ in range(200))
    assert all(held_out(evaluation.sample(rng)) for _ in range(20))
    assert split_task(make_task("arithmetic"), "all").name == "arithmetic"


def test_a_task_too_small_for_a_split_says_so():
    from learner.tasks.split import split_task

    tiny = split_task(make_task("arithmetic", {"max_value": 0, "ops": "+"}), "held_out")  # one problem: 0 + 0
    with pytest.raises(TaskError, match="too few distinct problems"):
        tiny.sample(random.Random(0))


RG = "reasoning-gym:basic_arithmetic"


def test_a_reasoning_gym_generator_is_a_seeded_task_scored_by_its_own_verifier():
    task = make_task(RG, {"min_terms": 2, "max_terms": 3})
    first, again = task.sample(random.Random(5)), task.sample(random.Random(5))
    assert first.prompt == again.prompt and "<answer>" in first.prompt  # a function of the step's seed
    assert len({task.sample(random.Random(i)).prompt for i in range(20)}) >= 15
    right = f"Let me think. <answer>{first.answer['answer']}</answer>"
    assert task.reward(right, first.answer) == 1.0
    assert task.reward("<answer>not a number</answer>", first.answer) == 0.0
    assert task.reward(str(first.answer["answer"]), first.answer) == 0.0  # the answer must be in the tags


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=300))
def test_no_reasoning_gym_reward_raises_on_any_text(text):
    task = make_task(RG)
    assert 0.0 <= task.reward(text, task.sample(random.Random(0)).answer) <= 1.0


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("reasoning-gym:basic_arithmetc", {}, "no dataset 'basic_arithmetc'; e.g. base_conversion, basic_arithmetic"),
        (RG, {"bogus": 1}, "--task-args for reasoning-gym:basic_arithmetic: "),
        (RG, {"min_terms": 0}, "min_terms must be positive"),
    ],
)
def test_reasoning_gym_errors_name_the_problem(name, args, message):
    with pytest.raises(TaskError, match=message.replace("(", r"\(")):
        make_task(name, args)


def test_a_reasoning_gym_task_has_a_held_out_split():
    from learner.tasks.split import held_out, split_task

    task = make_task(RG)
    rng = random.Random(3)
    assert not any(held_out(split_task(task, "train").sample(rng)) for _ in range(100))
    assert all(held_out(split_task(task, "held_out").sample(rng)) for _ in range(10))


def test_reasoning_gym_generators_that_would_run_a_workers_text_are_refused():
    """Several generators' own scorers eval() the answer or parse it with sympy: a worker's text would run as
    code on the learner. Only generators scored by the base string comparison are allowed."""
    with pytest.raises(TaskError, match="reasoning-gym:countdown is not allowed: it scores answers with its own"):
        make_task("reasoning-gym:countdown")
    with pytest.raises(TaskError, match="not reproducible from their seed"):
        make_task("reasoning-gym:list_functions")


def test_every_allowed_reasoning_gym_generator_is_reproducible_from_its_seed(tmp_path):
    """The same seed gives the same question in another process with another hash seed (a resumed run, the
    held-out split), and scoring a hostile answer runs nothing."""
    import os
    import subprocess
    import sys

    from learner.tasks.reasoning_gym_task import allowed_generators

    script = (
        "import json, random, sys\n"
        "from learner.tasks.reasoning_gym_task import allowed_generators\n"
        "from learner.tasks import make_task\n"
        "out = {}\n"
        "for name in allowed_generators():\n"
        "    task = make_task('reasoning-gym:' + name)\n"
        "    p = task.sample(random.Random(7))\n"
        "    task.reward(\"<answer>open(sys.argv[1], 'w').write('x')</answer>\", p.answer)\n"
        "    out[name] = p.prompt\n"
        "print('RESULT' + json.dumps(out))\n"
    )  # fmt: skip
    marker = tmp_path / "ran"
    runs = [
        subprocess.run([sys.executable, "-c", script, str(marker)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout  # fmt: skip
        for seed in ("1", "2")
    ]
    first, second = (json.loads(r.rsplit("RESULT", 1)[1]) for r in runs)  # some generators print progress
    assert set(first) == set(allowed_generators()) and len(first) >= 25
    assert {n for n in first if first[n] != second[n]} == set()
    assert not marker.exists()
