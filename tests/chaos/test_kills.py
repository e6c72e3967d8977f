"""Chaos: processes killed with SIGKILL at bad moments, and a worker's store damaged while it was down.
Real learner and llama.cpp worker processes on the tiny model."""

import signal
import time
from pathlib import Path

import pytest

from learner.orchestrate.journal import read_journal
from tests.test_distributed import check_accounting


def wait_for(condition, timeout: float, what: str, procs=()) -> None:
    """Wait for condition(); a process in `procs` that exits, or the timeout, fails the test with the tails of
    the processes' logs (what a CI failure needs to be understood)."""
    deadline = time.monotonic() + timeout
    while not condition():
        for name, proc in procs:
            assert proc.poll() is None, f"{name} exited while waiting for {what}{log_tails(procs)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}{log_tails(procs)}"
        time.sleep(0.05)


def log_tails(procs, chars: int = 2500) -> str:
    tails = []
    for name, proc in procs:
        path = getattr(proc, "log_path", None)
        if path is not None and Path(path).exists():
            text = Path(path).read_text(errors="replace")
            tails.append(f"\n--- {name}'s log, last {chars} characters ---\n{text[-chars:]}")
    return "".join(tails)


def steps_done(swarm) -> int:
    path = swarm.run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def used_groups(metrics: list[dict]) -> set[int]:
    return {g for m in metrics for g in m["batch_groups"] + m["set_aside_groups"]}


@pytest.mark.parametrize("secret", [False, True], ids=["open", "with-a-swarm-secret"])
def test_learner_killed_and_resumed_loses_no_accepted_rollout_or_step(swarm, secret):
    """With a swarm secret the restarted learner has forgotten who authenticated: the workers' first requests
    are refused until they authenticate again, and none of them may get a worker banned (#34 item 4)."""
    auth = ()
    if secret:
        (swarm.tmp / "swarm.secret").write_text("a-swarm-secret-of-the-test-run\n")
        auth = ("--secret-file", str(swarm.tmp / "swarm.secret"))
    args = ("--steps", "30", "--checkpoint-every", "4", *auth)
    learner = swarm.learner(*args)
    swarm.worker("w1", "--max-groups", "1", *auth)
    swarm.worker("w2", "--max-groups", "1", *auth)
    wait_for(lambda: steps_done(swarm) >= 6, 180, "6 steps", [("learner", learner)])
    learner.send_signal(signal.SIGKILL)
    learner.wait(10)

    before = swarm.metrics()
    checkpoint = max(int(p.name.split("-")[1]) for p in (swarm.run_dir / "checkpoints").glob("step-*"))
    journal = read_journal(swarm.run_dir, checkpoint)
    accepted = set(journal.groups) | used_groups([m for m in before if m["step"] <= checkpoint])
    journaled_steps = {s: r for s, r in journal.steps.items() if s > checkpoint}
    assert len(before) >= 6 and checkpoint >= 4 and accepted

    resumed = swarm.learner(*args, "--resume")  # workers find it again by themselves (same key and port)
    assert swarm.wait(resumed, 300) == 0, swarm.log("learner")[-3000:]
    after = swarm.metrics()
    assert [m["step"] for m in after] == list(range(1, 31))  # every step once
    for step, record in journaled_steps.items():  # steps trained but not checkpointed: trained again, same data
        assert after[step - 1]["replayed"] and after[step - 1]["batch_groups"] == record["batch"]
    for m in before:  # the steps the checkpoint covers are kept as they were
        if m["step"] <= checkpoint:
            assert after[m["step"] - 1]["batch_groups"] == m["batch_groups"]
    final = read_journal(swarm.run_dir, 30)
    lost = accepted - used_groups(after) - set(final.pending())
    stale = before[-1]["stale_dropped"] + after[-1]["stale_dropped"]
    assert len(lost) <= stale, f"accepted groups neither trained on, set aside, pending nor stale: {sorted(lost)}"
    print(
        f"\nlearner killed after step {len(before)} (checkpoint {checkpoint}): {len(journal.pending())} accepted "
        f"groups back in the buffer, {len(journaled_steps)} steps trained again on their journaled batches, "
        f"{len(journal.unreturned())} leased groups leased again; {len(accepted)} groups accepted before the kill, "
        f"{len(lost)} lost, {stale} dropped as stale"
    )
    last_workers = after[-1]["workers"]
    assert len(last_workers) == 2 and all(w["groups_accepted"] > 0 for w in last_workers.values())  # both came back
    assert "banned" not in swarm.log("learner")


def test_killed_worker_lease_is_reissued_and_late_joiner_catches_up(swarm):
    # the transformers engine is slow enough on long completions that a lease takes about a second. One
    # thread each: three processes on CI's two cores, and llama.cpp's threads spin while they wait for each
    # other, so two of them beside a busy transformers worker made a lease take a minute (every one late)
    learner = swarm.learner("--steps", "100000", "--lease-timeout", "4", "--max-new-tokens", "200")
    victim = swarm.worker("victim", "--engine", "transformers", "--max-groups", "2", "--threads", "1", "-v")
    swarm.worker("steady", "--engine", "transformers", "--max-groups", "1", "--threads", "1")
    deadline = time.monotonic() + 120
    while "lease " not in swarm.log("victim"):
        assert time.monotonic() < deadline and victim.poll() is None, swarm.log("victim")[-2000:]
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)  # mid-lease: it was generating
    while not (swarm.run_dir / "metrics.jsonl").exists() or not swarm.metrics():
        assert time.monotonic() < deadline and learner.poll() is None, swarm.log("learner")[-2000:]
        time.sleep(0.2)
    joined_at = len(swarm.metrics())  # training has begun
    swarm.worker("late", "--threads", "1")

    def late_versions() -> list[int]:
        lines = swarm.log("late").splitlines()
        return [int(line.split("now on v")[1].split()[0]) for line in lines if "now on v" in line]

    deadline = time.monotonic() + 240
    while True:
        assert learner.poll() is None, swarm.log("learner")[-3000:]
        assert time.monotonic() < deadline, swarm.log("late")[-2000:]
        metrics = swarm.metrics()
        expired = metrics[-1]["leases"]["expired"]
        if expired >= 1 and late_versions() and max(late_versions()) >= joined_at and len(metrics) >= joined_at + 5:
            break  # the victim's lease went to another worker, and the late worker caught up
        time.sleep(0.5)
    check_accounting(swarm.metrics(), 2)
    assert swarm.metrics()[-1]["leases"]["completed"] > 0


def corrupt_store(work_dir: Path) -> list[str]:
    """Flip bytes in one stored chunk and truncate another; returns what was damaged."""
    chunks = sorted((work_dir / "chunks").glob("v*/*.chunk"))
    assert len(chunks) >= 2, chunks
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    chunks[1].write_bytes(chunks[1].read_bytes()[: chunks[1].stat().st_size // 2])
    return [str(c) for c in chunks[:2]]


def test_worker_killed_mid_chunk_then_its_damaged_store_is_repaired(swarm):
    # a 30 kB/s learner uplink: the 0.2 MB first version takes seconds to arrive. One full snapshot (v0)
    # and deltas after it, so the store holds several chunks whenever it is killed (a newer snapshot
    # would let it drop all but one)
    learner = swarm.learner("--steps", "100000", "--upload-bps", "30000", "--full-every", "100000")
    victim = swarm.worker("victim", "-v")
    manifest = swarm.tmp / "victim" / "chunks" / "v0" / "manifest.msgpack"
    wait_for(manifest.exists, 120, "the victim to start fetching v0", [("victim", victim)])
    time.sleep(1.0)
    victim.send_signal(signal.SIGKILL)  # mid-chunk: it was receiving v0's only chunk
    victim.wait(10)
    assert "now on v0" not in swarm.log("victim") and not list(manifest.parent.glob("*.chunk"))

    swarm.worker("steady", "--max-groups", "1")
    wait_for(lambda: steps_done(swarm) >= 3, 180, "3 steps", [("learner", learner)])

    victim = swarm.worker("victim", "-v")  # same identity and store
    wait_for(
        lambda: swarm.log("victim").count("now on v") >= 3, 180, "the victim to follow versions", [("victim", victim)]
    )
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    damaged = corrupt_store(swarm.tmp / "victim")

    victim = swarm.worker(
        "victim2", "--identity", str(swarm.tmp / "victim.key"), "--work-dir", str(swarm.tmp / "victim")
    )
    wait_for(
        lambda: "now on v" in swarm.log("victim2"), 180, "the restarted victim to load a version", [("victim", victim)]
    )
    log = swarm.log("victim2")
    assert log.count("is corrupt or truncated") == 2 and "2 corrupt or truncated chunks deleted" in log, damaged
    assert "chunks kept" in log
    steps = steps_done(swarm)
    wait_for(lambda: steps_done(swarm) >= steps + 3, 120, "3 more steps", [("learner", learner)])
    assert learner.poll() is None
    store_line = next(line for line in log.splitlines() if "store: " in line)
    print(
        f"\nvictim killed mid-chunk, no chunk stored; restarted after damage: {store_line.split('store: ')[1].strip()}"
    )


def test_a_worker_that_sleeps_past_the_learners_patience_comes_back(swarm):
    """A laptop that sleeps (#34 item 4): the worker is frozen (SIGSTOP) for three times as long as the learner
    waits for a silent worker; woken, it picks up where it was (a lease it held may have expired and gone to
    the other worker) and has rollouts accepted again, without a stack trace on either side."""
    learner = swarm.learner("--steps", "100000", "--worker-silence", "4", "--no-autoscale")
    sleeper = swarm.worker("sleeper", "--max-groups", "1", "-v")
    awake = swarm.worker("awake", "--max-groups", "1")
    procs = [("learner", learner), ("sleeper", sleeper), ("awake", awake)]
    sleeper_id = swarm.tmp / "sleeper.key"

    def accepted() -> int:
        from p2p.identity import load_identity, peer_id_of

        short = peer_id_of(load_identity(sleeper_id))[-8:]
        if not steps_done(swarm):
            return 0
        return swarm.metrics()[-1]["workers"].get(short, {}).get("groups_accepted", 0)

    wait_for(lambda: accepted() > 0, 240, "the sleeper's first rollouts", procs)
    sleeper.send_signal(signal.SIGSTOP)
    try:
        time.sleep(12.0)  # three times the learner's patience; the awake worker keeps it training
        before = accepted()
    finally:
        sleeper.send_signal(signal.SIGCONT)
    wait_for(lambda: accepted() > before, 240, "the sleeper's rollouts after it woke", procs)
    assert "Traceback" not in swarm.log("sleeper") and "Traceback" not in swarm.log("learner")
