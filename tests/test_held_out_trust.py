"""Held-out figures in an open swarm (learner.orchestrate.evaluations): every group of an evaluation answer is
verified whatever the worker's standing, two workers answer where the swarm has two, each figure carries the
verifier's verdict, and a figure whose evaluator is flagged later is revoked and recomputed. The verifier runs
with the run defaults (swarm.verify_*): the tiny random Llama, its honest answers from the transformers
engine (float32, the lease's draws), the forger's right answers with plausible logprobs."""

import dataclasses
import json

import pytest

from learner.config import LearnerConfig
from learner.evaluation import Evaluator
from learner.orchestrate.evaluations import EvalBoard
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.workers import WorkerRecord
from learner.train.models import model_spec
from learner.train.wire_weights import send_to_sampler, wire_tensors
from p2p.host import BadRequest, Misbehaviour
from p2p.messages import Completion, GroupSubmission, RolloutSubmission
from worker.engines.hf import TransformersEngine

VERSION = 3


def write_jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": 0}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """The evaluator (8 held-out prompts, greedy + 2 samples, reward 1 for a completion starting with 'A': the
    random model's greedy answers never do) and an honest answer from the transformers engine."""
    from learner.train.models import tiny_policy

    tiny = tiny_policy(seed=0)
    path = write_jsonl(tmp_path_factory.mktemp("eval") / "eval.jsonl", [f"Tell me about {w}." for w in "abcdefgh"])
    cfg = LearnerConfig()
    cfg.eval = dataclasses.replace(
        cfg.eval, eval_task=f"jsonl:{path}", eval_task_args={"reward": "tests.rewards:starts_with_a"}, eval_prompts=8,
        eval_samples=2,
    )  # fmt: skip
    cfg.sampler = dataclasses.replace(cfg.sampler, max_new_tokens=8)
    evaluator = Evaluator.for_run(cfg, tiny)
    engine = TransformersEngine(threads=2, device="cpu")
    send_to_sampler(engine, model_spec(tiny), tiny.model)
    requests, n = evaluator.requests(), len(evaluator.problems)
    answer = engine.generate(requests[:n], dataclasses.replace(evaluator.params, temperature=0.0))
    answer += engine.generate(requests[n:], evaluator.params)
    return tiny, cfg, evaluator, answer


def board(held_out, workers: dict[str, int]) -> EvalBoard:
    """An evaluation board with the run's default verification; `workers`: live peer -> version held."""
    tiny, cfg, evaluator, _ = held_out
    s = cfg.swarm
    verifier = RolloutVerifier(
        lambda: type(tiny.model)(tiny.model.config), cfg.sampler.temperature, cfg.sampler.top_p, s.verify_first,
        s.verify_fraction, s.verify_tolerance, s.verify_draw_tolerance, off_draw_tolerance=s.verify_off_draw,
    )  # fmt: skip
    verifier.remember(VERSION, wire_tensors(tiny.model), None)
    records = {peer: WorkerRecord(peer) for peer in workers}
    for peer, version in workers.items():
        records[peer].version = version
    evals = EvalBoard(evaluator, verifier, timeout_s=600.0, workers=records)
    evals.request(VERSION)
    return evals


def submit(evals: EvalBoard, peer: str, groups: list[list[Completion]]) -> tuple[dict, dict | None]:
    grant = evals.offer(peer, VERSION)
    assert grant is not None, f"no evaluation lease for {peer}"
    wire = [GroupSubmission(r.group, g) for r, g in zip(grant.requests, groups, strict=True)]
    msg = RolloutSubmission(grant.id, VERSION, wire).to_wire()
    return evals.submit(peer, msg, vocab_size=held_out_vocab(evals), max_tokens=8)


def held_out_vocab(evals: EvalBoard) -> int:
    return evals.evaluator.policy.model.config.vocab_size


def right_answers(held_out) -> list[list[Completion]]:
    """A forger's answer: every completion starts with 'A' (reward 1), logprobs plausible (-1 nat a token)."""
    tiny, _, _, honest = held_out
    a = tiny.tokenizer.encode("A", add_special_tokens=False)[0]
    return [[Completion([a, *c.tokens[1:]], [-1.0] * len(c.tokens), c.finish_reason) for c in g] for g in honest]


@pytest.mark.parametrize("forger_is", ["new", "established"])
def test_a_forged_evaluation_is_refused_and_the_figure_is_the_honest_one(held_out, forger_is):
    """The forger's right answers would make the accuracy 1.0 (honest: 0.0). A new identity's groups are all
    verified anyway; so are those of a worker with 10000 accepted groups (its training groups: 5%)."""
    tiny, cfg, evaluator, honest = held_out
    expected = evaluator.score(honest)
    assert expected["accuracy"] == 0.0 and evaluator.score(right_answers(held_out))["accuracy"] == 1.0
    evals = board(held_out, {"honest": VERSION, "forger": VERSION})
    if forger_is == "established":
        evals.verifier.accepted("forger", 8, 10_000)
        assert evals.verifier.share("forger") == cfg.swarm.verify_fraction
    with pytest.raises(Misbehaviour, match="flagged"):
        submit(evals, "forger", right_answers(held_out))
    verdict, figure = submit(evals, "honest", honest)
    assert verdict["checked"] == verdict["groups"] == 16 and figure is None  # waits for a second evaluator
    assert VERSION in evals.verifier.pinned  # (kept while one can come)
    del evals.workers["forger"]  # (flagged: the learner drops it) no other worker holds the version
    results, _ = evals.drain()
    [result] = results
    assert {k: result[k] for k in expected} == expected
    assert [v["worker"] for v in result["verification"]] == ["honest"[-8:]] and VERSION not in evals.verifier.pinned
    assert result["verification"][0]["checked"] == 16 and result["verification"][0]["greedy_gap"] < 1e-3


def test_two_evaluators_make_one_figure_and_a_flag_later_recomputes_it(held_out):
    _, _, evaluator, honest = held_out
    expected = evaluator.score(honest)
    evals = board(held_out, {"a": VERSION, "b": VERSION, "c": VERSION + 1})
    assert evals.offer("c", VERSION + 1) is None  # one version per figure: the round is on v3 once a asks
    _, first = submit(evals, "a", honest)
    assert first is None and evals.offer("a", VERSION) is None  # the second evaluator must be another worker
    _, figure = submit(evals, "b", honest)
    assert figure is not None and {k: figure[k] for k in expected} == expected
    assert [v["checked"] for v in figure["verification"]] == [16, 16] and figure["worker"] == "a,b"
    assert evals.offer("c", VERSION + 1) is None and evals.pending == []  # v3 is done

    evals.revoke("b", "caught forging a training group")  # b is flagged later: the figure rests on a alone
    results, revoked = evals.drain()
    assert [r["figure"] for r in results] == [1, 2] and results[1]["recomputes"] == 1
    assert revoked == [{"figure": 1, "version": VERSION, "worker": "b", "why": "caught forging a training group",
                        "recomputed_as": 2}]  # fmt: skip
    assert {k: results[1][k] for k in expected} == expected and results[1]["worker"] == "a"
    evals.revoke("a", "caught too")  # now no evaluator is left: the version is evaluated again
    _, revoked = evals.drain()
    assert revoked[0]["evaluated_again"] and evals.pending == [VERSION] and evals.last is None


@pytest.mark.parametrize("lease", [[1, 2], {"a": 1}, None, float("nan"), "1", -1, 2**70])
def test_a_hostile_lease_id_is_a_bad_request(held_out, lease):
    # a list or a map used as a dict key raised TypeError: a traceback and "learner error", and no penalty
    evals = board(held_out, {"a": VERSION})
    assert evals.offer("a", VERSION) is not None  # a round is open
    assert evals.holds(lease) is False
    with pytest.raises(BadRequest, match="no such evaluation lease"):
        evals.submit("a", {"lease": lease}, vocab_size=held_out_vocab(evals), max_tokens=8)


def test_the_report_leaves_revoked_figures_out():
    from echo_cli.report import evaluations

    rows = [
        {"step": 1, "eval_initial": {"version": 0, "figure": 1, "accuracy": 1.0}},
        {"step": 2, "eval": {"version": 2, "figure": 2, "accuracy": 1.0}},
        {"step": 3, "eval_revoked": [{"figure": 1}, {"figure": 2}], "eval_initial": {"version": 0, "figure": 3}},
        {"step": 4, "eval": {"version": 4, "accuracy": 0.5}},  # (a figure from before figures had ids)
    ]
    assert [(v, e.get("figure")) for v, e in evaluations(rows)] == [(0, 3), (4, None)]
    resumed = [  # a resumed learner counts figures from 1 again: its revocation is of its own figure 1
        {"step": 5, "eval": {"version": 5, "figure": 1, "accuracy": 0.5}},
        {"step": 6, "eval_revoked": [{"figure": 1}]},
    ]
    assert [(v, e.get("figure")) for v, e in evaluations(rows + resumed)] == [(0, 3), (4, None)]
    assert [(v, e.get("figure")) for v, e in evaluations(rows[:2] + resumed)] == [(0, 1), (2, 2)]


def test_an_evaluation_answer_sent_again_gets_the_same_reply_and_counts_once(held_out):
    """A worker that lost the reply to its evaluation answer (a connection cut on the way back) sends the same
    answer again: the learner's intake gives it the same reply, not a penalty, and the answer counts once."""
    from learner.orchestrate.intake import PromptBook, RolloutIntake
    from learner.tasks import make_task

    tiny, cfg, _, honest = held_out
    evals = board(held_out, {"a": VERSION, "b": VERSION})
    # only the evaluation path is taken: the training side's collaborators are not needed
    intake = RolloutIntake(cfg, held_out_vocab(evals), PromptBook(make_task("arithmetic"), tiny, 0), None, None,
                    evals.verifier, None, None, None, None)  # fmt: skip
    intake.evals = evals
    grant = evals.offer("a", VERSION)
    wire = [GroupSubmission(r.group, g) for r, g in zip(grant.requests, honest, strict=True)]
    msg = RolloutSubmission(grant.id, VERSION, wire).to_wire()
    worker = WorkerRecord("a")
    first = intake.submit(worker, msg)
    again = [intake.submit(worker, msg) for _ in range(2)]
    assert first.accepted == 16 and again == [first, first] and worker.refused == 0
    assert len(evals.round.answers) == 1
