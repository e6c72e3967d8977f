"""The swarm's peer list (/echo/join/1): what the learner hands joiners, and the checks that keep it honest.

The peer list is strangers' input handed to strangers, so the learner checks it (PeerRegistry, which
p2p.broadcast.Seeder keeps): a joiner announces at most MAX_ADDRS addresses HOST/tcp/PORT/p2p/<its own id>
(anything else is a penalty); each is dialled back from a host of the learner's with an identity of its own
(DialBack: in the background, a few at a time, a bounded queue) and handed out only once it reached the
announced peer; a peer leaves the list when it is banned or the learner has heard nothing from it for
`silence` seconds. A worker (p2p.broadcast.BroadcastPeer) registers and returns at once, and dials the listed
peers in the background (BackgroundPool), a few at a time with short timeouts, skipping bad entries
(listed_addrs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import multiaddr

from p2p.host import BadRequest, Host, Misbehaviour, PeerUnavailable

log = logging.getLogger(__name__)

MAX_PEERS = 4096  # peers the learner's registry holds (peers are forgotten when they go silent)
MAX_ADDRS = 8  # addresses one peer may announce
MAX_ADDR_CHARS = 255  # characters in one announced address
ADDR_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")  # then /tcp/PORT: the one transport hosts speak (p2p.host)
PEER_SILENCE = 30.0  # seconds without a request after which a peer leaves the learner's list (swarm.worker_silence)
# A libp2p connection takes about 6 round trips (TCP, multistream, noise, yamux): 1.2 s at 200 ms, 1.8 s when
# a packet of it is lost (echo_cli/netlab.py, docs/benchmarks.md); peers 200 ms from each other on a busy CPU
# need more. A silent address holds one of a few background slots this long, never a join or a lease.
PROBE_TIMEOUT = 6.0  # seconds the learner's dial-back of one announced address may take
PROBE_WORKERS = 4  # dial-backs at once
PROBE_BACKLOG = 64  # dial-backs queued or running; a join finding it full is checked at its next re-join
PROBE_RETRY = 30.0  # seconds before an address whose dial-back failed is dialled back again
DIAL_TIMEOUT = 6.0  # seconds a worker gives one listed address of a peer (PROBE_TIMEOUT)
DIAL_WORKERS = 4  # a worker's dials at once
DIAL_BACKLOG = 16  # peers a worker is dialling or about to; the rest of a list waits for the next refresh
DIAL_RETRY = 30.0  # seconds before a worker dials a listed peer it could not reach again
REACH = {True: "public", False: "nat", None: "unchecked"}  # PeerRegistry.reached's verdicts as status shows them


def checked_addr(addr: object, peer: str) -> str:
    """`addr` in canonical form if it is an address the swarm can dial for `peer`: ip4, ip6 or dns host, a TCP
    port, then /p2p/ and `peer` itself. Anything else raises Misbehaviour (a joiner announces only its own)."""
    if not isinstance(addr, str) or not 0 < len(addr) <= MAX_ADDR_CHARS:
        raise Misbehaviour(f"join: an address must be a string of 1 to {MAX_ADDR_CHARS} characters")
    try:
        parts = [(proto.name, value) for proto, value in multiaddr.Multiaddr(addr).items()]
        canonical = str(multiaddr.Multiaddr(addr))
    except Exception as exc:  # noqa: BLE001 - the parser's errors are all "not a multiaddr"
        raise Misbehaviour(f"join: {addr[:80]!r} is not a multiaddr ({type(exc).__name__})") from None
    names = [name for name, _ in parts]
    if len(parts) != 3 or names[0] not in ADDR_HOSTS or names[1:] != ["tcp", "p2p"] or parts[1][1] == "0":
        raise Misbehaviour(f"join: {addr[:80]!r} is not HOST/tcp/PORT/p2p/ID (HOST one of {', '.join(ADDR_HOSTS)})")
    if parts[2][1] != peer:
        raise Misbehaviour(f"join: {addr[:80]!r} does not end in the joiner's own id")
    return canonical


def checked_addrs(addrs: object, peer: str) -> list[str]:
    """The addresses a joiner announced, checked (checked_addr) and without repeats: at most MAX_ADDRS."""
    if not isinstance(addrs, list):
        raise Misbehaviour("join: 'addrs' must be the list of the joiner's multiaddrs")
    if len(addrs) > MAX_ADDRS:
        raise Misbehaviour(f"join: {len(addrs)} addresses announced, at most {MAX_ADDRS}")
    return list(dict.fromkeys(checked_addr(a, peer) for a in addrs))


def listed_addrs(peer: object, addrs: object) -> list[str]:
    """The usable addresses of one entry of a peer list: strings ending in /p2p/<peer>, at most MAX_ADDRS
    (the learner sends only those; this keeps a worker safe from anything else)."""
    if not isinstance(peer, str) or not isinstance(addrs, list):
        return []
    return [a for a in addrs if isinstance(a, str) and a.endswith(f"/p2p/{peer}")][:MAX_ADDRS]


class BackgroundPool:
    """A ThreadPoolExecutor of `workers` threads that holds at most `backlog` jobs queued or running: a flood
    of work is refused (submit returns False), never piled up. A job that raises is logged at debug level
    and forgotten. close() drops the queued jobs; the running ones finish."""

    def __init__(self, name: str, workers: int, backlog: int) -> None:
        self.name, self.backlog = name, backlog
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._futures: set[Future[None]] = set()  # jobs queued or running
        self._closed = False
        # never held while calling into the executor's shutdown (its cancellations call _done, which takes it)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a job leaves _futures

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return len(self._futures)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue `job`; False (and nothing queued) when the backlog is full or the pool is closed."""
        with self._lock:
            if self._closed or len(self._futures) >= self.backlog:
                return False
            try:
                future = self._executor.submit(self._run, job)
            except RuntimeError:  # the interpreter is shutting down
                return False
            self._futures.add(future)
        future.add_done_callback(self._done)  # (outside the lock: it runs at once if the job is done already)
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is queued or running; whether that happened within `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._futures, timeout)

    def close(self) -> None:
        """Drop the queued jobs and take no more (running ones finish; the threads then leave)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a job's failure is its own; the pool goes on
            log.debug("%s: job failed: %s: %s", self.name, type(exc).__name__, exc)

    def _done(self, future: Future[None]) -> None:
        """A job ended (ran, or was dropped by close): its place in the backlog is free."""
        with self._idle:
            self._futures.discard(future)
            self._idle.notify_all()


class DialBack:
    """Checks, in the background, that an address a peer announced reaches that peer: a host of its own
    (its own identity, so that the learner's connection to the peer is not what answers) dials exactly that
    address, checks the Noise handshake proved the announced id, and hangs up. At most PROBE_WORKERS at once,
    PROBE_BACKLOG queued (more are refused: submit returns False). The host starts at the first dial-back and
    stops at close(). `on_result(peer, addr, reached)` gets every verdict."""

    def __init__(self, on_result: Callable[[str, str, bool], None], timeout: float = PROBE_TIMEOUT) -> None:
        self.on_result = on_result
        self.timeout = timeout
        self._pool = BackgroundPool("dial-back", PROBE_WORKERS, PROBE_BACKLOG)
        self._host: Host | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, peer: str, addr: str) -> bool:
        """Queue a dial-back of `addr` (announced by `peer`); False when the queue is full."""
        return self._pool.submit(partial(self._probe, peer, addr))

    @property
    def pending(self) -> int:
        """Dial-backs queued or running."""
        return self._pool.pending

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no dial-back is queued or running (tests, benchmarks)."""
        return self._pool.wait_idle(timeout)

    def close(self) -> None:
        """Drop the queued dial-backs and stop the host (the running ones fail at once)."""
        with self._lock:
            self._closed = True
            host, self._host = self._host, None
        self._pool.close()
        if host is not None:
            host.stop()

    def _probe(self, peer: str, addr: str) -> None:
        try:
            self._prober().dial_back(addr, self.timeout)
            reached = True
        except PeerUnavailable as exc:
            log.debug("dial-back of %s failed: %s", addr, exc)
            reached = False
        self.on_result(peer, addr, reached)

    def _prober(self) -> Host:
        """The probing host, started if need be (under the lock: concurrent probes wait for the one start)."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable("dial-backs are closed")
            if self._host is None:
                self._host = Host().start()
            return self._host


@dataclass
class Registered:
    """A peer in the learner's registry: the addresses it announced and what their dial-backs found."""

    addrs: list[str]
    heard: float  # when the learner last heard from it (any request past the gate)
    verified: set[str] = field(default_factory=set)  # addresses that reached it
    failed: dict[str, float] = field(default_factory=dict)  # address -> when its dial-back failed
    probing: set[str] = field(default_factory=set)  # addresses queued for a dial-back or being dialled

    def announce(self, addrs: list[str], now: float) -> None:
        """It joined again with `addrs`: what was found about addresses it no longer announces is dropped."""
        self.addrs, self.heard = addrs, now
        self.verified &= set(addrs)
        self.failed = {a: t for a, t in self.failed.items() if a in addrs}

    def to_probe(self, now: float) -> list[str]:
        """Announced addresses not verified, not being dialled back, and not failed in the last PROBE_RETRY s."""
        fresh = [a for a in self.addrs if a not in self.verified and a not in self.probing]
        return [a for a in fresh if a not in self.failed or now - self.failed[a] >= PROBE_RETRY]

    def reached(self) -> bool | None:
        """True: an address reached it; False: every one it announced failed (behind a NAT); None: unchecked."""
        if self.verified:
            return True
        return False if self.addrs and set(self.failed) >= set(self.addrs) else None

    def listed(self) -> list[str]:
        """What later joiners get: the verified addresses, in the order announced."""
        return [a for a in self.addrs if a in self.verified]


class PeerRegistry:
    """The learner's registry of the peers that joined, and the peer list it hands each joiner.

    `banned()`: the peers banned now; `on_drop(peer)`: called (holding the registry's lock) for every peer
    that leaves; `silence`: seconds without a request from a peer after which it leaves (heard() is told of
    each request); `clock`: the time those are measured on (tests pass their own)."""

    def __init__(
        self,
        banned: Callable[[], Iterable[str]],
        on_drop: Callable[[str], None],
        silence: float = PEER_SILENCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peers: dict[str, list[str]] = {}  # peer id -> the addresses it announced (checked; status shows them)
        self.silence = silence
        self.clock = clock
        self.dial_back = DialBack(self._dialled_back)
        self._banned = banned
        self._on_drop = on_drop
        self._registry: dict[str, Registered] = {}
        self._lock = threading.Lock()

    def join(self, peer: str, addrs: object) -> dict[str, list[str]]:
        """Register `peer` with the addresses it announced, queue dial-backs of the unchecked ones, and return
        the peer list for it. Raises Misbehaviour for bad addresses, BadRequest when the registry is full."""
        addrs = checked_addrs(addrs, peer)
        now = self.clock()
        with self._lock:
            listed = self._listing(now, peer)
            entry = self._registry.get(peer)
            if entry is None:
                if len(self._registry) >= MAX_PEERS:
                    raise BadRequest(f"the learner's peer list is full ({MAX_PEERS})")
                entry = self._registry[peer] = Registered(addrs, now)
            entry.announce(addrs, now)
            self.peers[peer] = addrs
            for addr in entry.to_probe(now):
                if not self.dial_back.submit(peer, addr):
                    log.debug("dial-back queue full: %s is checked at a later join", addr)
                    break
                entry.probing.add(addr)
        return listed

    def joined(self) -> list[str]:
        """Every peer in the registry, listed or not (one behind a NAT too)."""
        with self._lock:
            return list(self._registry)

    def dialling_out(self, joiner: str) -> list[str]:
        """The peers besides `joiner` that joined but whose addresses the dial-back did not reach (behind a
        NAT, or not checked yet): nobody can dial them, but a peer they dialled may fetch from them."""
        with self._lock:
            return [p for p, entry in self._registry.items() if p != joiner and not entry.verified]

    def reached(self, peer: str) -> bool | None:
        """The dial-back's verdict on `peer`: True (an address reached it), False (every one it announced
        failed: behind a NAT), None (not checked yet, or not joined)."""
        with self._lock:
            entry = self._registry.get(peer)
            return None if entry is None else entry.reached()

    def behind_nat(self, joiner: str) -> list[str]:
        """The peers besides `joiner` whose every announced address the dial-back failed to reach."""
        with self._lock:
            return [p for p, entry in self._registry.items() if p != joiner and entry.reached() is False]

    def reach(self, peer: str) -> str:
        """reached(peer) as `status` shows it: public, nat or unchecked."""
        return REACH[self.reached(peer)]

    def listed(self, peer: str) -> list[str]:
        """The addresses of `peer` that later joiners are given (those its dial-back reached)."""
        with self._lock:
            entry = self._registry.get(peer)
            return entry.listed() if entry is not None else []

    def heard(self, peer: str) -> None:
        """A request from `peer` passed the gate: it is alive (the host's network thread: no lock, no wait)."""
        entry = self._registry.get(peer)
        if entry is not None:
            entry.heard = self.clock()

    def forget(self, peer: str) -> None:
        with self._lock:
            self._drop(peer)

    def close(self) -> None:
        """Stop dialling back (the probing host stops); the registry stays readable."""
        self.dial_back.close()

    def _drop(self, peer: str) -> None:
        """Forget a peer (called holding the lock): its addresses and dial-backs, and on_drop's part."""
        self._on_drop(peer)
        self.peers.pop(peer, None)
        self._registry.pop(peer, None)

    def _listing(self, now: float, joiner: str) -> dict[str, list[str]]:
        """The peer list for `joiner` (called holding the lock): every other peer with a verified address.
        Peers banned or silent for longer than `silence` leave the registry here."""
        banned = set(self._banned())
        listed, gone = {}, []
        for peer, entry in self._registry.items():
            if peer in banned or now - entry.heard > self.silence:
                gone.append(peer)
            elif peer != joiner and entry.verified:
                listed[peer] = entry.listed()
        for peer in gone:
            log.info("peer %s leaves the peer list (%s)", peer[-8:], "banned" if peer in banned else "silent")
            self._drop(peer)
        return listed

    def _dialled_back(self, peer: str, addr: str, reached: bool) -> None:
        """A dial-back's verdict: a reached address is handed out from now on; a failed one is not, and is
        not dialled back again for PROBE_RETRY seconds."""
        with self._lock:
            entry = self._registry.get(peer)
            if entry is None:
                return
            entry.probing.discard(addr)
            if addr not in entry.addrs:  # announced no more
                return
            if reached:
                entry.verified.add(addr)
                entry.failed.pop(addr, None)
            else:
                entry.failed[addr] = self.clock()
