"""Peer-assisted pipelined broadcast of policy versions (docs/design.md §4).

The learner (seeder) holds every chunk of a version. Each peer fetches chunks from the learner and
from other peers at once, and serves every chunk it holds while it is still downloading:

- the learner decides what it sends: a peer *claims* a chunk (a /echo/chunk/1 request naming the chunks it
  still misses, marking those no peer of its own holds), and the learner answers with the one of them it
  has sent least, those the asker cannot get elsewhere first. Each chunk leaves the learner once before
  any leaves twice, and a chunk held only by peers the asker cannot reach (two workers behind NAT) comes
  from the learner: no chunk waits on a peer that nobody can reach, whatever each peer's view of the
  swarm. Every peer keeps LEARNER_CLAIMS claims in flight, so the learner's uplink never idles while
  anyone misses anything;
- everything else comes from peers, rarest chunk first (fewest holders in the have-maps), with a
  bounded number of requests in flight per peer, asking only listed peers (the learner dialled them
  back): anyone can send a have-map, and a stranger claiming every chunk would hold our requests; a
  peer behind NAT fetches from listed peers and serves them over the connections it dialled;
- a chunk whose hash does not match is thrown away, the peer that served it is penalised (avoided
  after PENALTY_LIMIT), and the chunk is fetched elsewhere; a peer that resets or times out is
  skipped for a while.

Long because BroadcastPeer's pipelined fetch (claims, rarest first, penalties, have-maps) is
one algorithm, kept in one place with the seeder side it talks to.

Have-maps travel both ways in one /echo/have/1 request: the asker sends its map and gets the other's.

Versions form a chain: a full snapshot, then deltas. The learner also publishes a full snapshot beside
the delta of every full_every-th version (in Seeder.snapshots). A worker that follows the chain fetches
deltas only, and derives each such snapshot from the weights it rebuilt: it encodes them as the learner
did and keeps the result if every chunk matches the signed snapshot manifest's hashes, so it can serve
the snapshot to joiners and restart from it. A joiner fetches the newest snapshot, then the deltas after
it. Chunk and have requests say which of a version's two forms they mean ("full").

Protocols: /echo/manifest/1 (newest or given version; with "since", the manifests before it that rebuild
it from that version, or else from the newest full snapshot, and the snapshots beside those deltas),
/echo/chunk/1 (a chunk by index, or a claim: the learner picks), /echo/have/1, /echo/join/1 (register with
the learner, get the peer list), /echo/announce/1 (the learner tells each peer that joined of a new version).

The peer list (who joined, checked and dialled back) is p2p.peer_list's: Seeder keeps its PeerRegistry, and
BroadcastPeer dials the listed peers in the background.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from p2p.chunk_store import ChunkStore
from p2p.codec import encode, sha256
from p2p.host import BadRequest, Host, Misbehaviour, PeerUnavailable, RemoteError
from p2p.manifest import Manifest
from p2p.peer_list import (
    DIAL_BACKLOG,
    DIAL_RETRY,
    DIAL_TIMEOUT,
    DIAL_WORKERS,
    MAX_ADDRS,
    MAX_PEERS,
    PEER_SILENCE,
    BackgroundPool,
    DialBack,
    PeerRegistry,
    checked_addr,
    listed_addrs,
)
from p2p.punch import checked_ip, tcp_ip
from p2p.versions import PolicyVersion

log = logging.getLogger(__name__)

MANIFEST = "/echo/manifest/1"
CHUNK = "/echo/chunk/1"
HAVE = "/echo/have/1"
JOIN = "/echo/join/1"
ANNOUNCE = "/echo/announce/1"
ANNOUNCE_WORKERS = 8  # announcements the learner sends at once
ANNOUNCE_TIMEOUT = 5.0  # seconds one may take (best effort: a worker that misses one polls)

PENALTY_LIMIT = 3  # bad chunks after which a peer is no longer asked
DEAD_FOR = 5.0  # seconds a peer that failed a request is skipped
HAVE_REFRESH = 0.3  # seconds between have-map exchanges with each peer
LEARNER_CLAIMS = 2  # claims a peer keeps in flight to the learner (one arriving while the next is on its way)
ENDGAME_AFTER = 1.0  # seconds a chunk request may be out before, once all we miss is asked for, another holder is asked
CLAIM_WAIT = 0.2  # seconds a peer waits before claiming again when the learner had nothing for it
CHUNK_TIMEOUT = 60.0  # seconds until a chunk reply starts; then its body may take its size / CHUNK_MIN_RATE
REPLY_OVERHEAD = 4096  # bytes a chunk reply may hold beyond the chunk (its framing)
CHUNK_MIN_RATE = 32e3  # bytes/s: a 4 MiB chunk from a 1 Mbit/s uplink shared by UPLOAD_SLOTS replies arrives
# seconds after a chunk went out before the learner sends it again while other claims wait for its uplink:
# by then its holder has shown it in the have-maps of the peers that can reach it, so a peer that still
# cannot find it needs it from the learner. With no claim waiting the uplink has room: copies go at once
COPY_AFTER = 4.0
# seconds before the learner gives a peer a chunk it gave it already (sooner if the peer says a claim failed)
REGIVE_AFTER = CHUNK_TIMEOUT + (4 << 20) / CHUNK_MIN_RATE
# chunk replies a node sends at once; more wait their turn. A chunk can be relayed only once all of it has
# arrived, so k replies sharing an uplink each take k times longer to become useful to the swarm; two, not
# one, so that the uplink does not idle between a reply and the next request (docs/benchmarks.md "Broadcast")
UPLOAD_SLOTS = 2
PUNCH_TIMEOUT = 30.0  # seconds a hole punch to a peer behind NAT may take (relayed dial, then DCUtR's 3 rounds)
RESERVE_EVERY = 300.0  # seconds between a NATed worker's reservations at the relay (a restarted learner forgets)


class VersionDropped(RemoteError):
    """The learner no longer holds the version being fetched (a newer one is out): fetch the newest instead."""


def is_full(manifest: Manifest) -> bool:
    """Whether a manifest is a full snapshot (weights or LoRA adapters), not a delta on another version."""
    return manifest.base_version is None


def bitmap(indices: set[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def from_bitmap(data: bytes, n: int) -> set[int]:
    if len(data) != (n + 7) // 8:
        raise BadRequest(f"have-map of {len(data)} bytes for {n} chunks")
    return {i for i in range(n) if data[i // 8] >> (i % 8) & 1}


class ChunkServer:
    """Serves the manifests and chunks of a ChunkStore, and trades have-maps with peers.

    A worker's store holds one form of each version (the delta it fetched, or the full snapshot it
    fetched or derived); the learner's also has `snapshots` beside its chain."""

    def __init__(self, host: Host, store: ChunkStore, upload_slots: int | None = UPLOAD_SLOTS) -> None:
        self.host = host
        self.store = store
        self.snapshots: ChunkStore | None = None  # the learner's full snapshots beside the chain
        self.peer_have: dict[str, dict[int, set[int]]] = defaultdict(dict)  # peer -> version -> chunks
        self.chunks_served = 0
        host.handle(MANIFEST, self._on_manifest)
        # upload_slots: answer only this many chunk requests at once (None: all, sharing the uplink)
        host.handle(CHUNK, self._on_chunk, concurrency=upload_slots)
        host.handle(HAVE, self._on_have)

    def forget(self, peer: str) -> None:
        """Drop what we know about a peer that left (its have-maps)."""
        self.peer_have.pop(peer, None)

    def _on_manifest(self, peer: str, msg: dict) -> dict:
        versions = self.store.manifests
        if not versions:
            raise BadRequest("no version published yet")
        version = msg.get("version")
        if version is None:
            version = max(versions)
        if not isinstance(version, int) or version not in versions:
            raise BadRequest(f"version {version!r} is not held here")
        since = msg.get("since")
        if "since" not in msg or not (since is None or isinstance(since, int)):
            return {"manifest": versions[version].to_dict()}
        chain = self._chain(version, since)  # ends with `version`: its chain entry, or its full snapshot
        snapshots = self.snapshots.manifests if self.snapshots is not None else {}
        return {
            "manifest": chain[-1].to_dict(),
            "chain": [m.to_dict() for m in chain[:-1]],
            "snapshots": [snapshots[m.version].to_dict() for m in chain if m.version in snapshots],
        }

    def _chain(self, version: int, since: int | None) -> list[Manifest]:
        """The manifests that rebuild `version`, oldest first: the deltas from `since` if the chain still
        reaches back to it, else the newest full snapshot up to `version` and the deltas after it."""
        versions = self.store.manifests
        chain = [versions[version]]
        while not is_full(chain[0]) and chain[0].base_version != since and chain[0].base_version in versions:
            chain.insert(0, versions[chain[0].base_version])
        if since is not None and not is_full(chain[0]) and chain[0].base_version == since:
            return chain
        snapshots = self.snapshots.manifests if self.snapshots is not None else {}
        fulls = {v: m for v, m in snapshots.items() if v <= version} | {m.version: m for m in chain if is_full(m)}
        start = max(fulls, default=None)
        if start is None or not all(v in versions for v in range(start + 1, version + 1)):
            return chain  # no snapshot to start from: the asker sees the chain is broken, and says so
        return [fulls[start], *(versions[v] for v in range(start + 1, version + 1))]

    def _store_for(self, version: int, full: object) -> ChunkStore | None:
        """The store that holds `version` in the form asked for (full True/False; None: whichever the
        chain has), or None."""
        manifest = self.store.manifests.get(version)
        if manifest is not None and (full is None or is_full(manifest) == full):
            return self.store
        if full is True and self.snapshots is not None and version in self.snapshots.manifests:
            return self.snapshots
        return None

    @staticmethod
    def _same_run(store: ChunkStore, version: int, run_id: object) -> bool:
        """Whether our `version` is the asker's (a learner restart numbers versions from the checkpoint
        again, so a peer that has not noticed yet holds another run's v6; requests name their run)."""
        manifest = store.manifests.get(version)
        return run_id is None or manifest is None or manifest.run_id == run_id

    def _on_chunk(self, peer: str, msg: dict) -> dict:
        version, index = msg.get("version"), msg.get("index")
        if not isinstance(version, int) or not isinstance(index, int):
            raise Misbehaviour("chunk request needs integer version and index")
        store = self._store_for(version, msg.get("full"))
        if store is None:
            raise BadRequest(f"version {version} is not held here in the form asked for")
        if not self._same_run(store, version, msg.get("run_id")):
            raise BadRequest(f"version {version} here belongs to another run")
        data = store.get(version, index)
        if data is None:
            raise BadRequest(f"chunk {index} of version {version} is not held here")
        self.chunks_served += 1
        return {"data": data}

    def _on_have(self, peer: str, msg: dict) -> dict:
        version = msg.get("version")
        store = self._store_for(version, msg.get("full")) if isinstance(version, int) else None
        if store is None or not self._same_run(store, version, msg.get("run_id")):
            return {"have": None}
        n = len(store.manifests[version].chunks)
        if isinstance(msg.get("have"), bytes) and store is self.store:  # (the learner's status counts the chain's)
            maps = self.peer_have[peer]
            maps[version] = from_bitmap(msg["have"], n)
            for old in [v for v in maps if v not in self.store.manifests]:  # versions dropped since
                del maps[old]
        return {"have": bitmap(store.held(version), n)}


class Seeder(ChunkServer):
    """The learner's side: holds whole versions and the registry of peers that joined (p2p.peer_list).

    `silence`: seconds without a request from a peer after which it leaves the registry (the learner's
    swarm.worker_silence); `clock`: the time those are measured on (tests pass their own)."""

    def __init__(
        self,
        host: Host,
        store: ChunkStore,
        upload_slots: int | None = UPLOAD_SLOTS,
        silence: float = PEER_SILENCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(host, store, upload_slots)
        # on disk when the chain's store spills (only joiners and restarted workers ask for them), else in memory
        spill = store.spill_dir / "snapshots" if store.spill_dir is not None else None
        self.snapshots = ChunkStore(spill_dir=spill, memory_budget=0 if spill is not None else store.memory_budget)
        # a peer that leaves the registry leaves with its have-maps
        self.registry = PeerRegistry(host.guard.banned_peers, super().forget, silence, clock)
        host.watch_requests(self.registry.heard)
        # with HostConfig(relay=True): the hole punches of peers that joined from behind a NAT
        host.relay_for = lambda peer: self.registry.reached(peer) is False
        host.handle(JOIN, self._on_join)
        # what each claim was given: (version, from the snapshots) -> copies sent of each chunk, and
        # -> peer -> chunk -> when it was last given to that peer
        self._sent: dict[tuple[int, bool], list[int]] = {}
        self._last_sent: dict[tuple[int, bool], list[float]] = {}  # when each chunk last went out
        self._given: dict[tuple[int, bool], dict[str, dict[int, float]]] = {}
        self._claims_lock = threading.Lock()
        self._rng = random.Random()
        self._clock = clock
        # a new version is announced to the peers at once (a worker at 100 ms does not wait for its next poll)
        self._announcer = BackgroundPool("announce", ANNOUNCE_WORKERS, ANNOUNCE_WORKERS * 64)

    @property
    def peers(self) -> dict[str, list[str]]:
        """Peer id -> the addresses it announced (checked; status shows them)."""
        return self.registry.peers

    def listed(self, peer: str) -> list[str]:
        """The addresses of `peer` handed to joiners: those the learner's dial-back reached."""
        return self.registry.listed(peer)

    @property
    def dial_back(self) -> DialBack:
        return self.registry.dial_back

    def publish(self, pv: PolicyVersion, beside: PolicyVersion | None = None) -> None:
        """Add a version to the chain, and `beside` (its full snapshot, if made) to the snapshots; tell every
        peer that joined (over its own connection if it dialled us from behind a NAT)."""
        if beside is not None:  # first, so that no joiner is sent to a delta it cannot start from
            self.snapshots.add_version(beside)
        self.store.add_version(pv)
        connected = set(self.host.connected_peers())  # never a dial: only peers connected to us now
        for peer in [p for p in self.registry.joined() if p in connected][: ANNOUNCE_WORKERS * 64]:
            self._announcer.submit(partial(self._announce, peer, pv.manifest.version))

    def _announce(self, peer: str, version: int) -> None:
        try:
            self.host.request(peer, ANNOUNCE, {"version": version}, timeout=ANNOUNCE_TIMEOUT)
        except (PeerUnavailable, RemoteError):
            pass  # it learns of the version at its next heartbeat

    def forget(self, peer: str) -> None:
        self.registry.forget(peer)

    def close(self) -> None:
        """Stop dialling back (the probing host stops) and announcing; the registry stays readable."""
        self.registry.close()
        self._announcer.close()

    def _on_join(self, peer: str, msg: dict) -> dict:
        """The peer list; the peers nobody can dial, with the IP each was seen at (where a hole punch may dial
        it); and what the dial-back found of the joiner (False: it is behind a NAT)."""
        listed, out = self.registry.join(peer, msg.get("addrs")), self.registry.dialling_out(peer)
        reached = self.registry.reached(peer)
        behind = self.registry.behind_nat(peer) if reached is False else []  # only a NATed joiner punches
        seen = {p: ip for p in behind if (ip := tcp_ip(self.host.observed.get(p, "")))}
        return {"peers": listed, "dialling_out": out, "seen": seen, "reached": reached}

    def _on_chunk(self, peer: str, msg: dict) -> dict:
        return self._on_claim(peer, msg) if "want" in msg else super()._on_chunk(peer, msg)

    def _on_claim(self, peer: str, msg: dict) -> dict:
        """A claim {version, run_id, full, want, hard, again}: `want` the chunks the peer misses and has not
        asked anyone for, `hard` those of them no peer of its own holds (bitmaps). Answers {index, data} with
        the chunk of `want` to send now: one of `hard` before any other, then the one sent fewest times (ties
        at random); not one sent in the last COPY_AFTER seconds while other claims wait, nor one given to this
        peer in the last REGIVE_AFTER unless it says `again` (a claim of its failed). {index: None} if there
        is none; {gone: True} if the version is not held (a newer one is out) or is another run's."""
        version, want, hard = msg.get("version"), msg.get("want"), msg.get("hard", b"")
        if not isinstance(version, int) or not isinstance(want, bytes) or not isinstance(hard, bytes):
            raise Misbehaviour("a chunk claim needs an integer version and bitmaps want and hard")
        store = self._store_for(version, msg.get("full"))
        if store is None or not self._same_run(store, version, msg.get("run_id")):
            return {"gone": True}
        n = len(store.manifests[version].chunks)
        try:
            wanted, hard_ones = from_bitmap(want, n), from_bitmap(hard, n) if hard else set()
        except BadRequest as exc:
            raise Misbehaviour(f"chunk claim: {exc}") from None
        key, now = (version, store is self.snapshots), self._clock()
        copy_after = COPY_AFTER if self.host.waiting(CHUNK) else 0.0  # an uplink with room sends copies at once
        with self._claims_lock:
            self._forget_dropped()
            sent = self._sent.setdefault(key, [0] * n)
            last = self._last_sent.setdefault(key, [0.0] * n)
            given = self._given.setdefault(key, {}).setdefault(peer, {})
            if msg.get("again") is True:
                given.clear()
            fresh = [
                i
                for i in wanted
                if now - given.get(i, -REGIVE_AFTER) >= REGIVE_AFTER and (not sent[i] or now - last[i] >= copy_after)
            ]
            if not fresh:
                return {"index": None}
            index = min(fresh, key=lambda i: (i not in hard_ones, sent[i], self._rng.random()))
            sent[index] += 1
            given[index] = last[index] = now
        data = store.get(version, index)
        if data is None:  # dropped since we looked
            return {"gone": True}
        self.chunks_served += 1
        return {"index": index, "data": data}

    def _forget_dropped(self) -> None:
        """Forget the claims of versions no longer held (called holding the claims lock)."""
        for version, snapshot in list(self._sent):
            if version not in (self.snapshots if snapshot else self.store).manifests:
                self._sent.pop((version, snapshot))
                self._last_sent.pop((version, snapshot), None)
                self._given.pop((version, snapshot), None)

    def copies_sent(self, version: int) -> list[int]:
        """How many times each chunk of chain `version` went out to a claim (for tests and benchmarks)."""
        with self._claims_lock:
            return list(self._sent.get((version, False), []))


@dataclass
class _Fetch:
    """One version being fetched: the requests in flight and what they taught us. `done` guards it and is
    notified whenever a request ends."""

    manifest: Manifest
    inflight: dict[int, str] = field(default_factory=dict)  # chunk -> the peer asked for it
    asked_at: dict[int, float] = field(default_factory=dict)  # chunk -> when it was asked for (inflight)
    doubles: dict[int, str] = field(default_factory=dict)  # chunk -> a second peer asked for it (the endgame)
    per_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # requests in flight per peer
    failed: set[tuple[int, str]] = field(default_factory=set)  # (chunk, peer) that peer did not have
    claims: int = 0  # claims in flight to the learner
    claim_after: float = 0.0  # no claim before this time (the learner had nothing for us)
    claim_failed: bool = False  # a claim's reply was lost (the next claim says so)
    gone: bool = False  # the learner no longer holds the version
    done: threading.Condition = field(default_factory=threading.Condition)


class BroadcastPeer(ChunkServer):
    """A worker's side: joins a learner, then fetches versions from the learner and its peers."""

    def __init__(
        self,
        host: Host,
        store: ChunkStore,
        learner: str,
        max_inflight: int = 6,
        per_peer_inflight: int = 2,
        use_peers: bool = True,
        upload_slots: int | None = UPLOAD_SLOTS,
        announce: list[str] | None = None,
    ) -> None:
        super().__init__(host, store, upload_slots)
        self.use_peers = use_peers  # False: fetch from the learner only (the star baseline)
        # the addresses we announce (None: those we listen on); each gets /p2p/<our id> if it lacks one
        self.announce = [a if "/p2p/" in a else f"{a}/p2p/{host.peer_id}" for a in announce] if announce else None
        self.learner_addr = learner
        self.learner = learner.rsplit("/p2p/", 1)[-1]
        self.max_inflight = max_inflight
        self.per_peer_inflight = per_peer_inflight
        self.peers: dict[str, list[str]] = {}
        self.penalties: dict[str, int] = defaultdict(int)
        self.dead_until: dict[str, float] = {}
        self.stats: dict[str, int] = defaultdict(int)  # chunks by source, bad chunks, failures
        self._last_join = 0.0
        self.learner_chunk_at: dict[int, float] = {}  # chunk index -> when it last came from the learner (benchmarks)
        self.chunk_at: dict[int, float] = {}  # chunk index -> when it last came from anyone (benchmarks)
        # peers are dialled in the background: `peers` is replaced, never changed in place, when one is reached
        self._dials = BackgroundPool("dial", DIAL_WORKERS, DIAL_BACKLOG)
        self._punches = BackgroundPool("punch", 1, 8)  # hole punches, one at a time: they never hold up dials
        self._dialling: set[str] = set()  # peers being dialled or queued for it
        self._retry_at: dict[str, float] = {}  # peer -> when a peer we could not reach may be dialled again
        self._skipped: set[str] = set()  # peers whose entry was skipped and logged (once each)
        self._peers_changed = threading.Condition()
        self._traders = ThreadPoolExecutor(max_workers=8, thread_name_prefix="have")  # have-map trades at once
        self.on_announce: Callable[[int], None] | None = None  # told of each version the learner announces
        self.dialling_out: set[str] = set()  # peers the learner says joined but cannot be dialled (behind NAT)
        self.behind_nat = False  # the learner's dial-back could not reach us (p2p.punch)
        self._reserved_at = -RESERVE_EVERY  # when we last held a slot at the learner's relay
        host.handle(ANNOUNCE, self._on_announce)

    def join(self, timeout: float = 10.0, learner: str | None = None) -> None:
        """Register with the learner (at `learner`, an address or a peer id we are connected to; by default
        the address we were given) and start dialling the peers it lists. Returns as soon as the learner
        answered: the dials go on in the background (wait_for_peers, wait_dials), so that no listed peer,
        however slow, holds up a joining worker."""
        announce = [a for a in self.announce or self.host.addrs if self._own_addr(a)][:MAX_ADDRS]
        reply = self.host.request(learner or self.learner_addr, JOIN, {"addrs": announce}, timeout=timeout)
        self.refresh_peers(reply.get("peers") if isinstance(reply, dict) else None)
        out = reply.get("dialling_out") if isinstance(reply, dict) else None
        if isinstance(out, list):  # joined peers nobody can dial: asked only over a connection they opened to us
            self.dialling_out = {p for p in out[:MAX_PEERS] if isinstance(p, str)}
        if isinstance(reply, dict) and self.host.config.hole_punch and self.use_peers:
            self.behind_nat = reply.get("reached") is False
            seen = reply.get("seen")
            self._punch_holes(seen if isinstance(seen, dict) else {})

    def _punch_holes(self, seen: dict) -> None:
        """Behind a NAT, reach the other peers behind NATs by hole punching (p2p.punch): hold a slot at the
        learner's relay so that they can, and punch to those whose peer id sorts after ours (one of each
        pair starts). A punch dials a peer only at the IP the learner saw it at."""
        for peer in [p for p in self.dialling_out if p in seen][:MAX_PEERS]:
            if ip := checked_ip(seen[peer]):
                self.host.allow_punch(peer, ip)
        if not self.behind_nat:
            return
        now = time.monotonic()
        if now - self._reserved_at >= RESERVE_EVERY:
            self._reserved_at = now  # (before the job runs: a refusal sets it back to try again soon)
            if not self._punches.submit(self._reserve):
                self._reserved_at = now - RESERVE_EVERY
        try:
            direct = self.host.direct_peers()
        except PeerUnavailable:  # the host stopped
            return
        for peer in sorted(p for p in self.dialling_out if p in seen and p > self.host.peer_id):
            if not self._should_dial(peer, now) or peer in direct:
                continue
            with self._peers_changed:
                self._dialling.add(peer)
            if not self._punches.submit(partial(self._punch, peer)):
                with self._peers_changed:
                    self._dialling.discard(peer)
                break

    def _reserve(self) -> None:
        try:
            self.host.reserve(self.learner)
        except PeerUnavailable as exc:
            self._reserved_at = time.monotonic() - RESERVE_EVERY + DIAL_RETRY  # try again soon
            log.debug("no slot at the learner's relay: %s", exc)

    def _punch(self, peer: str) -> None:
        """Hole punch to a peer behind NAT (a background job, like a dial)."""
        try:
            if self.host.punch(peer, self.learner_addr, timeout=PUNCH_TIMEOUT):
                log.info("direct connection to %s, behind a NAT as we are (hole punched)", peer[-8:])
            else:
                self._skip(peer, "the hole punch found no direct path")
        finally:
            with self._peers_changed:
                self._dialling.discard(peer)
                self._peers_changed.notify_all()

    def punched(self) -> list[str]:
        """The peers behind NATs we hold a direct connection to while behind a NAT ourselves (hole punched)."""
        if not self.behind_nat:
            return []
        try:
            direct = self.host.direct_peers()
        except PeerUnavailable:  # the host stopped
            return []
        return [p for p in self.dialling_out if p in direct and p not in self.peers]

    def _on_announce(self, peer: str, msg: dict) -> dict:
        """The learner published a version: say so to whoever listens (the worker's fetcher syncs at once)."""
        version = msg.get("version")
        if peer != self.learner or not isinstance(version, int) or version < 0:
            raise Misbehaviour("only the learner announces versions, by number")
        if self.on_announce is not None:
            self.on_announce(version)
        return {}

    def _own_addr(self, addr: str) -> bool:
        """Whether the learner accepts `addr` as one of ours (we announce only those: others cost a penalty)."""
        try:
            checked_addr(addr, self.host.peer_id)
            return True
        except Misbehaviour:
            return False

    def refresh_peers(self, peers: object) -> int:
        """Start dialling, in the background, the listed peers we are not connected to: at most DIAL_BACKLOG
        queued or in flight (the rest wait for the next refresh), DIAL_WORKERS at once, DIAL_TIMEOUT per
        address. A peer that could not be reached is dialled again after DIAL_RETRY; one no longer listed
        (it left, went silent or was banned) is no longer asked. Never raises on a bad list or entry.
        Returns how many dials it started."""
        if not self.use_peers:
            return 0
        if not isinstance(peers, dict):
            log.debug("the learner's peer list is a %s, not a map; ignored", type(peers).__name__)
            return 0
        with self._peers_changed:  # the list is whole (the registry holds at most MAX_PEERS): who is not on it left
            gone = [p for p in self.peers if p not in peers]
            if gone:
                self.peers = {p: a for p, a in self.peers.items() if p in peers}
        for peer in gone:
            self.peer_have.pop(peer, None)
            log.debug("peer %s left the learner's list; no longer asked", peer[-8:])
        now, started = time.monotonic(), 0
        for peer, addrs in list(peers.items())[:MAX_PEERS]:
            if not self._should_dial(peer, now):
                continue
            with self._peers_changed:
                self._dialling.add(peer)
            if not self._dials.submit(partial(self._dial, peer, addrs)):
                with self._peers_changed:
                    self._dialling.discard(peer)
                break  # as many dials as we allow are under way
            started += 1
        return started

    def _should_dial(self, peer: object, now: float) -> bool:
        return (
            isinstance(peer, str)
            and peer not in (self.host.peer_id, self.learner)
            and peer not in self.peers
            and peer not in self._dialling
            and self._retry_at.get(peer, 0.0) <= now
        )

    def _dial(self, peer: str, addrs: object) -> None:
        """Connect to a listed peer by the first of its addresses that answers (a background job)."""
        reason, usable = "no address ending in its id", listed_addrs(peer, addrs)
        try:
            for addr in usable:
                try:
                    self.host.connect(addr, timeout=DIAL_TIMEOUT)
                except Exception as exc:  # noqa: BLE001 - a bad entry is skipped, whatever is wrong with it
                    reason = f"{type(exc).__name__}: {exc}"
                    continue
                with self._peers_changed:
                    self.peers = {**self.peers, peer: usable}
                    self._retry_at.pop(peer, None)
                return
            self._skip(peer, reason)
        finally:
            with self._peers_changed:
                self._dialling.discard(peer)
                self._peers_changed.notify_all()

    def _skip(self, peer: str, reason: str) -> None:
        """A listed peer we could not reach: dialled again after DIAL_RETRY; logged once (at debug level)."""
        with self._peers_changed:
            now = time.monotonic()
            if len(self._retry_at) >= MAX_PEERS:  # keep only the peers still waiting
                self._retry_at = {p: t for p, t in self._retry_at.items() if t > now}
            self._retry_at[peer] = now + DIAL_RETRY
            if len(self._skipped) >= MAX_PEERS:
                self._skipped.clear()
            first = peer not in self._skipped
            self._skipped.add(peer)
        if first:
            log.debug("listed peer %s skipped: %s", peer[-8:], reason[:200])

    def wait_for_peers(self, n: int, timeout: float) -> bool:
        """Wait until we are connected to at least `n` peers; whether that happened within `timeout` s."""
        with self._peers_changed:
            return self._peers_changed.wait_for(lambda: len(self.peers) >= n, timeout)

    def wait_dials(self, timeout: float) -> bool:
        """Wait until no dial is queued or in flight; whether that happened within `timeout` seconds."""
        return self._dials.wait_idle(timeout)

    @property
    def dials_pending(self) -> int:
        """Peers being dialled or queued for it."""
        with self._peers_changed:
            return len(self._dialling)

    def close(self) -> None:
        """Drop the queued dials and start no more (stop the host first: the running dials then fail at once)."""
        self._dials.close()
        self._punches.close()
        self._traders.shutdown(wait=False, cancel_futures=True)

    def fetch_manifest(self, version: int | None = None, timeout: float = 10.0) -> Manifest:
        """The learner's newest (or given) manifest, checked against the learner's key."""
        return self._manifests(version, timeout)[0][-1]

    def _manifests(
        self, version: int | None, timeout: float, chain_since: int | None | bool = False
    ) -> tuple[list[Manifest], dict[int, Manifest]]:
        """The learner's manifest of `version` (newest if None), last; before it, with `chain_since` (a
        version held, or None for none), the manifests that rebuild it from there or from a full snapshot,
        oldest first. All checked against the learner's key and added to the store. Also the full
        snapshots the learner holds beside deltas of that chain, by version (checked, not stored)."""
        ask = {"version": version} if chain_since is False else {"version": version, "since": chain_since}
        reply = self.host.request(self.learner_addr, MANIFEST, ask, timeout=timeout)
        manifests = [Manifest.from_dict(m) for m in [*reply.get("chain", [])[:1000], reply["manifest"]]]
        snapshots = [Manifest.from_dict(m) for m in reply.get("snapshots", [])[:1000]]
        for m in [*manifests, *snapshots]:
            m.verify(self.learner)
        for m in manifests:
            self.store.add_manifest(m)
        return manifests, {m.version: m for m in snapshots if is_full(m)}

    def sync(
        self,
        held: tuple[int, bytes] | None,
        timeout: float = 600.0,
        stop: threading.Event | None = None,
        version: int | None = None,
        held_sha256: str | None = None,
    ) -> tuple[Manifest, bytes] | None:
        """Bring `held` = (version, raw weights) up to the learner's newest weights version (or `version`).
        `held_sha256`: the hash of held's raw weights if known (checked when they were rebuilt).

        Returns (manifest, raw) of that version, or None if `held` is already it. Fetches the newest
        full snapshot first when `held` is not a base the deltas can start from, then each delta in
        order; every step is checked by hash. Chunks of superseded versions are dropped. (A LoRA
        version is not weights: sync to its adapter_base, then fetch_adapters.)
        """
        from p2p.versions import rebuild_raw

        chain, snapshots = self._manifests(version, timeout=10, chain_since=held[0] if held is not None else None)
        newest = chain[-1]
        if newest.adapter_base is not None:
            raise RemoteError(f"version {newest.version} holds LoRA adapters: sync to v{newest.adapter_base} first")
        if held is not None and held[0] == newest.version:
            return None
        if held is not None and held[0] > newest.version:
            held = None  # the learner went back (restarted from a checkpoint): start from a full snapshot
        for a, b in zip(chain, chain[1:], strict=False):
            if b.base_version != a.version:
                raise RemoteError(f"the learner sent a broken chain of versions ({a.version} then {b.version})")
        if chain[0].base_version is not None and (held is None or chain[0].base_version != held[0]):
            raise RemoteError(f"the learner no longer holds version {chain[0].base_version} of the chain")
        # every version's chunks at once (a slow link pays its round trips once, not once per version)
        with ThreadPoolExecutor(max_workers=min(len(chain), 4), thread_name_prefix="chain") as pool:
            fetched = list(pool.map(lambda m: self.fetch(m, timeout=timeout, stop=stop), chain))
        raw = held[1] if held is not None and chain[0].base_version is not None else None
        known = held_sha256 if raw is not None else None  # of raw; each rebuild checks its result's hash
        for manifest, chunks in zip(chain, fetched, strict=True):
            raw = rebuild_raw(manifest, chunks, raw, known if manifest.base_version is not None else None)
            known = manifest.weights_sha256
            snapshot = snapshots.get(manifest.version)
            if snapshot is not None and not is_full(manifest) and snapshot.weights_sha256 == known:
                self._derive_snapshot(snapshot, raw)
        self._drop_before_newest_snapshot(newest.version)
        return newest, raw

    def _derive_snapshot(self, snapshot: Manifest, raw: bytes) -> None:
        """Encode `raw` (the weights of the snapshot's version, just rebuilt) as the learner encoded its
        full snapshot; if every chunk matches the signed manifest, the snapshot replaces the delta in our
        store (we serve it to joiners and restart from it) at the cost of a compression, not a download.
        A different zstd build may compress differently: then nothing is kept, and joiners fetch it elsewhere."""
        encoded, chunks, start = encode(raw), [], 0
        for _, size in snapshot.chunks:  # cut where the manifest cuts
            chunks.append(encoded[start : start + size])
            start += size
        if start != len(encoded) or [(sha256(c), len(c)) for c in chunks] != [tuple(c) for c in snapshot.chunks]:
            self.stats["snapshots_not_derived"] += 1
            log.info("v%d: our encoding of its full snapshot differs from the learner's; not kept", snapshot.version)
            return
        self.store.drop(snapshot.version)
        self.store.add_version(PolicyVersion(snapshot, chunks))
        self.stats["snapshots_derived"] += 1
        log.debug("v%d: full snapshot derived from the rebuilt weights (%d chunks)", snapshot.version, len(chunks))

    def _drop_before_newest_snapshot(self, newest: int) -> None:
        """Keep what rebuilds `newest` (its full snapshot and the deltas after it), which late joiners
        fetch from us and a restarted worker reads back from disk; drop older and unfinished versions."""
        store = self.store
        complete = {v for v, m in store.manifests.items() if len(store.held(v)) == len(m.chunks)}
        snapshots = [
            v
            for v in complete
            if v <= newest and store.manifests[v].codec == "full-zstd" and store.manifests[v].adapter_base is None
        ]
        start = max(snapshots, default=newest)
        for version in list(store.manifests):
            if version < start or (version < newest and version not in complete):
                store.drop(version)

    def fetch_adapters(self, manifest: Manifest, timeout: float = 600.0, stop: threading.Event | None = None) -> bytes:
        """The raw adapters of LoRA version `manifest` (already verified); drops older adapter versions."""
        from p2p.versions import rebuild_raw

        raw = rebuild_raw(manifest, self.fetch(manifest, timeout=timeout, stop=stop))
        for version in list(self.store.manifests):
            if manifest.adapter_base < version < manifest.version:
                self.store.drop(version)
        return raw

    def _alive(self, peer: str) -> bool:
        return self.dead_until.get(peer, 0.0) < time.monotonic() and self.penalties[peer] < PENALTY_LIMIT

    def _known(self, peer: str) -> bool:
        """Whether the learner vouches for `peer`: listed, or joined from behind a NAT (then reachable only over
        a connection it opened to us). Only such peers are asked for chunks."""
        return peer in self.peers or peer in self.dialling_out

    def fetch(self, manifest: Manifest, timeout: float = 600.0, stop: threading.Event | None = None) -> list[bytes]:
        """Download every chunk of `manifest` (already verified), serving what we hold meanwhile.

        Raises PeerUnavailable when `stop` is set, or when the learner is unreachable and no peer has
        anything left to give us; VersionDropped when the learner no longer holds the version.
        """
        version, n = manifest.version, len(manifest.chunks)
        self.store.add_manifest(manifest)
        deadline = time.monotonic() + timeout
        fetch = _Fetch(manifest)
        rng = random.Random(self.host.peer_id)
        last_have = 0.0
        pool = ThreadPoolExecutor(max_workers=self.max_inflight + LEARNER_CLAIMS + 2, thread_name_prefix="fetch")
        try:
            have_future: Future | None = None
            while True:
                held = self.store.held(version)
                if len(held) == n:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {version}: {len(held)}/{n} chunks after {timeout}s")
                if stop is not None and stop.is_set():
                    raise PeerUnavailable(f"stopped while fetching version {version}")
                if fetch.gone:  # the learner dropped this version (a newer one is out): so do we, so that
                    self.store.drop(version)  # peers stop asking us for it
                    raise VersionDropped(f"version {version} is no longer held by the learner")
                if (
                    not fetch.inflight
                    and not fetch.doubles
                    and not fetch.claims
                    and not self._alive(self.learner)
                    and not any(
                        self._known(p) and self._alive(p) and maps.get(version, set()) - held
                        for p, maps in list(self.peer_have.items())
                    )
                ):
                    raise PeerUnavailable(f"version {version}: the learner is unreachable and no peer can help")
                if (have_future is None or have_future.done()) and time.monotonic() - last_have > HAVE_REFRESH:
                    last_have = time.monotonic()
                    have_future = pool.submit(self._exchange_have_maps, manifest, held)

                with fetch.done:
                    picks, claim = self._choose(fetch, held, rng)
                    for index, source, double in picks:
                        if double:
                            fetch.doubles[index] = source
                        else:
                            fetch.inflight[index], fetch.asked_at[index] = source, time.monotonic()
                        fetch.per_peer[source] += 1
                        self.stats["endgame_requests"] += double
                        pool.submit(self._fetch_one, fetch, index, source, double)
                    if claim is not None:
                        fetch.claims += 1
                        pool.submit(self._claim_one, fetch, *claim)
                    fetch.done.wait(0.05)
        finally:  # without waiting for the requests still out (a have-map trade, a copy): each has its timeout
            pool.shutdown(wait=False, cancel_futures=True)
        return [self.store.get(version, i) or b"" for i in range(n)]

    def _choose(
        self, fetch: _Fetch, held: set[int], rng: random.Random
    ) -> tuple[list[tuple[int, str, bool]], tuple[bytes, bytes] | None]:
        """What to ask for now (called holding fetch.done): (chunk, peer, double) for the free request slots,
        rarest first; and a claim (want, hard) for the learner if one of its slots is free, else None.

        The endgame: once every chunk we miss is asked for, one asked ENDGAME_AFTER seconds ago or more (its
        holder's uplink queues other peers' requests) is also asked of another holder (`double`), as
        BitTorrent's endgame does: the last chunks of a version otherwise wait on the slowest queue."""
        version, n = fetch.manifest.version, len(fetch.manifest.chunks)
        holders: dict[int, list[str]] = defaultdict(list)
        for peer, maps in list(self.peer_have.items()):
            # only peers the learner knows (listed, or joined from behind a NAT and connected to us): anyone can
            # send us a have-map, and a stranger that claims every chunk and answers slowly would hold our requests
            if self._known(peer) and self._alive(peer):
                for i in maps.get(version, ()):
                    holders[i].append(peer)
        wanted = [i for i in range(n) if i not in held and i not in fetch.inflight]
        rng.shuffle(wanted)  # ties broken differently by every peer
        picks: list[tuple[int, str, bool]] = []
        slots = self.max_inflight - len(fetch.inflight) - len(fetch.doubles)
        busy = defaultdict(int, fetch.per_peer)
        for i in sorted((i for i in wanted if holders[i]), key=lambda i: len(holders[i])):
            free = [p for p in holders[i] if busy[p] < self.per_peer_inflight and (i, p) not in fetch.failed]
            if free and len(picks) < slots:
                source = min(free, key=lambda p: busy[p])
                picks.append((i, source, False))
                busy[source] += 1
        if not wanted:  # the endgame
            now = time.monotonic()
            for i in sorted((i for i in fetch.inflight if i not in held), key=lambda i: fetch.asked_at.get(i, now)):
                if len(picks) >= slots or now - fetch.asked_at.get(i, now) < ENDGAME_AFTER:
                    break
                if i in fetch.doubles:
                    continue
                free = [
                    p
                    for p in holders[i]
                    if p != fetch.inflight[i] and busy[p] < self.per_peer_inflight and (i, p) not in fetch.failed
                ]
                if free:
                    source = min(free, key=lambda p: busy[p])
                    picks.append((i, source, True))
                    busy[source] += 1
        claim = None
        if fetch.claims < LEARNER_CLAIMS and time.monotonic() >= fetch.claim_after and self._alive(self.learner):
            taken = {i for i, _, _ in picks}
            rest = {i for i in wanted if i not in taken}
            if rest:
                claim = (bitmap(rest, n), bitmap({i for i in rest if not holders[i]}, n))
        return picks, claim

    def _fetch_one(self, fetch: _Fetch, index: int, source: str, double: bool = False) -> None:
        """Ask peer `source` for chunk `index` (a pool job); `double`: a second request for it (the endgame)."""
        manifest = fetch.manifest
        try:
            ask = {"version": manifest.version, "index": index, "run_id": manifest.run_id, "full": is_full(manifest)}
            most = manifest.chunks[index][1] + REPLY_OVERHEAD
            reply = self.host.request(source, CHUNK, ask, CHUNK_TIMEOUT, CHUNK_MIN_RATE, max_reply=most)
            self._keep(manifest, index, source, reply.get("data"))
        except RemoteError:
            fetch.failed.add((index, source))  # the peer does not hold it (any more)
        except PeerUnavailable as exc:
            self._unavailable(source, exc)
        finally:
            with fetch.done:
                if double and fetch.doubles.get(index) == source:
                    fetch.doubles.pop(index)
                elif fetch.inflight.get(index) == source:  # (a double promoted below ends here too)
                    fetch.inflight.pop(index, None)
                    fetch.asked_at.pop(index, None)
                    if index in fetch.doubles and index not in self.store.held(manifest.version):
                        # the first request failed while its double is out: the double is the request now
                        fetch.inflight[index], fetch.asked_at[index] = fetch.doubles.pop(index), time.monotonic()
                fetch.per_peer[source] -= 1
                fetch.done.notify_all()

    def _claim_one(self, fetch: _Fetch, want: bytes, hard: bytes) -> None:
        """Claim a chunk from the learner (a pool job): it picks which (Seeder._on_claim)."""
        manifest = fetch.manifest
        with fetch.done:
            again = fetch.claim_failed
        claim = {"version": manifest.version, "run_id": manifest.run_id, "full": is_full(manifest), "want": want}
        claim |= {"hard": hard, "again": again}
        wait = 0.0
        biggest = max(size for _, size in manifest.chunks)
        try:
            reply = self.host.request(
                self.learner_addr, CHUNK, claim, CHUNK_TIMEOUT, CHUNK_MIN_RATE, max_reply=biggest + REPLY_OVERHEAD
            )
            if again:  # the learner knows now: only this claim may say the failure was heard
                with fetch.done:
                    fetch.claim_failed = False
            index = reply.get("index")
            if reply.get("gone") is True:
                fetch.gone = True
            elif index is None:
                wait = CLAIM_WAIT  # nothing for us now: what we miss is on its way from peers
            elif isinstance(index, int) and 0 <= index < len(manifest.chunks):
                self._keep(manifest, index, self.learner, reply.get("data"))
            else:
                self._keep(manifest, 0, self.learner, None)  # not a chunk of this version: a bad reply
        except RemoteError as exc:  # refused (not authorized: a restarted learner; it failed): not "dropped"
            self.dead_until[self.learner] = time.monotonic() + DEAD_FOR
            log.info("chunk claim refused by the learner: %s", exc)
        except PeerUnavailable as exc:
            with fetch.done:
                fetch.claim_failed = True  # the chunk it was sending us is lost: it may send it again
            self._unavailable(self.learner, exc)
        finally:
            with fetch.done:
                fetch.claims -= 1
                fetch.claim_after = max(fetch.claim_after, time.monotonic() + wait)
                fetch.done.notify_all()

    def _keep(self, manifest: Manifest, index: int, source: str, data: object) -> None:
        """Store chunk `index` that `source` sent if it is the manifest's; else penalise the source."""
        version = manifest.version
        digest, size = manifest.chunks[index]
        if not isinstance(data, bytes) or len(data) != size or sha256(data) != digest:
            self.penalties[source] += 1
            self.stats["bad_chunks"] += 1
            log.warning("chunk %d of v%d from %s failed its hash check; penalised", index, version, source[-8:])
            return
        if version not in self.store.manifests:
            return  # dropped while this request was out (the learner moved on): nothing to keep
        if not self.store.put(version, index, data):
            return  # a second copy (the endgame asked two holders): counted once
        self.chunk_at[index] = time.monotonic()
        learner = source == self.learner
        self.stats["from_learner" if learner else "from_peers"] += 1
        self.stats["bytes_from_learner" if learner else "bytes_from_peers"] += size
        log.debug("chunk %d of v%d from %s", index, version, "the learner" if learner else source[-8:])
        if learner:
            self.learner_chunk_at[index] = time.monotonic()

    def _unavailable(self, source: str, exc: Exception) -> None:
        """A request to `source` failed on the connection: skip it for DEAD_FOR seconds."""
        self.stats["failures"] += 1
        self.dead_until[source] = time.monotonic() + DEAD_FOR
        log.info("chunk request to %s: %s", "the learner" if source == self.learner else source[-8:], exc)

    def _exchange_have_maps(self, manifest: Manifest, held: set[int]) -> None:
        """Trade have-maps with the learner (which only records ours, for `echo-rl status`) and with every
        listed peer at once (one round trip for all of them, not one each on a slow link)."""
        version, n = manifest.version, len(manifest.chunks)
        ask = {"version": version, "have": bitmap(held, n), "run_id": manifest.run_id, "full": is_full(manifest)}

        def trade(peer: str) -> None:
            try:
                reply = self.host.request(peer, HAVE, ask, timeout=5)
            except (PeerUnavailable, RemoteError):
                # a learner that refuses us (restarted, it forgot our authentication) rests like any peer: its
                # trades every HAVE_REFRESH would each count against us until the worker authenticates again
                self.dead_until[self.learner if peer == self.learner_addr else peer] = time.monotonic() + DEAD_FOR
                return
            if peer == self.learner_addr:
                return
            try:  # None: the peer is not fetching this version (it moved on, or has not seen it yet)
                have = from_bitmap(reply["have"], n) if isinstance(reply.get("have"), bytes) else None
            except BadRequest:
                self.penalties[peer] += 1  # a map of the wrong size
                return
            if have is None:
                self.peer_have[peer].pop(version, None)
            else:
                self.peer_have[peer][version] = have

        learner = [self.learner_addr] if self._alive(self.learner) else []
        peers = [*self.peers, *self.punched()]
        list(self._traders.map(trade, [*learner, *(p for p in peers if self._alive(p))]))
        if time.monotonic() - self._last_join > 2.0:  # learn about peers that joined after us, and who left
            self._last_join = time.monotonic()
            try:
                self.join(timeout=5, learner=self.learner)
            except (PeerUnavailable, RemoteError):
                pass

    def stats_dict(self) -> dict[str, Any]:
        return dict(self.stats)
