"""The swarm's peer list (/echo/join/1), attacked: what a joiner announces is checked, dialled back before it
is handed out, and forgotten when the joiner goes silent or is banned; a worker dials the list in the
background and never fails on a bad entry. Real libp2p hosts on 127.0.0.1 only.

Nothing here waits on a wall-clock threshold: silent addresses are sockets that accept and never speak, with
timeouts longer than the test, so a dial to one ends only when the test closes it; silence is measured on a
clock the test moves."""

import select
import socket
from collections.abc import Iterator

import pytest
from libp2p.crypto.ed25519 import Ed25519PrivateKey

import p2p.broadcast
from p2p.auth import AUTH, SwarmAuth
from p2p.broadcast import HAVE, JOIN, BroadcastPeer, ChunkStore, Seeder
from p2p.host import Host, HostConfig, RemoteError
from p2p.identity import peer_id_of
from p2p.messages import SPEC, ModelSpec, SpecReply
from worker.config import WorkerConfig
from worker.daemon import WorkerDaemon
from worker.engines.hf import TransformersEngine

WAIT = 60.0  # seconds any wait below may take on a loaded machine before the test fails (never reached)


@pytest.fixture
def hosts() -> Iterator:
    started: list[Host] = []

    def make(config: HostConfig | None = None) -> Host:
        host = Host(Ed25519PrivateKey.new(), config).start()
        started.append(host)
        return host

    yield make
    for host in started:
        host.stop()


@pytest.fixture
def seeders() -> Iterator:
    made: list[Seeder] = []

    def make(host: Host, **kw) -> Seeder:
        seeder = Seeder(host, ChunkStore(), **kw)
        made.append(seeder)
        return seeder

    yield make
    for seeder in made:
        seeder.close()


class SilentPort:
    """A loopback port that accepts TCP connections and never says a word: a dial to it hangs until its
    own timeout, or until close() resets the connections it holds."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def dialled(self, timeout: float = WAIT) -> bool:
        """Whether somebody connected (a pending connection makes the listening socket readable)."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        self.sock.close()


def closed_port() -> int:
    """A loopback port nothing listens on (a dial to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Clock:
    """A clock the test moves (Seeder measures silence on it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def listed(host: Host, learner: Host) -> dict:
    """The peer list the learner hands `host` when it joins (announcing its real addresses)."""
    return host.request(learner.addrs[0], JOIN, {"addrs": host.addrs}, timeout=WAIT)["peers"]


def test_bad_announcements_are_refused_with_a_penalty_and_never_listed(hosts, seeders):
    learner = hosts(HostConfig(ban_after=1000))  # count the penalties without banning the attacker
    seeder = seeders(learner)
    attacker, other, honest, later = hosts(), hosts(), hosts(), hosts()
    own = attacker.addrs[0]
    port = own.split("/tcp/")[1].split("/")[0]
    bad = {
        "no /p2p/": [f"/ip4/127.0.0.1/tcp/{port}"],
        "another peer's id": [f"/ip4/127.0.0.1/tcp/{port}/p2p/{other.peer_id}"],
        "not tcp": [f"/ip4/127.0.0.1/udp/{port}/quic-v1/p2p/{attacker.peer_id}"],
        "no transport": [f"/ip4/127.0.0.1/p2p/{attacker.peer_id}"],
        "nine addresses": [f"/ip4/127.0.0.1/tcp/{1000 + i}/p2p/{attacker.peer_id}" for i in range(9)],
        "a good one and a bad one": [own, f"/ip4/127.0.0.1/tcp/{port}"],
        "port 0": [f"/ip4/127.0.0.1/tcp/0/p2p/{attacker.peer_id}"],
        "not a multiaddr": ["not an address"],
        "too long": [f"/dns4/{'x' * 300}/tcp/1/p2p/{attacker.peer_id}"],
        "not strings": [1, 2],
        "not a list": own,
        "nothing": None,
    }
    for why, addrs in bad.items():
        before = learner.guard.counts.get("misbehaviour", 0)
        with pytest.raises(RemoteError) as refused:
            attacker.request(learner.addrs[0], JOIN, {"addrs": addrs}, timeout=WAIT)
        assert type(refused.value) is RemoteError and str(refused.value).startswith("join:"), why  # not internal
        assert learner.guard.counts.get("misbehaviour", 0) == before + 1, why
    assert attacker.peer_id not in seeder.peers

    assert listed(honest, learner) == {}  # an honest worker on 127.0.0.1 passes the dial-back
    assert seeder.dial_back.wait_idle(WAIT)
    assert listed(later, learner) == {honest.peer_id: [honest.addrs[0]]} and seeder.listed(honest.peer_id)
    assert learner.guard.counts.get("misbehaviour", 0) == len(bad)  # honest joins cost nothing


def test_silent_addresses_are_dialled_back_in_the_background_and_never_handed_out(hosts, seeders):
    learner = hosts()
    seeder = seeders(learner)
    seeder.dial_back.timeout = 10 * WAIT  # a dial-back to a silent port ends only when the test closes it
    attacker, later = hosts(), BroadcastPeer(hosts(), ChunkStore(), learner.addrs[0])
    dialled = []
    real_connect = later.host.connect
    later.host.connect = lambda addr, timeout=10.0: dialled.append(addr) or real_connect(addr, timeout)
    silent = [SilentPort() for _ in range(4)]
    try:
        addrs = [f"/ip4/127.0.0.1/tcp/{s.port}/p2p/{attacker.peer_id}" for s in silent]
        addrs += [f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{attacker.peer_id}" for _ in range(4)]
        reply = attacker.request(learner.addrs[0], JOIN, {"addrs": addrs}, timeout=WAIT)
        assert reply["peers"] == {} and reply["reached"] is None  # no verdict yet: the dial-backs hang
        assert seeder.dial_back.pending >= 4  # the join was answered while its silent addresses hang
        assert all(s.dialled() for s in silent)  # the learner did dial them back
        later.join()  # while they hang: nothing of the attacker's is handed out
        assert attacker.peer_id not in later.peers and later.dials_pending == 0
    finally:
        for s in silent:
            s.close()
    assert seeder.dial_back.wait_idle(WAIT)  # every dial-back failed
    again = attacker.request(learner.addrs[0], JOIN, {"addrs": addrs}, timeout=WAIT)  # joining again changes
    assert seeder.dial_back.pending == 0  # nothing: failed addresses are not dialled back again at once
    assert again["reached"] is False and seeder.registry.reach(attacker.peer_id) == "nat"  # as if behind a NAT
    assert seeder.registry.behind_nat(later.host.peer_id) == [attacker.peer_id]
    later.join()
    assert later.wait_dials(WAIT)
    assert later.peers == {} and not [a for a in dialled if attacker.peer_id in a]
    assert seeder.peers[attacker.peer_id] == addrs and seeder.listed(attacker.peer_id) == []  # announced, not listed
    assert later.host.peer_id in seeder.peers


def test_a_silent_peer_and_a_banned_peer_leave_the_list(hosts, seeders):
    clock = Clock()
    learner = hosts()
    seeder = seeders(learner, silence=30.0, clock=clock)
    stopping, talking, asker = hosts(), hosts(), hosts()
    listed(stopping, learner)
    listed(talking, learner)
    assert seeder.dial_back.wait_idle(WAIT)
    assert set(listed(asker, learner)) == {stopping.peer_id, talking.peer_id}

    clock.now += 20
    talking.request(learner.peer_id, HAVE, {"version": 0}, timeout=WAIT)  # any request keeps a peer listed
    stopping.stop()
    clock.now += 20  # stopping: silent for 40 s; talking: for 20 s
    assert set(listed(asker, learner)) == {talking.peer_id}
    assert stopping.peer_id not in seeder.peers

    for _ in range(learner.config.ban_after):
        learner.guard.penalise(talking.peer_id, "test")
    assert listed(asker, learner) == {}
    assert talking.peer_id not in seeder.peers and asker.peer_id in seeder.peers


def tiny_spec() -> ModelSpec:
    return ModelSpec(
        name="tiny", vocab_size=4, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4, max_position=64, tie_embeddings=True, bos_id=0, eos_ids=[1],
        tokens=["a", "b", "c", "d"], token_types=[1, 1, 1, 1], merges=[],
    )  # fmt: skip


def test_the_worker_gets_the_spec_at_once_and_survives_a_garbage_peer_list(hosts, monkeypatch):
    """The daemon's own join path against a learner whose peer list is garbage, with a peer that never answers:
    the spec arrives while that dial hangs, and no entry raises."""
    monkeypatch.setattr(p2p.broadcast, "DIAL_TIMEOUT", 10 * WAIT)  # the silent peer's dial ends when we close it
    learner, good = hosts(), hosts()
    silent, silent_id = SilentPort(), peer_id_of(Ed25519PrivateKey.new())
    closed_id, port = peer_id_of(Ed25519PrivateKey.new()), good.addrs[0].split("/tcp/")[1].split("/")[0]
    garbage = {
        silent_id: [f"/ip4/127.0.0.1/tcp/{silent.port}/p2p/{silent_id}"],
        good.peer_id: ["not a multiaddr", f"/ip4/127.0.0.1/tcp/{port}", good.addrs[0]],
        closed_id: [f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{closed_id}"],
        "not a peer id": [f"/ip4/127.0.0.1/tcp/{port}/p2p/not a peer id"],
        peer_id_of(Ed25519PrivateKey.new()): [good.addrs[0]],  # good's address under another id: not dialled
        peer_id_of(Ed25519PrivateKey.new()): "a string",
        peer_id_of(Ed25519PrivateKey.new()): [None, 3, b"bytes"],
        peer_id_of(Ed25519PrivateKey.new()): None,
    }
    learner.handle(AUTH, SwarmAuth(learner.peer_id).on_auth, guarded=False)
    learner.handle(JOIN, lambda peer, msg: {"peers": garbage})
    learner.handle(SPEC, lambda peer, msg: SpecReply("run", tiny_spec(), 2).to_wire())
    daemon = WorkerDaemon(WorkerConfig(learner=learner.addrs[0], poll_s=30.0))
    daemon.host, daemon.engine = hosts(), TransformersEngine(threads=1)  # it checks it can run the spec
    daemon.peer = BroadcastPeer(daemon.host, ChunkStore(), learner.addrs[0])
    try:
        daemon._join()
        assert daemon.spec == tiny_spec() and daemon.run_id == "run"
        assert daemon.peer.dials_pending >= 1 and silent.dialled()  # joined while the silent peer's dial hangs
        assert daemon.peer.wait_for_peers(1, WAIT) and good.peer_id in daemon.peer.peers
        stranger, me = peer_id_of(Ed25519PrivateKey.new()), daemon.host.peer_id
        for bad in (None, [], "x", {1: 2}, {stranger: {"a": 1}}, {me: daemon.host.addrs}):
            daemon.peer.refresh_peers(bad)  # never raises
    finally:
        silent.close()
        if daemon.fetcher is not None:
            daemon.fetcher.stop()
    assert daemon.peer.wait_dials(WAIT)
    assert daemon.peer.peers == {}  # the last lists did not name the good peer: it left, and is no longer asked
