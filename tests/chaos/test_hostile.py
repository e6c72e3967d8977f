"""Chaos: peers that send garbage, oversized frames, forged logprobs, other workers' leases, replays, or
hold streams open; workers without the swarm secret or off the allow-list. A real learner process
(tiny model) meets in-process hostile peers; honest llama.cpp workers must go on training."""

import os
import random
import struct
import time

import pytest
import torch
import zstandard
from transformers import AutoModelForCausalLM

from learner.publisher import wire_tensors
from learner.trainer import Rollout
from learner.verify import merged_weights, sampler_logprobs
from p2p.host import PeerUnavailable, RemoteError, Unauthorized, load_identity, peer_id_of
from p2p.messages import HEARTBEAT, LEASE, ROLLOUT, STATUS
from tests.chaos.hostile import hold_streams, hostile_host, send_raw


def lease_for(host, learner: str, version: int) -> dict:
    """Ask for a lease until one comes (bounded)."""
    for _ in range(100):
        reply = host.request(learner, LEASE, {"version": version, "max_groups": 1})
        if "lease" in reply:
            return reply["lease"]
        time.sleep(0.2)
    raise AssertionError(f"no lease: {reply}")


def rollout_payload(lease: dict, version: int, logprobs_of) -> dict:
    """Random completions for every group of `lease`, with logprobs from `logprobs_of(prompt, tokens)`."""
    rng = random.Random(lease["id"])
    groups = []
    for g in lease["groups"]:
        completions = []
        for _ in range(lease["group_size"]):
            tokens = [rng.randrange(3, 200) for _ in range(4)]
            completions.append({"tokens": tokens, "logprobs": logprobs_of(g["prompt_ids"], tokens), "finish": "length"})
        groups.append({"group": g["group"], "completions": completions})
    return {"lease": lease["id"], "version": version, "groups": groups}


def exact_logprobs(tiny):
    """The behaviour logprobs an honest sampler of v0 reports: the tiny model at its f16 wire weights."""
    model = AutoModelForCausalLM.from_config(tiny.model.config).float().eval()
    model.load_state_dict(merged_weights(wire_tensors(tiny.model, "f16"), None, 0.0), strict=False)

    def logprobs_of(prompt: list[int], tokens: list[int]) -> list[float]:
        with torch.no_grad():
            return sampler_logprobs(model, [Rollout(prompt, tokens, [], 0.0)], 1.0, 1.0)[0].tolist()

    return logprobs_of


def test_hostile_peers_are_refused_penalised_and_banned_while_training_goes_on(swarm, tiny):
    learner = swarm.learner("--steps", "100000", "--read-timeout", "3", "--no-autoscale")
    lid = swarm.addr.rsplit("/p2p/", 1)[-1]
    hosts = []

    def peer():
        h = hostile_host()
        h.connect(swarm.addr)
        hosts.append(h)
        return h

    try:
        # 1. broken frames: garbage, a header claiming 100 MB, a zstd bomb; then malformed requests
        junk = peer()
        assert send_raw(junk, lid, ROLLOUT, b"\x00\x00\x00\x10\x00" + os.urandom(16)) == "reset"
        assert send_raw(junk, lid, ROLLOUT, struct.pack(">IB", 100_000_000, 0)) == "reset"
        bomb = zstandard.ZstdCompressor().compress(b"\0" * 50_000_000)
        assert send_raw(junk, lid, ROLLOUT, struct.pack(">IB", len(bomb), 1) + bomb) == "reset"
        with pytest.raises(RemoteError, match="malformed|needs"):
            junk.request(lid, ROLLOUT, {"lease": "x", "version": 0, "groups": 1})
        with pytest.raises(RemoteError, match="integer version"):
            junk.request(lid, LEASE, {"version": "newest"})
        with pytest.raises(PeerUnavailable):  # five penalties within a minute: banned, streams reset unread
            junk.request(lid, HEARTBEAT, {}, timeout=5)

        # 2. someone else's lease, a replay: refused and penalised; the honest submission is accepted once
        honest = peer()
        assert honest.request(lid, HEARTBEAT, {"version": -1})["newest"] == 0
        lease = lease_for(honest, lid, 0)
        payload = rollout_payload(lease, 0, exact_logprobs(tiny))
        thief = peer()
        with pytest.raises(RemoteError, match="another worker"):
            thief.request(lid, ROLLOUT, payload)
        assert honest.request(lid, ROLLOUT, payload)["accepted"] == 1  # verified (a new worker's first groups)
        with pytest.raises(RemoteError, match="duplicate"):
            honest.request(lid, ROLLOUT, payload)

        # 3. forged logprobs: recomputed by the learner, the worker is flagged and gets no more work
        forger = peer()
        forged = rollout_payload(lease_for(forger, lid, 0), 0, lambda prompt, tokens: [-0.01] * len(tokens))
        with pytest.raises(RemoteError, match="flagged: logprobs diverge"):
            forger.request(lid, ROLLOUT, forged)
        with pytest.raises(RemoteError, match="flagged"):
            forger.request(lid, LEASE, {"version": 0, "max_groups": 1})

        # 4. a slow peer holding 40 request streams open: the 8 over the per-peer cap are reset at once,
        #    the rest after the 3 s read timeout; the learner answers others meanwhile
        slow = peer()
        ends = hold_streams(slow, lid, LEASE, 40, timeout=20)
        assert ends == ["reset"] * 40
        assert honest.request(lid, STATUS, {})["step"] == 0

        # 5. an honest worker trains while all that is remembered
        swarm.worker("w1", "--max-groups", "1")
        deadline = time.monotonic() + 180
        while not (swarm.run_dir / "metrics.jsonl").exists() or len(swarm.metrics()) < 3:
            assert learner.poll() is None, swarm.log("learner")[-3000:]
            assert time.monotonic() < deadline, swarm.log("learner")[-3000:]
            time.sleep(0.5)
        status = honest.request(lid, STATUS, {})
        penalties = status["penalties"]
        assert penalties["bad frame"] >= 3 and penalties["misbehaviour"] >= 4 and penalties["slow request"] >= 30
        assert junk.peer_id in status["banned"] and slow.peer_id in status["banned"]
        assert forger.peer_id in status["verification"]["flagged"]
        peers = {p["peer_id"]: p for p in status["peers"]}
        workers = [p for pid, p in peers.items() if pid not in {h.peer_id for h in hosts}]
        assert workers and all(p["flagged"] is None and p["verified"] >= 1 for p in workers)
        assert sum(p["groups_accepted"] for p in workers) >= 3
        verification = status["verification"]
        print(
            f"\npenalties {penalties}; banned {len(status['banned'])} peers; flagged: "
            f"{list(verification['flagged'].values())}; {verification['groups_checked']} groups verified, median "
            f"divergence {verification['divergence_median']:.5f}; {len(workers)} honest worker(s) trained "
            f"{status['step']} steps meanwhile"
        )
        assert verification["divergence_median"] < 0.02 < verification["divergence_max"]  # honest ones; the forger
    finally:
        for h in hosts:
            h.stop()


def test_only_workers_with_the_secret_or_on_the_allow_list_get_work(swarm, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple 42\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("a wrong secret of enough length\n")
    allowed_id = peer_id_of(load_identity(tmp_path / "good.key"))
    (tmp_path / "allow").write_text(
        f"# workers we know\n{allowed_id}\n{peer_id_of(load_identity(tmp_path / 'bad.key'))}\n"
    )
    learner = swarm.learner(
        "--steps", "3", "--secret-file", str(secret), "--allow", str(tmp_path / "allow"), "--no-autoscale"
    )  # fmt: skip
    swarm.worker("good", "--secret-file", str(secret))
    swarm.worker("bad", "--secret-file", str(wrong))  # on the list, wrong secret
    swarm.worker("stranger", "--secret-file", str(secret))  # right secret, not on the list
    lid = swarm.addr.rsplit("/p2p/", 1)[-1]
    outsider = hostile_host()
    try:
        outsider.connect(swarm.addr)
        assert outsider.request(lid, STATUS, {})["run_id"]  # status stays open, read-only
        with pytest.raises(Unauthorized):
            outsider.request(lid, LEASE, {"version": 0, "max_groups": 1})
        assert swarm.wait(learner, 240) == 0
        status_groups = {g for m in swarm.metrics() for g in m["workers"]}
        assert status_groups == {allowed_id[-8:]}, status_groups  # only the good worker ever worked
    finally:
        outsider.stop()
    assert "wrong swarm secret" in swarm.log("bad")
    assert "allow-list" in swarm.log("stranger")
    assert "now on v" not in swarm.log("bad") and "now on v" not in swarm.log("stranger")
