"""Chaos: a hostile worker's attacks (tests/chaos/adversary.py) against a live learner process (tiny
model), one after another; then an honest llama.cpp worker trains, and the learner must be alive, still
stepping, and publishing finite weights."""

import time

from tests.chaos.adversary import Adversary, weights_finite


def test_a_hostile_worker_cannot_stall_or_corrupt_training(swarm):
    # the default verification: every attack comes from a fresh identity, whose groups are all verified
    learner = swarm.learner("--steps", "100000", "--read-timeout", "3", "--no-autoscale")
    adversary = Adversary(swarm.addr)
    try:
        outcomes = adversary.run(
            report=lambda o: print(f"\n{'ok  ' if o.ok else 'FAIL'} {o.name}: {o.observed} {o.details['penalties']}")
        )
        assert len(outcomes) >= 30
        assert [o.name for o in outcomes if not o.ok] == []
        assert learner.poll() is None, swarm.log("learner")[-3000:]

        # an honest worker trains after all that
        steps_before = len(swarm.metrics()) if (swarm.run_dir / "metrics.jsonl").exists() else 0
        swarm.worker("w1", "--max-groups", "1")
        deadline = time.monotonic() + 240
        while not (swarm.run_dir / "metrics.jsonl").exists() or len(swarm.metrics()) < steps_before + 3:
            assert learner.poll() is None, swarm.log("learner")[-3000:]
            assert time.monotonic() < deadline, swarm.log("learner")[-3000:]
            time.sleep(0.5)
        status = adversary.status()
        honest = [p for p in status["peers"] if p["peer_id"] not in {h.peer_id for h in adversary.hosts}]
        assert honest and all(p["flagged"] is None for p in honest)
        version, finite = weights_finite(adversary)
        print(f"\nafter the attacks: step {status['step']}, v{version} finite: {finite}; {status['penalties']}")
        assert finite and version >= 3
        assert all(m["skipped_updates"] == 0 for m in swarm.metrics())
    finally:
        adversary.close()
