"""A learner and workers as real processes on 127.0.0.1, training the tiny model."""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli, weights_moved
from tests.test_report import check_pngs

PLOTS = ["reward.png", "utilisation.png", "staleness.png", "version_lag.png", "broadcast.png"]
ROOT = Path(__file__).resolve().parent.parent


def check_accounting(metrics: list[dict], staleness: int) -> None:
    """Every consumed group was within the bound, and every accepted group is consumed, buffered or dropped."""
    for m in metrics:
        assert all(int(k) <= staleness for k in m["staleness"]), m["staleness"]
        held = m["groups_consumed"] + m["groups_set_aside"] + m["buffer"]
        assert m["groups_accepted"] == held + m["stale_dropped"] + m["groups_dropped_flagged"]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))


@pytest.mark.parametrize(
    "mode, staleness, wire, topk, w2", [("async", 1, "bf16", "0.05", ["--no-overlap"]), ("pull", 0, "f16", "1", [])]
)
def test_learner_and_two_workers_train(swarm, mode, staleness, wire, topk, w2, tmp_path):
    """async: sparse deltas (wire_topk 0.05: the verifier replays the carried weights the workers hold), one
    worker that fetches while it generates and one that stops to fetch; pull: full f16 deltas. Both: a
    full snapshot beside every 3rd delta, which the workers derive rather than download."""
    data = tmp_path / "prompts.jsonl"  # a reward half of a random model's samples earn: groups carry signal
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 0}) + "\n" for i in range(8)))
    task = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii"]
    # --min-workers 2: no lease until both hold v0, else the first worker up may do the whole run alone
    learner = swarm.learner(
        "--steps", "8", "--sync-mode", mode, "--staleness", str(staleness), "--wire-dtype", wire,
        "--wire-topk", topk, "--full-every", "3", "--min-workers", "2", *task,
    )  # fmt: skip
    workers = [swarm.worker("w1"), swarm.worker("w2", *w2)]
    assert swarm.wait(learner, 240) == 0, swarm.log("learner")[-3000:]
    for w in workers:  # SIGTERM: a worker leaves cleanly
        w.send_signal(signal.SIGTERM)
    assert [w.wait(60) for w in workers] == [0, 0]
    assert "worker left" in swarm.log("w1") and "worker left" in swarm.log("w2")
    logs = [" ".join(swarm.log(w).split()) for w in ("w1", "w2")]  # rich wraps long lines
    derived = [int(re.search(r"derived (\d+) full snapshots", log).group(1)) for log in logs]
    assert sum(derived) >= 1 and not any("differs from the learner's" in log for log in logs), derived
    metrics = swarm.metrics()
    assert len(metrics) == 8
    check_accounting(metrics, staleness)
    assert len(metrics[-1]["workers"]) == 2
    assert sum(w["groups_accepted"] for w in metrics[-1]["workers"].values()) >= 16
    assert (swarm.run_dir / "checkpoints" / "step-000008").exists()
    assert sum(m["trained_tokens"] > 0 for m in metrics) >= 4 and weights_moved(swarm.run_dir)  # it trained
    assert all(m["skipped_updates"] == 0 and m["groups_dropped_flagged"] == 0 for m in metrics)
    assert all("now on v" in swarm.log(w) for w in ("w1", "w2"))
    res = run_cli("report", str(swarm.run_dir), "--json")  # every plot of a swarm run, from real metrics
    assert res.returncode == 0, res.stderr
    skipped = [s.split(":")[0] for s in json.loads(res.stdout)["skipped"]]
    assert skipped == ["eval.png", "episodes.png"]  # no --eval-every, no --env here
    check_pngs(swarm.run_dir / "report", PLOTS)


def test_worker_reconnects_after_learner_restart(swarm):
    args = ["--steps", "100000", "--checkpoint-every", "20", "--max-new-tokens", "8"]
    learner = swarm.learner(*args)
    swarm.worker("w1")
    from learner.train.checkpoint import list_checkpoints

    deadline = time.monotonic() + 120
    while not list_checkpoints(swarm.run_dir):  # a complete one: a half-written checkpoint is not resumable
        assert time.monotonic() < deadline, swarm.log("learner")[-2000:]
        time.sleep(0.2)
    learner.send_signal(signal.SIGKILL)
    learner.wait(10)
    time.sleep(2)  # the worker notices and starts retrying
    resumed = swarm.spawn(
        "learner2", "learner", "start", "--model", "tiny", "--run-dir", str(swarm.run_dir),
        "--prompts-per-step", "2", "--group-size", "4", "--resume", *args,
    )  # fmt: skip
    first_step = None
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, swarm.log("learner2")[-3000:] + swarm.log("w1")[-3000:]
        assert resumed.poll() is None, swarm.log("learner2")[-3000:]
        if "resumed from" in swarm.log("learner2"):
            last = swarm.metrics()[-1]
            first_step = first_step or last["step"]
            if last["step"] >= first_step + 5 and any(w["groups_accepted"] > 0 for w in last["workers"].values()):
                break  # the same worker came back by itself and feeds the resumed run
        time.sleep(0.3)
    # same identity and port: the address the worker was given still reaches the learner
    assert (swarm.run_dir / "learner.addr").read_text().strip() == swarm.addr


def test_status_reports_the_live_run(swarm):
    swarm.learner("--steps", "100000", "--max-new-tokens", "8", "--staleness", "3")
    swarm.worker("w1", "--price", "0.25")
    deadline = time.monotonic() + 120
    while True:
        res = subprocess.run(
            [sys.executable, "-m", "echo_cli", "status", "--run-dir", str(swarm.run_dir), "--json"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        if doc["step"] > 2 and doc["peers"] and doc["peers"][0]["groups_accepted"] > 0:
            break
        assert time.monotonic() < deadline, doc
        time.sleep(0.5)
    assert doc["mode"] == "async" and doc["staleness"] == 3 and doc["steps"] == 100000
    assert doc["addrs"][0] == swarm.addr and doc["peer_id"] == swarm.addr.rsplit("/", 1)[-1]
    assert doc["step"] <= len(swarm.metrics()) + 1
    [peer] = doc["peers"]
    assert peer["role"] == "worker" and peer["price"] == 0.25 and peer["version"] >= 0
    assert 0.0 <= peer["newest_share"] <= 1.0 and peer["last_seen_s"] < 30
    assert peer["addr"].startswith("/ip4/127.0.0.1/tcp/") and peer["stale_dropped"] >= 0  # (tests.swarm: loopback)
    assert peer["observed"].startswith("/ip4/127.0.0.1/tcp/")  # where its requests come from
    assert peer["active"] is True and isinstance(peer["activity"], str)  # the only worker is never switched off
    res = run_cli("status", "--run-dir", str(swarm.run_dir))  # the tables
    assert res.returncode == 0 and peer["peer_id"][-8:] in res.stdout and "active" in res.stdout


def test_a_worker_whose_max_batch_is_below_the_group_size_stops_with_one_line(swarm):
    learner = swarm.learner("--steps", "1")  # group size 4
    worker = swarm.worker("small", "--max-batch", "2")
    assert worker.wait(120) == 2
    lines = [ln for ln in swarm.log("small").splitlines() if "max_batch" in ln]
    assert lines and "--max-batch 4" in lines[-1], swarm.log("small")[-2000:]
    assert learner.poll() is None  # the learner is not disturbed


def test_status_of_a_dead_learner_fails_within_its_timeout(tmp_path):
    from p2p.identity import new_identity, peer_id_of

    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id_of(new_identity())}"
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "echo_cli", "status", "--learner", nobody, "--timeout", "3"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    # one line: py-libp2p's own "Failed to open TCP stream" records stay out of the terminal (p2p.logs)
    assert res.returncode == 2 and len(lines) == 1 and "did not answer" in lines[0], res.stderr
    assert time.monotonic() - start < 45  # bounded (process start-up included), not a hang
    res = subprocess.run(
        [sys.executable, "-m", "echo_cli", "status", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 2 and "learner.addr does not exist" in res.stderr


def test_autoscale_switches_off_an_expensive_worker_that_is_not_needed(swarm):
    """SmolLM2 (the tiny model trains too fast for one worker ever to be enough): a cheap worker covers the
    learner's demand, so the expensive one is switched off, stays connected, and training goes on."""
    learner = swarm.learner(
        "--model", "smollm2-135m", "--steps", "8", "--prompts-per-step", "4", "--group-size", "8",
        "--max-new-tokens", "24", "--task-args", "ops=+", "--task-args", "max_value=20", "--lr", "2e-5",
        "--temperature", "0.8",
    )  # fmt: skip
    swarm.worker("cheap", "--price", "0.01", "--threads", "1")
    swarm.worker("pricey", "--price", "2.0", "--threads", "1")
    assert swarm.wait(learner, 900) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    off = [(m["step"], d) for m in metrics for d in m["decisions"] if not d["active"]]
    assert off, swarm.log("learner")[-3000:]
    step, decision = off[0]
    assert "not needed" in decision["reason"]
    pricey = decision["worker"]
    then = next(m for m in metrics if m["step"] == step)
    assert then["workers"][pricey]["price"] == 2.0  # the expensive one went, the cheap one stayed
    cheap = next(w for w in then["workers"] if w != pricey)
    assert then["workers"][cheap]["active"] and not then["workers"][pricey]["active"]
    # while off (until the end, or until the model finds it needed again on a loaded machine), the expensive
    # worker gets no new leases (one in flight may still land); it still follows versions
    back = [(m["step"], d) for m in metrics if m["step"] > step for d in m["decisions"] if d["worker"] == pricey]
    assert all(d["active"] and d["reason"].startswith("needed") for _, d in back[:1]), back
    until = back[0][0] if back else math.inf
    last_off = next(m for m in reversed(metrics) if m["step"] < until)
    assert last_off["workers"][pricey]["groups_accepted"] <= then["workers"][pricey]["groups_accepted"] + 1
    assert metrics[-1]["workers"][pricey]["version"] >= metrics[-1]["step"] - 2
    assert len(metrics) == 8


def test_lora_run_ships_only_adapters_to_remote_workers(swarm):
    """`--lora-rank`: one full snapshot, then adapter-only versions that both engines apply."""
    data = swarm.tmp / "short.jsonl"  # a reward the random tiny model earns half the time: it really trains
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": 40}) + "\n" for i in range(5)))
    task = ["--task", f"jsonl:{data}", "--task-args", "reward=tests.rewards:starts_ascii"]
    # --min-workers 2: no lease until both hold v0, else the first to start may do the whole run alone
    learner = swarm.learner("--steps", "30", "--lora-rank", "4", "--publish-every", "1", "--min-workers", "2", *task)
    workers = [swarm.worker("w2", "--engine", "transformers"), swarm.worker("w1")]
    assert swarm.wait(learner, 240) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    check_accounting(metrics, staleness=2)
    assert sum(m["trained_tokens"] for m in metrics) > 0
    accepted = {w: r["groups_accepted"] for w, r in metrics[-1]["workers"].items()}
    assert len(accepted) == 2 and min(accepted.values()) > 0, accepted  # both engines generated
    log = swarm.log("learner")
    assert "2 workers hold a policy version: leasing prompts" in log
    assert "published v0 (full-zstd" in log and "(LoRA adapters for v0" in log
    sizes = {int(v): b for m in metrics for v, b in m["version_bytes"].items()}
    assert max(b for v, b in sizes.items() if v > 0) < 0.2 * sizes[0]  # v0 is in step 1's metrics
    for w in ("w1", "w2"):
        assert re.search(r"now on v[1-9]", swarm.log(w)) and "Traceback" not in swarm.log(w)  # an adapter version
    for w in workers:
        w.send_signal(signal.SIGTERM)
    assert [w.wait(60) for w in workers] == [0, 0]


def test_a_reasoning_gym_task_trains_through_a_worker(swarm):
    """A reasoning-gym generator is a task like the built-in ones: the learner draws and scores its problems,
    a worker only completes prompts."""
    args = ["--task", "reasoning-gym:basic_arithmetic", "--task-args", "min_terms=2", "--task-args", "max_terms=2"]
    learner = swarm.learner("--steps", "2", "--max-new-tokens", "8", *args)
    swarm.worker("w1")
    assert swarm.wait(learner, 240) == 0, swarm.log("learner")[-3000:]
    metrics = swarm.metrics()
    assert len(metrics) == 2 and metrics[-1]["groups_accepted"] > 0 and metrics[-1]["groups_dropped_flagged"] == 0
    assert "Traceback" not in swarm.log("learner") and "Traceback" not in swarm.log("w1")
