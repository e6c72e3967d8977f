"""Chaos on the network: a peer that serves corrupted chunks, and a worker cut off from the learner
(through a TCP relay we cut) while its peers can still reach it."""

import os
import re
import socket
import threading

from libp2p.crypto.ed25519 import Ed25519PrivateKey

from p2p.broadcast import HAVE, MANIFEST, ChunkServer, ChunkStore, bitmap
from p2p.host import PeerUnavailable, RemoteError
from p2p.manifest import Manifest
from tests.chaos.hostile import hostile_host
from tests.chaos.test_kills import steps_done, wait_for


class CorruptingStore(ChunkStore):
    """Claims to hold every chunk of every version it has a manifest of, and serves random bytes."""

    def held(self, version: int) -> set[int]:
        manifest = self.manifests.get(version)
        return set(range(len(manifest.chunks))) if manifest else set()

    def get(self, version: int, index: int) -> bytes | None:
        manifest = self.manifests.get(version)
        return os.urandom(manifest.chunks[index][1]) if manifest else None


def test_a_peer_serving_corrupted_chunks_is_penalised_and_avoided(swarm):
    # the liar advertises every chunk of each new version to the workers it is connected to, over and over,
    # as an attacker that wants to be asked would; the learner's uplink is slow, so a worker waiting on its
    # claim asks the liar too (p2p.broadcast: chunks some peer holds are asked of peers as well)
    learner = swarm.learner("--steps", "100000", "--upload-bps", "30000")
    lid = swarm.addr.rsplit("/p2p/", 1)[-1]
    evil = hostile_host(Ed25519PrivateKey.new())
    stop = threading.Event()
    store = CorruptingStore()
    ChunkServer(evil, store)

    def advertise() -> None:  # learn every new version, and say we hold all of it
        while not stop.is_set():
            try:
                m = Manifest.from_dict(evil.request(lid, MANIFEST, {}, timeout=5)["manifest"])
                store.add_manifest(m)
                have = {"version": m.version, "have": bitmap(set(range(len(m.chunks))), len(m.chunks)),
                        "run_id": m.run_id, "full": m.base_version is None}  # fmt: skip
                for peer in evil.connected_peers():
                    if peer != lid:
                        evil.request(peer, HAVE, have, timeout=5)
            except (PeerUnavailable, RemoteError):
                pass
            stop.wait(0.1)

    threading.Thread(target=advertise, daemon=True).start()
    try:
        evil.request(swarm.addr, "/echo/join/1", {"addrs": evil.addrs})  # the learner tells workers about us
        worker = swarm.worker("w1", "--max-groups", "1", "-v")
        wait_for(lambda: steps_done(swarm) >= 8, 240, "8 steps", [("learner", learner), ("worker", worker)])
        log = swarm.log("w1")
        assert "failed its hash check; penalised" in log  # it tried the liar, threw the chunk away
        loaded = [int(v) for v in re.findall(r"now on v(\d+)", log)]
        # and kept following versions from the learner (the newest each time: it may skip some in between)
        assert len(loaded) >= 2 and max(loaded) >= 5, loaded
        print(f"\n{log.count('failed its hash check')} corrupted chunks detected and penalised, "
              f"{log.count('now on v')} versions loaded, {steps_done(swarm)} steps")  # fmt: skip
    finally:
        stop.set()
        evil.stop()


class Relay:
    """A TCP relay from a local port to the learner's port that can be cut (connections dropped and new
    ones refused) and restored."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:  # with cut(): a connection accepted while the link is cut must not survive the cut
                if not self.open:
                    client.close()
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.target))
                self.conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            self.open = False
            for s in self.conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.conns.clear()

    def restore(self) -> None:
        with self.lock:
            self.open = True

    def close(self) -> None:
        self.cut()
        self.server.close()


def test_worker_cut_off_from_the_learner_but_not_its_peers(swarm):
    learner = swarm.learner("--steps", "100000", "--lease-timeout", "5")
    port = int(swarm.addr.split("/tcp/")[1].split("/")[0])
    relay = Relay(port)
    try:
        steady = swarm.worker("steady", "--max-groups", "1")
        via_relay = swarm.addr.replace(f"/tcp/{port}/", f"/tcp/{relay.port}/")
        cut = swarm.spawn(
            "cut", "worker", "join", "--learner", via_relay, "--identity", str(swarm.tmp / "cut.key"),
            "--work-dir", str(swarm.tmp / "cut"), "--max-groups", "1", "--listen", "/ip4/127.0.0.1/tcp/0",
        )  # fmt: skip
        procs = [("learner", learner), ("steady", steady), ("cut", cut)]
        wait_for(lambda: swarm.log("cut").count("now on v") >= 2, 180, "the worker behind the relay to work", procs)
        relay.cut()
        at_cut = steps_done(swarm)
        wait_for(lambda: "learner unreachable" in swarm.log("cut"), 60, "the cut worker to notice", procs)
        wait_for(lambda: steps_done(swarm) >= at_cut + 5, 120, "5 steps without it", procs)  # training goes on
        cut_id = swarm.log("cut").split("worker ", 1)[1].split()[0][-8:]

        def groups() -> int:
            return swarm.metrics()[-1]["workers"].get(cut_id, {}).get("groups_accepted", 0)

        versions_before, groups_before = swarm.log("cut").count("now on v"), groups()
        relay.restore()
        wait_for(lambda: swarm.log("cut").count("now on v") > versions_before, 120, "the worker to come back", procs)
        wait_for(lambda: groups() > groups_before, 120, "its rollouts accepted again", procs)
        print(f"\ncut at step {at_cut}; {steps_done(swarm) - at_cut} steps since; the cut worker came back and "
              f"has {groups()} groups accepted ({groups_before} before the link returned)")  # fmt: skip
    finally:
        relay.close()
