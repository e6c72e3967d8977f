"""The pieces of #7 in isolation: auth proofs, penalties and bans, the rollout journal, verification
arithmetic, and a worker store checked at start."""

import time

import msgpack
import pytest
import torch
from libp2p.crypto.ed25519 import Ed25519PrivateKey

from learner.orchestrate.journal import FRAME, RolloutJournal, group_of, read_journal, read_records
from learner.orchestrate.replay_torch import replay_sampling
from learner.orchestrate.rollouts import Rollout, ScoredGroup
from learner.orchestrate.verify import CAP, divergence
from p2p.auth import SwarmAuth, proof, read_allow_list, read_secret
from p2p.broadcast import ChunkStore
from p2p.config import ConfigError
from p2p.guard import PeerGuard
from p2p.host import BadRequest, Misbehaviour
from p2p.identity import peer_id_of
from p2p.versions import build_version

LEARNER, WORKER, OTHER = (peer_id_of(Ed25519PrivateKey.new()) for _ in range(3))


def test_a_proof_is_bound_to_its_nonce_and_both_peers():
    secret = b"s" * 20
    auth = SwarmAuth(LEARNER, secret=secret)
    nonce = auth.on_auth(WORKER, {})["nonce"]
    with pytest.raises(Misbehaviour, match="wrong swarm secret"):
        auth.on_auth(WORKER, {"nonce": nonce, "proof": proof(b"x" * 20, nonce, LEARNER, WORKER)})
    assert not auth.allows(WORKER)
    nonce = auth.on_auth(WORKER, {})["nonce"]
    stolen = proof(secret, nonce, LEARNER, WORKER)
    with pytest.raises(BadRequest, match="nonce"):  # another peer replaying a proof it overheard
        auth.on_auth(OTHER, {"nonce": nonce, "proof": stolen})
    nonce = auth.on_auth(WORKER, {})["nonce"]
    assert auth.on_auth(WORKER, {"nonce": nonce, "proof": proof(secret, nonce, LEARNER, WORKER)}) == {"ok": True}
    assert auth.allows(WORKER) and not auth.allows(OTHER)
    with pytest.raises(BadRequest, match="nonce"):  # a nonce is good once
        auth.on_auth(WORKER, {"nonce": nonce, "proof": proof(secret, nonce, LEARNER, WORKER)})


def test_allow_list_alone_and_bad_files(tmp_path):
    auth = SwarmAuth(LEARNER, allow={WORKER})
    assert auth.allows(WORKER) and not auth.allows(OTHER)
    with pytest.raises(Misbehaviour, match="allow-list"):
        auth.on_auth(OTHER, {})
    path = tmp_path / "allow"
    path.write_text(f"{WORKER}  # mine\n\nnot-a-peer-id\n")
    with pytest.raises(ConfigError, match="allow:3: 'not-a-peer-id' is not a peer id"):
        read_allow_list(path)
    path.write_text(f"{WORKER}\n")
    assert read_allow_list(path) == {WORKER}
    (tmp_path / "short").write_text("1234\n")
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret(tmp_path / "short")
    with pytest.raises(ConfigError, match="does not exist"):
        read_secret(tmp_path / "missing")
    assert not SwarmAuth(LEARNER).enabled and SwarmAuth(LEARNER).allows(OTHER)


def test_penalties_ban_a_peer_for_a_while_and_are_forgotten():
    guard = PeerGuard(ban_after=3, ban_window=60, ban_seconds=0.3)
    guard.penalise(WORKER, "bad frame")
    guard.penalise(WORKER, "bad frame")
    assert not guard.banned(WORKER)
    guard.penalise(WORKER, "misbehaviour")
    assert guard.banned(WORKER) and not guard.banned(OTHER) and guard.banned_peers() == [WORKER]
    time.sleep(0.35)
    assert not guard.banned(WORKER) and guard.bans == 1
    assert guard.counts == {"bad frame": 2, "misbehaviour": 1}


def test_a_worker_of_a_restarted_learner_is_not_banned_for_its_requests_before_it_authenticates():
    """A learner with a swarm secret restarts and forgets who authenticated: the worker's heartbeat, have-map
    trades and claims are refused until it authenticates again. Each weighs a tenth of a penalty (before:
    one each, and five meant a 120 s ban); fifty in the ban window still ban a peer that only pesters."""
    from p2p.host import UNAUTHORIZED_WEIGHT, Host, Unauthorized

    learner, worker = Host().start(), Host().start()
    try:
        learner.gate = lambda peer: False  # nobody has authenticated with this run of the learner
        learner.handle("/echo/test/1", lambda peer, msg: {"ok": True})
        for _ in range(20):
            with pytest.raises(Unauthorized):
                worker.request(learner.addrs[0], "/echo/test/1", {})
        assert not learner.guard.banned(worker.peer_id) and learner.guard.counts == {"unauthorized": 20}
        learner.gate = lambda peer: True  # it authenticated
        assert worker.request(learner.peer_id, "/echo/test/1", {}) == {"ok": True}
    finally:
        worker.stop()
        learner.stop()
    guard = PeerGuard(ban_after=5, ban_window=60, ban_seconds=60)
    for _ in range(round(5 / UNAUTHORIZED_WEIGHT)):
        guard.penalise(OTHER, "unauthorized", UNAUTHORIZED_WEIGHT)
    assert guard.banned(OTHER)


def group(group_id: int, version: int, worker: str = WORKER) -> ScoredGroup:
    return ScoredGroup(group_id, version, worker, [Rollout([1, 2], [3, 4], [-0.5, -0.25], 1.0, 0.5, version)])


def test_journal_replays_pending_groups_steps_and_unreturned_leases(tmp_path):
    journal = RolloutJournal(tmp_path, staleness=1, fsync=False)
    journal.open(0)
    journal.issue([0, 1, 2, 3])
    journal.accept([group(g, 0) for g in (0, 1, 2)])
    assert journal.step(1, [group(0, 0)], [group(1, 0)]) == []
    journal.checkpointed(1)  # a new file with only what is still pending
    journal.issue([4])
    journal.accept([group(4, 1)])
    assert journal.step(2, [group(4, 1)], []) == []
    journal.accept([group(5, 0)])  # late: version 0 is stale at step 3 (version 2, S = 1)
    assert journal.step(3, [], []) == [2, 5]
    journal.accept([group(6, 2)])
    journal.close()
    assert [p.name for p in (tmp_path / "journal").iterdir()] == ["000001.log"]

    state = read_journal(tmp_path, 1)
    assert state.pending() == [6] and state.unreturned() == [3] and state.next_group == 5
    assert sorted(state.steps) == [2, 3] and state.steps[2]["batch"] == [4]
    restored = group_of(state.groups[6])
    assert restored.rollouts[0].behaviour_logprobs == [-0.5, -0.25] and restored.version == 2

    # a record torn by a kill is ignored; the complete ones before it count
    path = tmp_path / "journal" / "000001.log"
    body = msgpack.packb({"t": "group", "group": 7}, use_bin_type=True)
    path.write_bytes(path.read_bytes() + FRAME.pack(len(body), 0) + body[:3])
    records, torn = read_records(path)
    assert torn > 0 and read_journal(tmp_path, 1).pending() == [6]
    # resuming rewrites the file from the state: steps after the checkpoint are kept for training again
    journal = RolloutJournal(tmp_path, staleness=1, fsync=False)
    journal.open(1, read_journal(tmp_path, 1))
    journal.close()
    again = read_journal(tmp_path, 1)
    assert again.pending() == [6] and sorted(again.steps) == [2, 3] and again.unreturned() == [3]


def test_divergence_takes_the_closest_nucleus_and_caps_each_token(tiny):
    recomputed = torch.tensor([[-1.0, -2.0, -torch.inf], [-1.0, -2.0, -3.0]], dtype=torch.float64)
    assert divergence([-1.0, -2.0, -3.0], recomputed) == 0.0
    assert divergence([-1.0, -2.0, -3.0], recomputed[:1]) == pytest.approx(CAP / 3)
    assert divergence([0.0, 0.0, 0.0], recomputed[1:]) == pytest.approx(2.0)
    batch = [Rollout([1, 5, 9], [7, 8, 9, 10], [], 0.0)]
    model = tiny.model.float().eval()
    with torch.no_grad():
        full, _ = replay_sampling(model, batch, 1.0, 1.0)  # [1, 4]
        nucleus, _ = replay_sampling(model, batch, 1.0, 0.5)  # [2, 4]
    assert full.shape == (1, 4) and nucleus.shape == (2, 4)
    kept = torch.isfinite(nucleus[0])
    assert (nucleus[0][kept] >= full[0][kept]).all()  # renormalised over a smaller set: more likely


def test_worker_store_is_checked_at_start(tmp_path):
    key = Ed25519PrivateKey.new()
    learner = peer_id_of(key)
    import numpy as np

    tensors = {"w": np.random.default_rng(0).standard_normal(300_000).astype(np.float16)}
    pv, _ = build_version("run", 0, tensors, chunk_size=100_000)
    pv.manifest = pv.manifest.signed(key, learner)
    store = ChunkStore(tmp_path, persist=True)
    store.add_version(pv)
    assert len(store.held(0)) == len(pv.chunks) >= 4
    chunks = sorted((tmp_path / "v0").glob("*.chunk"))
    chunks[0].write_bytes(b"\0" + chunks[0].read_bytes()[1:])  # corrupt
    chunks[1].write_bytes(chunks[1].read_bytes()[:10])  # truncated
    (tmp_path / "v0" / "000002.chunk.tmp").write_bytes(b"half a write")

    again = ChunkStore(tmp_path, persist=True)
    assert again.recover(learner) == {"versions": 1, "chunks": len(pv.chunks) - 2, "corrupt": 2}
    assert again.held(0) == set(range(2, len(pv.chunks)))
    assert not list((tmp_path / "v0").glob("*.tmp"))
    assert ChunkStore(tmp_path, persist=True).recover(peer_id_of(Ed25519PrivateKey.new()))["versions"] == 0
    assert not (tmp_path / "v0").exists()  # signed by someone else: deleted
