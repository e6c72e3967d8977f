"""Chaos: what a stranger in an open swarm (no secret, no allow-list, default settings) can do to a live learner
(tiny model): hoard leases, and buy accepted forgeries with fresh identities. docs/security.md has the threat
model; tests/chaos/adversary.py the attacks."""

import threading
import time

import pytest

from learner.orchestrate.verify import RolloutVerifier
from p2p.host import Host
from p2p.messages import Heartbeat, MessageError
from tests.chaos.adversary import Adversary, hoard_leases


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_declared_rates_below_any_hardware_are_refused_at_the_boundary(flush_denormal):
    """Also with flush-to-zero on, as the learner runs (a subnormal then compares equal to 0)."""
    import torch

    torch.set_flush_denormal(flush_denormal)
    try:
        for bad in (1e-307, 5e-324, 1e-4, float("nan"), -1.0, float("inf")):
            with pytest.raises(MessageError, match="tokens_per_s"):
                Heartbeat.from_wire({"version": 0, "tokens_per_s": bad})
    finally:
        torch.set_flush_denormal(False)
    assert Heartbeat.from_wire({"version": 0, "tokens_per_s": 0.0}).tokens_per_s == 0.0  # unmeasured
    assert Heartbeat.from_wire({"version": 0, "tokens_per_s": 2.5, "price": 5e-324}).price == 5e-324  # harmless


def test_verification_share_falls_with_accepted_work_and_never_below_the_floor():
    verifier = RolloutVerifier(lambda: None, 1.0, 1.0, first=8, fraction=0.05, tolerance=0.02, draw_tolerance=0.02)
    assert verifier.share("new") == 1.0 and all(verifier.wants("new") for _ in range(200))
    verifier.accepted("w", verified_groups=7, groups=7)
    assert verifier.share("w") == 1.0  # every group until 8 were verified
    verifier.accepted("w", verified_groups=1, groups=1)
    assert verifier.share("w") == 1.0  # 8 / 8
    verifier.accepted("w", verified_groups=0, groups=8)
    assert verifier.share("w") == 0.5
    verifier.accepted("w", verified_groups=4, groups=144)
    assert verifier.share("w") == 0.05  # 8 / 160
    verifier.accepted("w", verified_groups=0, groups=1000)
    assert verifier.share("w") == 0.05


def test_a_lease_hoarder_cannot_stall_training(swarm):
    """An identity that takes every lease it is offered and returns none: with a 600 s lease timeout its groups
    would hold the next batch for ten minutes if the batch counted on them. The honest worker trains on."""
    learner = swarm.learner("--steps", "100000", "--lease-timeout", "600", "--no-autoscale")
    hoarder = Host().start()
    stop, taken = threading.Event(), []
    thread = threading.Thread(target=hoard_leases, args=(hoarder, swarm.addr, stop, taken), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not taken:  # the hoarder holds a lease before the honest worker joins
            assert learner.poll() is None and time.monotonic() < deadline, swarm.log("learner")[-3000:]
            time.sleep(0.2)
        swarm.worker("w1", "--max-groups", "1")
        while not (swarm.run_dir / "metrics.jsonl").exists() or len(swarm.metrics()) < 8:
            assert learner.poll() is None, swarm.log("learner")[-3000:]
            assert time.monotonic() < deadline + 240, f"stalled by the hoarder:\n{swarm.log('learner')[-3000:]}"
            time.sleep(0.5)
        status = Adversary.read_status(hoarder, swarm.addr)
        mine = next(p for p in status["peers"] if p["peer_id"] == hoarder.peer_id)
        assert mine["open_leases"] == 1 and not mine["reliable"] and len(taken) > 1
        assert status["leases"]["abandoned"] >= len(taken) - 1  # each new lease gave up the last
        assert "Traceback" not in swarm.log("learner")
    finally:
        stop.set()
        thread.join(10)
        hoarder.stop()


def test_forged_groups_from_fresh_identities_are_never_trained_on(swarm):
    """100 forged groups, each from a fresh identity, with the default verification settings: random tokens with
    plausible logprobs, exact logprobs shifted by 0.1 nats, and text steered within the draw tolerance. Every
    one is refused (a new identity's groups are all verified), and the honest worker beside them trains."""
    learner = swarm.learner("--steps", "100000", "--no-autoscale")
    swarm.worker("w1", "--max-groups", "1")
    adversary = Adversary(swarm.addr)
    try:
        adversary.sync()
        answers = adversary.sybil([adversary.plausible, adversary.shifted, adversary.steered], groups=100)
        accepted = [a for a in answers if a.startswith("accepted")]
        assert len(answers) == 100 and accepted == [], accepted[:5]
        flagged = [a for a in answers if a.startswith("flagged")]
        assert len(flagged) >= 90, [a for a in answers if not a.startswith("flagged")][:5]  # a few too stale
        status = adversary.status()
        assert len(status["verification"]["flagged"]) >= len(flagged)
        honest = [p for p in status["peers"] if p["peer_id"] not in status["verification"]["flagged"]]
        assert any(p["groups_accepted"] > 0 for p in honest), status["peers"]
        assert learner.poll() is None and "Traceback" not in swarm.log("learner")
        record = swarm.metrics()[-1]
        print(
            f"\n100 forged groups from 100 identities: {len(flagged)} flagged, none accepted; {record['verification']}"
        )
    finally:
        adversary.close()


def test_text_cut_short_of_where_sampling_ends_is_flagged(swarm, tmp_path):
    """A completion must end at its first end-of-turn token or at the budget: a worker that cuts one a token
    short (every token of it replays exactly: the replay checks tokens, not where the text stops) is flagged,
    and the honest worker beside it trains."""
    learner = swarm.learner("--steps", "2")
    swarm.forger("truncate")
    swarm.worker("honest")
    assert swarm.wait(learner, 300) == 0, swarm.log("learner")[-3000:]
    text = " ".join(swarm.log("learner").split())
    assert "flagged: a completion stops before its end-of-turn token and its budget of 16 tokens" in text, text[-3000:]
    assert any(r["groups_accepted"] for r in swarm.metrics()[-1]["workers"].values())
