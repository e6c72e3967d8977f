import time

import pytest

from learner.orchestrate.leases import LeaseError, LeaseTable
from learner.orchestrate.replay import ReplayBuffer
from learner.orchestrate.rollouts import Rollout, ScoredGroup
from p2p.broadcast import ChunkStore


def test_leases_expire_and_their_groups_are_reissued_first_to_a_reliable_worker():
    table = LeaseTable(timeout_s=0.05)
    table.complete(table.issue("w2", 1, min_version=0).lease_id, "w2")  # w2 delivered: reliable
    a = table.issue("w1", 2, min_version=0, timeout_s=0.05)
    assert a.group_ids == [1, 2]
    time.sleep(0.1)
    assert table.issue("w3", 1, min_version=0).group_ids == [3]  # a worker that never delivered: new groups
    b = table.issue("w2", 3, min_version=0)
    assert b.group_ids == [1, 2, 4]  # w1's expired groups first, then a new one
    with pytest.raises(LeaseError, match="late"):
        table.complete(a.lease_id, "w1")
    assert table.counters.expired == 1 and table.counters.refused == {"late": 1}
    assert not table.is_reliable("w1") and table.is_reliable("w2")


def test_one_live_lease_per_worker_and_only_reliable_ones_are_counted():
    """A worker that asks again gives up the lease it holds; a lease counts towards the next batch only from a
    worker whose last lease came back, and only until it is due."""
    table = LeaseTable(timeout_s=60)
    first = table.issue("hoarder", 2, min_version=0)
    second = table.issue("hoarder", 2, min_version=0)
    assert table.open_leases() == {"hoarder": 1} and table.abandoned == 1
    assert second.group_ids == [2, 3] and table.owed_groups() == 0 and table.unproven_groups() == 2
    assert table.unproven_groups(besides="hoarder") == 0
    with pytest.raises(LeaseError, match="late"):  # given up: its groups are someone else's now
        table.complete(first.lease_id, "hoarder")

    honest = table.issue("honest", 1, min_version=0)
    table.complete(honest.lease_id, "honest")
    counted = table.issue("honest", 2, min_version=0, due_s=0.05)
    assert counted.group_ids == [0, 1]  # the hoarder's given-up groups go to the reliable worker
    assert table.owed_groups() == 2
    time.sleep(0.1)
    assert table.owed_groups() == 0  # overdue: the batch no longer waits for it
    table.complete(counted.lease_id, "honest")  # but a late submission is still taken
    table.release(table.complete(table.issue("honest", 1, min_version=0).lease_id, "honest"))
    assert not table.is_reliable("honest")  # a refused submission: unreliable until one is accepted


def test_duplicate_foreign_and_unknown_submissions_are_refused():
    table = LeaseTable(timeout_s=60)
    lease = table.issue("w1", 1, min_version=0)
    with pytest.raises(LeaseError, match="another worker"):
        table.complete(lease.lease_id, "w2")
    table.complete(lease.lease_id, "w1")
    with pytest.raises(LeaseError, match="duplicate"):
        table.complete(lease.lease_id, "w1")
    with pytest.raises(LeaseError, match="unknown"):
        table.complete(12345, "w1")
    assert table.counters.refused == {"not_owner": 1, "duplicate": 1, "unknown": 1}


def group(gid, version):
    return ScoredGroup(gid, version, "w", [])


def test_replay_buffer_respects_staleness_and_counts_drops():
    buf = ReplayBuffer(staleness=1)
    for gid, version in [(0, 3), (1, 4), (2, 5), (3, 5)]:
        buf.add(group(gid, version))
    batch, set_aside = buf.take(2, version=5, timeout=0.1)
    assert set_aside == []
    assert [g.group_id for g in batch] == [1, 2]  # v3 is 2 behind: dropped; oldest usable first
    assert buf.dropped_stale == 1 and len(buf) == 1
    assert buf.take(2, version=5, timeout=0.05) is None  # only one usable group left
    assert buf.added == buf.consumed + len(buf) + buf.dropped_stale
    assert buf.staleness_histogram(batch, 5) == {"0": 1, "1": 1}


def scored(gid, version, rewards):
    return ScoredGroup(gid, version, "w", [Rollout([1], [2], [0.0], r) for r in rewards])


def test_dynamic_sampling_sets_aside_groups_without_signal():
    buf = ReplayBuffer(staleness=0, dynamic_sampling=True, rounds=3)
    buf.add(scored(0, 1, [1.0, 1.0]))  # all correct: no signal
    buf.add(scored(1, 1, [0.0, 1.0]))
    buf.add(scored(2, 1, [0.0, 0.0]))  # all wrong: no signal
    assert len(buf) == 1 and buf.take(2, version=1, timeout=0.05) is None  # one group with signal of two
    buf.add(scored(3, 1, [1.0, 0.0]))
    batch, set_aside = buf.take(2, version=1, timeout=0.1)
    assert [g.group_id for g in batch] == [1, 3] and [g.group_id for g in set_aside] == [0, 2]
    assert buf.set_aside == 2 and buf.signal_share < 1.0

    # the policy solves everything: after rounds * n groups it trains on what signal there is
    for gid in range(10, 15):
        buf.add(scored(gid, 1, [1.0, 1.0]))
    assert buf.take(2, version=1, timeout=0.05) is None
    buf.add(scored(15, 1, [1.0, 1.0]))
    batch, set_aside = buf.take(2, version=1, timeout=0.1)
    assert batch == [] and len(set_aside) == 6

    # set-aside groups obey the staleness bound too
    buf.add(scored(20, 1, [1.0, 1.0]))
    buf.add(scored(21, 2, [0.0, 1.0]))
    buf.add(scored(22, 2, [0.0, 1.0]))
    batch, set_aside = buf.take(2, version=2, timeout=0.1)
    assert [g.group_id for g in batch] == [21, 22] and set_aside == [] and buf.dropped_stale == 1
    assert buf.added == buf.consumed + buf.set_aside + buf.held + buf.dropped_stale


def test_chunk_store_spills_to_disk(tmp_path):
    store = ChunkStore(spill_dir=tmp_path, memory_budget=10)
    store.put(1, 0, b"12345678")
    store.put(1, 1, b"abcdefgh")  # over the budget: written to disk
    assert store.memory_used == 8
    assert store.get(1, 1) == b"abcdefgh" and (tmp_path / "v1" / "000001.chunk").exists()
    assert store.held(1) == {0, 1}
    store.drop(1)
    assert store.held(1) == set() and not (tmp_path / "v1" / "000001.chunk").exists()
