"""`echo-rl report`, TensorBoard logging and the live views, on real recorded runs."""

import io
import json
from collections import deque
from types import SimpleNamespace

import matplotlib.image
import pytest
from rich.console import Console

from echo_cli.live import learner_table, show_learner, step_line, worker_table
from tests.conftest import run_cli


def check_pngs(folder, names):
    for name in names:
        path = folder / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        image = matplotlib.image.imread(path)  # decodes the whole file
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "R"
    args = ["--steps", "3", "--prompts-per-step", "2", "--group-size", "4", "--tensorboard", "--eval-every", "2"]
    args += ["--eval-prompts", "4", "--eval-samples", "2", "--max-new-tokens", "16"]
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run), *args)
    assert res.returncode == 0, res.stderr
    return run


def test_report_of_a_colocated_run(colocated_run):
    res = run_cli("report", str(colocated_run), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["summary"]["steps"] == 3 and doc["summary"]["mode"] == "colocated"
    assert 0 <= doc["summary"]["utilisation"] < 1  # the tiny model rarely trains: all-zero groups are skipped
    check_pngs(colocated_run / "report", ["reward.png", "eval.png", "utilisation.png"])
    assert doc["summary"]["eval_task"] == "arithmetic" and "eval_pass@2_last" in doc["summary"]
    skipped = {s.split(":")[0] for s in doc["skipped"]}
    assert skipped == {"staleness.png", "version_lag.png", "broadcast.png", "episodes.png"}
    res = run_cli("report", str(colocated_run))  # the terminal table
    assert res.returncode == 0 and "reward last10" in res.stdout


def test_report_compares_runs(colocated_run, tmp_path):
    """`echo-rl report RUN_A RUN_B`: the curves overlaid, the summaries side by side (a run without evaluation
    has no held-out figures, and is simply absent from that plot)."""
    other = tmp_path / "B"
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(other), "--steps", "2")
    assert res.returncode == 0, res.stderr
    res = run_cli("report", str(colocated_run), str(other), "--out", str(tmp_path / "cmp"), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [s["steps"] for s in doc["runs"].values()] == [3, 2]
    assert (
        "eval_accuracy_last" in doc["runs"][str(colocated_run)] and "eval_accuracy_last" not in doc["runs"][str(other)]
    )
    check_pngs(tmp_path / "cmp", ["compare_reward.png", "compare_eval.png"])
    res = run_cli("report", str(colocated_run), str(colocated_run))
    assert res.returncode == 2 and "named twice" in res.stderr


def test_tensorboard_holds_the_metrics(colocated_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(colocated_run / "tensorboard"))
    events.Reload()
    rewards = [e.value for e in events.Scalars("reward_mean")]
    recorded = [json.loads(line)["reward_mean"] for line in (colocated_run / "metrics.jsonl").read_text().splitlines()]
    assert rewards == pytest.approx(recorded)
    assert "seconds/train" in events.Tags()["scalars"]


def test_wandb_and_trackio_get_the_metrics_of_metrics_jsonl(tmp_path):
    """--wandb offline (no login: HOME holds no ~/.netrc) under RUN_DIR/wandb, --trackio in its local database:
    the same metric names and values as metrics.jsonl, nested ones joined by '/'."""
    import sqlite3

    run = tmp_path / "R"
    env = {"HOME": str(tmp_path), "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_API_KEY": ""}
    args = [
        "--steps",
        "2",
        "--wandb",
        "--trackio",
        "--project",
        "echo-test",
        "--eval-every",
        "1",
        "--eval-prompts",
        "4",
    ]
    res = run_cli("learner", "start", "--colocated", "--model", "tiny", "--run-dir", str(run), *args, env=env)
    assert res.returncode == 0, res.stderr
    recorded = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = sqlite3.connect(tmp_path / "trackio" / "echo-test.db").execute("select step, metrics from metrics")
    logged = {step: json.loads(metrics) for step, metrics in rows}
    assert sorted(logged) == [1, 2]
    for r in recorded:
        assert logged[r["step"]]["reward_mean"] == r["reward_mean"]
        assert logged[r["step"]]["eval/accuracy"] == r["eval"]["accuracy"]
        assert logged[r["step"]]["seconds/train"] == r["seconds"]["train"]
    (history,) = (run / "wandb").glob("offline-run-*/run-*.wandb")  # W&B's own record log, offline
    data = history.read_bytes()
    assert all(name.encode() in data for name in ("reward_mean", "eval/accuracy", "seconds/train"))


def test_report_bad_input(tmp_path):
    res = run_cli("report", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "metrics.jsonl does not exist" in res.stderr
    run = tmp_path / "R"
    run.mkdir()
    good = {"step": 1, "wall_s": 1.0, "reward_mean": 0.5, "accuracy": 0.5, "completion_len_mean": 3.0}
    good["seconds"] = {"train": 1.0}
    (run / "metrics.jsonl").write_text(json.dumps(good) + "\n" + '{"step": 2, "wall_')  # torn last line
    res = run_cli("report", str(run), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["summary"]["steps"] == 1
    (run / "metrics.jsonl").write_text("garbage\n" + json.dumps(good) + "\n")
    res = run_cli("report", str(run))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "metrics.jsonl:1 is not a step record" in lines[0]


SWARM_STEP = {
    "step": 7, "wall_s": 30.0, "reward_mean": 0.75, "accuracy": 0.75, "loss": 0.01, "kl": 0.002, "clip_frac": 0.03,
    "completion_len_mean": 12.0, "utilisation": 0.93, "buffer": 4, "staleness": {"1": 3, "2": 1},
    "stale_dropped": 2, "leases": {"issued": 30, "completed": 29, "expired": 1, "refused": {}},
    "workers": {"abcd1234": {"version": 6, "version_lag": 1, "tokens_per_s": 120.0, "groups_accepted": 14,
                             "last_seen_s": 0.4}},
    "seconds": {"wait": 0.1, "train": 2.0, "publish": 0.3},
}  # fmt: skip


def test_live_learner_view():
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    table = learner_table(SWARM_STEP, deque([0.5, 0.75]))
    console.print(table)
    text = console.file.getvalue()
    for expected in ("0.750", "93%", "v7", "1: 3, 2: 1", "2 dropped", "abcd1234", "v6 (lag 1)", "120 tok/s"):
        assert expected in text, expected
    assert "util 93%" in step_line(SWARM_STEP, 10)
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    show_learner(iter([SWARM_STEP]), 10, console)
    assert "7/10" in console.file.getvalue() and "abcd1234" in console.file.getvalue()


def test_live_worker_view():
    from worker.config import WorkerConfig
    from worker.daemon import WorkerDaemon

    daemon = WorkerDaemon(WorkerConfig(learner="/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx"))  # not started: no host yet
    daemon.fetcher = SimpleNamespace(announced=5, fetching=5)  # what the view reads of the fetcher thread
    daemon.version, daemon.state = 3, "generating lease 7 (4 groups) on v3"
    daemon.tokens_per_s, daemon.leases_done = 88.0, 12
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    console.print(worker_table(daemon))
    text = console.file.getvalue()
    for expected in ("lease 7", "v3", "newest published: v5, fetching v5 while generating", "88 tok/s", "12"):
        assert expected in text, expected
