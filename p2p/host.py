"""A libp2p host in its own thread, with a blocking API for ordinary threads.

Long because the trio side of a request (framing, limits, decoding off the loop, penalties, replies)
is one path, read top to bottom. With p2p.identity and p2p.guard it is where libp2p and trio are used.

The host speaks TCP with Noise (nothing else: no plaintext, no secio, no TLS fallback) and yamux;
identify and ping stay on so that other libp2p implementations can talk to it. Requests are one frame
each way on a fresh stream (see p2p.wire).

Handlers are plain functions `handler(peer_id, message) -> reply` run in worker threads. A handler
that raises `BadRequest` sends the peer an error reply; any other exception is this host's own failure:
it is logged with its traceback and the peer gets an error reply marked internal (RemoteFailure on its
side: try again later), never a penalty. Nothing a handler does can stop the host.

Every inbound request is bounded before a handler sees it: its protocol's FrameLimits (p2p.wire) cap
its size before it is read and its decoded size and containers while it is decoded, which happens in a
worker thread, off the network loop. It must arrive within `read_timeout`, and a peer may hold only
`max_streams_per_peer` requests open at once. Misbehaviour (any request that cannot be read or decoded,
one too slow to arrive, a `Misbehaviour` or `MessageError` refusal) is a penalty, a request without
authorization or one its sender abandoned mid-frame a tenth of one; a peer with `ban_after` penalties
within `ban_window` seconds is banned for `ban_seconds`: its streams are reset unread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID as MULTISELECT
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address
from libp2p.utils.varint import encode_delim, read_varint_prefixed_bytes_limited

from p2p.guard import PeerGuard, TokenBucket
from p2p.identity import peer_id_of
from p2p.messages import MessageError
from p2p.punch import CheckedDCUtR, GatedRelay, GatedStop, PunchBook
from p2p.wire import (
    DEFAULT_MAX_FRAME,
    HEADER,
    REQUEST_LIMITS,
    FrameError,
    FrameLimits,
    decode_body,
    encode_frame,
    parse_header,
)
from p2p.yamux import use_nonblocking_yamux

log = logging.getLogger(__name__)
use_nonblocking_yamux()
# py-libp2p detaches its "libp2p" logger from the root and gives it no handler, so Python's last-resort
# handler printed its ERROR records (expected dial failures to peers that left) bare on stderr. Propagated,
# they reach the application's handlers, where echo_cli demotes them to debug (p2p.logs).
logging.getLogger("libp2p").propagate = True

Handler = Callable[[str, dict[str, Any]], dict[str, Any]]
# a request without authorization weighs a tenth of a penalty: a worker of a learner that restarted sends a
# few (heartbeat, have-maps, claims) before it authenticates again, and must not be banned for them
UNAUTHORIZED_WEIGHT = 0.1
# a request its sender reset or ended before it was whole weighs a tenth too: an honest peer's own timeout does
# that on a bad link (a learner's announcements through a link cut for 20 s got its worker to ban the learner)
ABANDONED_WEIGHT = 0.1
MAX_OBSERVED = 4096  # peers whose observed address a host remembers
MAX_BOOK = 4096  # peers whose dial addresses a host remembers
MAX_ADDRS = 4  # addresses remembered per peer
CLEANUP_TIMEOUT = 5.0  # seconds closing or resetting a stream may take (a dead link must not hold the caller)


class PeerUnavailable(Exception):
    """Retryable: the peer could not be dialled, reset the stream, sent garbage, or did not answer in time."""


class RemoteError(Exception):
    """The peer answered with an error (it refused our request); retrying the same request will not help."""


class RemoteFailure(RemoteError):
    """The peer failed while answering (its own error, not our request's): retrying later may work."""


class Unauthorized(RemoteError):
    """The peer refused us because we are not authorized (authenticate again: it may have restarted)."""


class UnsupportedProtocol(Exception):
    """The far end of a stream does not speak the protocol we asked for (multistream-select said "na")."""


class BadRequest(Exception):
    """Raised by a handler to refuse a request; the message goes back to the peer as an error reply."""


class Misbehaviour(BadRequest):
    """A refusal that also counts as a penalty against the peer (malformed or forged input, replays)."""


@dataclass
class HostConfig:
    """How a host listens and what it allows itself."""

    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Listen multiaddrs; port 0 picks a free port."""
    upload_bps: float | None = None
    """Cap on bytes/s sent (bandwidth emulation); None = no cap."""
    download_bps: float | None = None
    """Cap on bytes/s received; None = no cap."""
    max_frame: int = DEFAULT_MAX_FRAME
    """Largest frame accepted from a peer, in bytes."""
    start_timeout: float = 20.0
    """Seconds to wait for the host to listen."""
    read_timeout: float = 30.0
    """Seconds a peer has to deliver a whole request frame (a slow peer cannot hold streams open)."""
    max_streams_per_peer: int = 32
    """Requests one peer may have open at once; more are reset unread."""
    ban_after: int = 5
    """Penalties within ban_window seconds after which a peer is banned."""
    ban_window: float = 60.0
    """Seconds over which penalties are counted."""
    ban_seconds: float = 120.0
    """How long a ban lasts."""
    relay: bool = False
    """Serve as a circuit relay for the hole punches of peers behind NAT (the learner; p2p.punch)."""
    hole_punch: bool = False
    """Accept relayed connections and upgrade them to direct ones by hole punching (workers; p2p.punch)."""


class Host:
    """A libp2p host running in a background thread; every public method is safe from any other thread."""

    def __init__(self, key: Ed25519PrivateKey | None = None, config: HostConfig | None = None) -> None:
        self.key = key or Ed25519PrivateKey.new()  # None: a throwaway identity (e.g. `echo-rl status`)
        self.config = config or HostConfig()
        self.peer_id = peer_id_of(self.key)
        self.addrs: list[str] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name=f"p2p-{self.peer_id[-6:]}", daemon=True)
        self._host: Any = None
        self._stop: trio.Event | None = None
        self.guard = PeerGuard(self.config.ban_after, self.config.ban_window, self.config.ban_seconds)
        self.gate: Callable[[str], bool] | None = None  # set: only peers it accepts reach guarded protocols
        self._request_watchers: list[Callable[[str], None]] = []  # told of each request past the gate
        self._open_streams: dict[str, int] = {}  # peer -> requests being read or answered (trio thread only)
        # peer -> the address its last request came from: what we see of it, not what it says (a NAT's address
        # for a worker behind one); the MAX_OBSERVED most recent peers
        self.observed: dict[str, str] = {}
        self._slots: dict[str, trio.Semaphore] = {}  # protocol -> its answer slots (handle(concurrency=...))
        # peer -> the addresses that reached it (connect), the last that answered first; the MAX_BOOK most
        # recent peers (trio thread only)
        self._book: dict[str, list[multiaddr.Multiaddr]] = {}
        self._dial_locks: dict[str, trio.Lock] = {}
        self.relay_for: Callable[[str], bool] = lambda peer: False  # with config.relay: the peers it relays for
        self._punches = PunchBook()  # peer -> the only IP a hole punch may dial it at (allow_punch)
        self._relays: set[str] = set()  # the relays we reserved a slot at: only they bring us relayed connections
        self._circuits: CircuitV2Transport | None = None  # with config.hole_punch
        self._dcutr: CheckedDCUtR | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Host:
        self._thread.start()
        if not self._ready.wait(self.config.start_timeout):
            raise PeerUnavailable(f"libp2p host did not start listening within {self.config.start_timeout}s")
        if self._error is not None:
            raise PeerUnavailable(f"libp2p host failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=10)

    def __enter__(self) -> Host:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to start(), or logged if it happens later
            self._error = exc
            if not self._ready.is_set():
                self._ready.set()
            else:
                log.exception("libp2p host %s stopped", self.peer_id)

    async def _main(self) -> None:
        key_pair = KeyPair(self.key, self.key.get_public_key())
        noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        listen = [multiaddr.Multiaddr(a) for a in self.config.listen]
        host = new_host(
            key_pair=key_pair,
            muxer_preference="YAMUX",  # p2p.yamux: with a read loop that never waits to write
            sec_opt={NOISE_PROTOCOL_ID: noise},  # Noise only: plaintext and secio peers are refused
            listen_addrs=listen,
        )
        self._host = host
        self._stop = trio.Event()
        self._up = TokenBucket(self.config.upload_bps) if self.config.upload_bps else None
        self._down = TokenBucket(self.config.download_bps) if self.config.download_bps else None
        self._decoders = trio.CapacityLimiter(4)  # threads decoding requests at once
        async with host.run(listen_addrs=listen), contextlib.AsyncExitStack() as services:
            await _stop_auto_dials(host)
            if self.config.relay:
                relay = GatedRelay(host, lambda peer: self.relay_for(peer))
                await services.enter_async_context(background_trio_service(relay))
            if self.config.hole_punch:
                stop = GatedStop(host, self._relays)  # accepts the connections our relay brings us
                await services.enter_async_context(background_trio_service(stop))
                self._circuits = CircuitV2Transport(host, stop, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
                self._dcutr = CheckedDCUtR(host, self._punches.ips)
                await services.enter_async_context(background_trio_service(self._dcutr))
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                self.addrs = [f"{a}/p2p/{self.peer_id}" for a in _concrete(host.get_addrs())]
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    # -- calls into the trio thread ---------------------------------------------------------------

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._token is None:
            raise PeerUnavailable("host is not running")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except BaseException as exc:
            if _stopped(exc):
                raise PeerUnavailable("host has stopped") from None
            raise

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a full multiaddr (ending in /p2p/PEER_ID) unless connected to that peer; returns the peer id.
        The address is remembered: requests to the peer id redial it (see _connection)."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{addr!r} is not a multiaddr ending in /p2p/PEER_ID ({exc})") from None

        async def dial() -> None:
            with trio.fail_after(timeout):
                await self._connection(info.peer_id, info.addrs[:1])

        try:
            self._run(dial)
        except PeerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - timeouts, refused dials, failed handshakes
            raise PeerUnavailable(f"cannot reach {addr}: {type(exc).__name__}: {exc}") from None
        return info.peer_id.to_base58()

    async def _connection(self, peer: ID, first: Sequence[multiaddr.Multiaddr] = ()) -> None:
        """Make sure there is a live connection to `peer`, dialling `first`, then the addresses that reached
        it before (connect), until one answers. Only those: py-libp2p would also dial the addresses a peer
        announces of itself in identify (which replace the ones we gave it), so that a worker cut from its
        learner's address would reach it by another, and a hostile peer could have us dial any address it
        names. The caller bounds the time."""
        key = peer.to_base58()
        lock = self._dial_locks.setdefault(key, trio.Lock())  # one dial per peer at a time
        try:
            async with lock:
                network = self._host.get_network()
                known = network.get_connections(peer)
                if [c for c in known if c is not None and not getattr(c, "is_closed", False)]:
                    for addr in first:  # (connected to us first): the address we were given is where to redial
                        self._remember(key, addr)
                    return
                if known:  # closed connections linger in py-libp2p's table, and while they do it dials no more
                    await network.close_peer(peer)  # (a restarted learner: "no valid connections")
                addrs = list(dict.fromkeys([*first, *self._book.get(key, [])]))
                if not addrs:
                    raise PeerUnavailable(f"not connected to {key[-8:]} and no address to dial it at")
                failures = []
                for tried, addr in enumerate(addrs):
                    # an address that never answers (a stale NAT mapping, a firewall that drops) takes its share
                    # of the time left, not all of it: the addresses after it are tried too
                    share = (trio.current_effective_deadline() - trio.current_time()) / (len(addrs) - tried)
                    try:
                        with trio.fail_after(max(share, 0.0)):
                            conn = await network.dial_addr(addr, peer)
                            started = getattr(conn, "event_started", None)
                            if started is not None:  # muxer and stream handlers running
                                await started.wait()
                    except trio.TooSlowError:
                        failures.append(f"{addr}: no answer in {share:.1f}s")
                        continue
                    except Exception as exc:  # noqa: BLE001 - refused, unreachable, another peer's key
                        failures.append(f"{addr}: {type(exc).__name__}: {exc}")
                        continue
                    self._remember(key, addr)
                    return
                raise PeerUnavailable(f"cannot reach {key[-8:]}: {'; '.join(failures)[:500]}")
        finally:
            if self._dial_locks.get(key) is lock and not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._dial_locks.pop(key, None)

    def _remember(self, key: str, addr: multiaddr.Multiaddr) -> None:
        """Book `addr` as the first address to redial peer `key` at (the MAX_BOOK most recent peers)."""
        addrs = [addr, *[a for a in self._book.pop(key, []) if a != addr]][:MAX_ADDRS]
        self._book[key] = addrs  # most recent last
        if len(self._book) > MAX_BOOK:
            self._book.pop(next(iter(self._book)))

    def dial_back(self, addr: str, timeout: float) -> None:
        """Dial exactly `addr` (ending in /p2p/PEER_ID; no other address known for that peer), check that the
        far end proved it holds PEER_ID's key (the Noise handshake), and hang up: whether an address a peer
        announced reaches that peer. Raises PeerUnavailable if it does not. Meant for a host of its own
        (a connection this host already has to the peer would prove nothing about the address)."""
        try:
            target = multiaddr.Multiaddr(addr)
            expected = ID.from_base58(target.value_for_protocol("p2p"))
        except Exception as exc:  # noqa: BLE001
            raise PeerUnavailable(f"{addr!r} is not a multiaddr ending in /p2p/PEER_ID ({exc})") from None

        async def dial() -> None:
            with trio.fail_after(timeout):
                conn = await self._host.get_network().dial_addr(target, expected)
            try:
                if conn.muxed_conn.peer_id != expected:
                    raise PeerUnavailable(f"{addr} is answered by {conn.muxed_conn.peer_id}")
            finally:
                with trio.move_on_after(timeout):
                    await conn.close()
                # forget what the dial taught the peerstore: a prober checks every joiner's addresses, and
                # its peerstore would otherwise keep each one for good
                with contextlib.suppress(Exception):  # (it raises for a peer it does not hold)
                    self._host.get_peerstore().clear_peerdata(expected)

        try:
            self._run(dial)
        except PeerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - timeouts, refused dials, failed handshakes, another peer
            raise PeerUnavailable(f"cannot reach {addr}: {type(exc).__name__}: {exc}") from None

    # -- hole punching (p2p.punch) ------------------------------------------------------------------

    def reserve(self, relay: str, timeout: float = 10.0) -> None:
        """Hold a slot at circuit relay `relay` (a peer id we are connected to) so that peers can reach us
        through it to punch a hole; py-libp2p renews it. Raises PeerUnavailable if refused or unreachable."""

        async def call() -> bool:
            stream = None
            with trio.fail_after(timeout):
                relay_id = ID.from_base58(relay)
                await self._connection(relay_id)
                stream = await self._host.new_stream(relay_id, [RELAY_HOP])
                try:
                    return await self._circuits.reserve(stream, relay_id, self._nursery)
                finally:
                    await _close_quietly(stream)

        if self._circuits is None:
            raise RuntimeError("this host was started without hole_punch")
        self._relays.add(relay)
        try:
            reserved = self._run(call)
        except PeerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - refused stream, timeout, reset
            raise PeerUnavailable(f"no slot at relay {relay[-8:]}: {type(exc).__name__}: {exc}") from None
        if not reserved:
            raise PeerUnavailable(f"relay {relay[-8:]} refused a slot")

    def allow_punch(self, peer: str, ip: str) -> None:
        """A hole punch with `peer` (ours or its) may dial it at `ip` only: where the learner saw it."""
        self._punches.allow(peer, ip)

    def punch(self, peer: str, relay_addr: str, timeout: float = 30.0) -> bool:
        """Try for a direct connection to `peer` (behind a NAT, holding a slot at the relay `relay_addr`, a
        full multiaddr): a relayed connection, then DCUtR's simultaneous dials at the IP allow_punch gave.
        Whether a direct connection to `peer` exists after; never raises for a punch that failed."""
        if self._circuits is None or self._dcutr is None:
            raise RuntimeError("this host was started without hole_punch")
        peer_id = ID.from_base58(peer)

        async def call() -> bool:
            try:
                with trio.move_on_after(timeout):
                    if not self._direct(peer_id):
                        self._host.get_peerstore().clear_addrs(peer_id)  # the circuit goes through our relay only
                        if not self._relayed(peer_id):
                            await self._circuits.dial(multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{peer}"))
                        await self._dcutr.initiate_hole_punch(peer_id)
                return self._direct(peer_id)
            finally:
                if not self._direct(peer_id):  # a failed punch keeps no circuit (nor a slot at the relay)
                    with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
                        for conn in self._relayed(peer_id):
                            with contextlib.suppress(Exception):
                                await conn.close()

        try:
            return bool(self._run(call))
        except PeerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - the relay refused (no slot), a reset, a failed handshake
            log.debug("hole punch to %s failed: %s: %s", peer[-8:], type(exc).__name__, exc)
            return False

    def direct(self, peer: str) -> bool:
        """Whether a live connection to `peer` exists that is not relayed."""
        return self._run_sync(self._direct, ID.from_base58(peer))

    def direct_peers(self) -> set[str]:
        """The peers we hold a live connection to that is not relayed (one call for all of them)."""
        network = self._host.get_network()
        return self._run_sync(lambda: {p.to_base58() for p in list(network.connections) if self._direct(p)})

    def _live(self, peer_id: ID) -> list[tuple[Any, bool]]:
        """Our live connections to `peer_id`, each with whether it is relayed (a /p2p-circuit address)."""
        live = []
        for conn in self._host.get_network().get_connections(peer_id):
            if conn is None or getattr(conn, "is_closed", False):
                continue
            with contextlib.suppress(Exception):
                live.append((conn, any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())))
        return live

    def _relayed(self, peer_id: ID) -> list[Any]:
        """Our live relayed connections to `peer_id`."""
        return [conn for conn, relayed in self._live(peer_id) if relayed]

    def _direct(self, peer_id: ID) -> bool:
        return any(not relayed for _, relayed in self._live(peer_id))

    def watch_requests(self, watcher: Callable[[str], None]) -> None:
        """Have `watcher(peer_id)` called for every request that passed the gate (before its handler runs),
        e.g. to know which peers are alive. It runs on the network thread: it must be quick and never block."""
        self._request_watchers.append(watcher)

    def connected_peers(self) -> list[str]:
        """Peer ids with an open connection (read in the trio thread: the table changes there)."""
        return self._run_sync(lambda: [p.to_base58() for p in self._host.get_network().connections])

    def request(
        self, peer: str, protocol: str, message: dict[str, Any], timeout: float = 30.0, min_rate: float | None = None,
        max_reply: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Send one frame to `peer` (a peer id we are connected to, or a full multiaddr) and return its reply.

        `timeout` bounds the whole exchange; with `min_rate` (bytes/s) a long reply whose header came in time
        may take longer, as long as its body arrives at that rate at least (a chunk from a slow uplink).
        `max_reply`: the largest reply accepted, in bytes (else the host's max_frame).
        Raises PeerUnavailable (retryable) or RemoteError (the peer refused).
        """
        if peer.startswith("/"):
            peer = self.connect(peer, timeout)
        frame = encode_frame(message)

        async def call() -> dict[str, Any]:
            stream = None
            try:
                with trio.fail_after(timeout) as scope:
                    peer_id = ID.from_base58(peer)
                    await self._connection(peer_id)
                    # py-libp2p's new_stream dials a peer it has no connection to at the addresses in its
                    # peerstore, which identify fills with the ones the peer announces: leave it none
                    with contextlib.suppress(Exception):
                        self._host.get_peerstore().clear_addrs(peer_id)
                    stream = await self._host.get_network().new_stream(peer_id)
                    # the request goes out with the protocol it is for, without waiting for multistream-select's
                    # echoes (go-libp2p's lazy negotiation): one round trip, not three. The far end reads the
                    # header, the protocol, then the request, in order; its echoes are checked before the reply
                    await stream.write(encode_delim(MULTISELECT.encode()) + encode_delim(protocol.encode()))
                    await self._write(stream, frame)
                    for expected in (MULTISELECT, protocol):
                        echo = (await read_varint_prefixed_bytes_limited(stream, 1024)).decode("ascii", "replace")
                        if echo != f"{expected}\n":
                            raise UnsupportedProtocol(f"{peer[-8:]} answered {echo.strip()[:80]!r} to {expected}")
                    stream.set_protocol(TProtocol(protocol))
                    reply = await self._read(stream, scope if min_rate else None, min_rate or 0.0, max_reply)
            except BaseException:
                # reset, shielded: this runs in the scope that timed out (or was cancelled), where an
                # unshielded clean-up is cancelled too and the stream keeps one of the connection's slots
                if stream is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT):
                        await _reset_quietly(stream)
                raise
            with trio.move_on_after(CLEANUP_TIMEOUT):
                await _close_quietly(stream)
            return reply

        try:
            reply = self._run(call)
        except PeerUnavailable:
            raise
        except trio.TooSlowError:
            raise PeerUnavailable(f"{protocol} to {peer[-8:]} timed out after {timeout}s") from None
        except UnsupportedProtocol as exc:
            raise RemoteError(f"{protocol} is not served there: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - resets, dial errors, frame errors: all retryable elsewhere
            raise PeerUnavailable(f"{protocol} to {peer[-8:]} failed: {type(exc).__name__}: {exc}") from None
        if "error" in reply:
            kind = (
                Unauthorized if reply.get("unauthorized") else RemoteFailure if reply.get("internal") else RemoteError
            )
            raise kind(str(reply["error"])[:500])
        return reply

    def handle(
        self, protocol: str, handler: Handler, concurrency: int | None = None, guarded: bool = True,
        limits: FrameLimits = REQUEST_LIMITS,
    ) -> None:  # fmt: skip
        """Serve `protocol` with `handler(peer_id, message) -> reply`, run in a worker thread.

        `concurrency` bounds how many requests are answered at once (the rest wait their turn), so that
        a capped uplink sends a few replies at full speed rather than many at a crawl. `guarded`: when
        the host has a gate, only peers it lets through are served (others get an error and a penalty).
        `limits`: what one request may hold (p2p.wire.FrameLimits).
        """
        slots = self._run_sync(trio.Semaphore, concurrency) if concurrency else None
        if slots is not None:
            self._slots[protocol] = slots
        cfg = self.config
        limits = dataclasses.replace(limits, max_bytes=min(limits.max_bytes, cfg.max_frame))  # a host-wide cap too

        async def on_stream(stream: Any) -> None:
            peer = stream.muxed_conn.peer_id.to_base58()
            if self.guard.banned(peer) or self._open_streams.get(peer, 0) >= cfg.max_streams_per_peer:
                await _reset_quietly(stream)
                return
            self._observe(peer, stream)
            self._open_streams[peer] = self._open_streams.get(peer, 0) + 1
            try:
                try:
                    with trio.fail_after(cfg.read_timeout):
                        length, flags = parse_header(await self._read_exactly(stream, HEADER.size), limits.max_bytes)
                        body = await self._read_exactly(stream, length)
                    # decoding costs CPU in proportion to the (bounded) size: not on the network loop
                    message = await trio.to_thread.run_sync(decode_body, body, flags, limits, limiter=self._decoders)
                except (StreamError, StreamEnded) as exc:  # the sender gave up on it (its timeout, a cut link)
                    self.guard.penalise(peer, "abandoned request", ABANDONED_WEIGHT)
                    log.debug("%s from %s abandoned: %s: %s", protocol, peer[-8:], type(exc).__name__, exc)
                    await _reset_quietly(stream)
                    return
                except Exception as exc:  # noqa: BLE001 - every request that cannot be read is the sender's offence
                    self.guard.penalise(peer, "slow request" if isinstance(exc, trio.TooSlowError) else "bad frame")
                    log.warning("%s from %s: %s: %s; stream reset", protocol, peer[-8:], type(exc).__name__, exc)
                    await _reset_quietly(stream)
                    return
                if guarded and self.gate is not None and not self.gate(peer):
                    self.guard.penalise(peer, "unauthorized", UNAUTHORIZED_WEIGHT)
                    await self._write(
                        stream, encode_frame({"error": f"{protocol}: not authorized", "unauthorized": True})
                    )
                    await stream.close()
                    return
                self._tell_watchers(peer)
                if slots is not None:
                    await slots.acquire()
                try:  # the slot is held while the reply is sent: that is what it bounds
                    reply = await trio.to_thread.run_sync(self._answer, protocol, handler, peer, message)
                    await self._write(stream, encode_frame(reply))
                finally:
                    if slots is not None:
                        slots.release()
                await stream.close()
            except Exception as exc:  # noqa: BLE001 - the reply could not be sent (the peer left): no offence
                log.debug("%s to %s: reply not sent: %s: %s", protocol, peer[-8:], type(exc).__name__, exc)
                await _reset_quietly(stream)
            finally:
                left = self._open_streams.get(peer, 1) - 1
                if left:
                    self._open_streams[peer] = left
                else:
                    self._open_streams.pop(peer, None)

        self._run_sync(self._host.set_stream_handler, TProtocol(protocol), on_stream)

    def waiting(self, protocol: str) -> int:
        """Requests of `protocol` waiting for an answer slot now (0 without a concurrency bound): whether
        its answers use all the uplink they are allowed."""
        slots = self._slots.get(protocol)
        return self._run_sync(lambda: slots.statistics().tasks_waiting) if slots is not None else 0

    def _observe(self, peer: str, stream: Any) -> None:
        """Note the address a request of `peer` came from (in the trio thread)."""
        try:
            host, port = stream.get_remote_address()
        except Exception:  # noqa: BLE001 - no address to see (another transport): nothing to note
            return
        self.observed.pop(peer, None)  # most recent last
        self.observed[peer] = f"/{'ip6' if ':' in str(host) else 'ip4'}/{host}/tcp/{port}"
        if len(self.observed) > MAX_OBSERVED:
            self.observed.pop(next(iter(self.observed)))

    def _tell_watchers(self, peer: str) -> None:
        """Tell the request watchers that `peer` sent a request (a watcher's failure is its own: logged)."""
        for watcher in self._request_watchers:
            try:
                watcher(peer)
            except Exception:  # noqa: BLE001 - a bug in a watcher must not cost the peer its request
                log.exception("request watcher failed on a request from %s", peer[-8:])

    def _answer(self, protocol: str, handler: Handler, peer: str, message: dict[str, Any]) -> dict[str, Any]:
        """Run a handler (in a worker thread): its reply, or the error reply its exception calls for."""
        try:
            return handler(peer, message)
        except (BadRequest, MessageError) as exc:
            if isinstance(exc, Misbehaviour | MessageError):
                self.guard.penalise(peer, "misbehaviour")
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - our own failure: logged here, the peer may try again later
            log.exception("%s handler failed on a request from %s", protocol, peer[-8:])
            return {
                "error": f"{protocol}: internal error ({type(exc).__name__}: {exc}); try again later",
                "internal": True,
            }

    def _run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._token is None:
            raise PeerUnavailable("host is not running")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise PeerUnavailable("host has stopped") from None

    # -- frames with bandwidth caps -------------------------------------------------------------------

    async def _write(self, stream: Any, frame: bytes) -> None:
        if self._up is None:
            await stream.write(frame)
            return
        for start in range(0, len(frame), TokenBucket.PIECE):
            piece = frame[start : start + TokenBucket.PIECE]
            await self._up.take(len(piece))
            await stream.write(piece)

    async def _read(
        self, stream: Any, scope: trio.CancelScope | None = None, min_rate: float = 0.0, max_reply: int | None = None
    ) -> dict[str, Any]:
        """A reply to our own request (from a peer we chose to ask): `max_reply` or the host's max_frame bounds it.
        With `scope`, its deadline is pushed back to give the body length / min_rate seconds once the header is in."""
        limit = min(max_reply or self.config.max_frame, self.config.max_frame)
        length, flags = parse_header(await self._read_exactly(stream, HEADER.size), limit)
        if scope is not None:
            scope.deadline = max(scope.deadline, trio.current_time() + length / min_rate)
        body = await self._read_exactly(stream, length)
        return await trio.to_thread.run_sync(decode_body, body, flags, FrameLimits(max_bytes=limit))

    async def _read_exactly(self, stream: Any, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            want = min(n - got, TokenBucket.PIECE)
            if self._down is not None:
                await self._down.take(want)
            data = await stream.read(want)
            if not data:
                raise StreamEnded(f"stream ended after {got} of {n} bytes")
            parts.append(data)
            got += len(data)
        return b"".join(parts)


class StreamEnded(FrameError):
    """A stream that ended before the bytes a frame promised had come."""


def _concrete(addrs: list[Any]) -> list[str]:
    """Listen addresses without /p2p/, a wildcard (0.0.0.0, ::) replaced by this machine's interface
    addresses (py-libp2p's expand_wildcard_address): a peer can dial those, not 0.0.0.0."""
    out = []
    for addr in addrs:
        bare = multiaddr.Multiaddr(str(addr).split("/p2p/")[0])
        wildcard = str(bare).startswith(("/ip4/0.0.0.0/", "/ip6/::/"))
        found = [str(a) for a in expand_wildcard_address(bare)] if wildcard else [str(bare)]
        out += found or [str(bare).replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/")]  # only loopback is up
    return list(dict.fromkeys(out))


def _stopped(exc: BaseException) -> bool:
    """Whether a call into the trio thread ended because the host stopped under it: the run had finished, or
    the call was cancelled by the shutdown (alone, or in a group of such cancellations from a nursery)."""
    if isinstance(exc, trio.RunFinishedError | trio.Cancelled):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None


async def _close_quietly(stream: Any) -> None:
    try:
        await stream.close()
    except Exception:  # noqa: BLE001
        pass


async def _reset_quietly(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001
        pass


async def _stop_auto_dials(host: Any) -> None:
    """Stop py-libp2p's auto-connector (libp2p 0.8.1). It keeps 50 and more connections by dialling every peer in
    the peerstore at the addresses that peer announced in identify: a learner would dial, unasked, addresses no
    dial-back checked (p2p.peer_list), and redial a worker around a link that was cut. Our hosts dial only whom
    they choose (connect, request, the peer list). The swarm starts the connector once its background nursery
    runs, so wait for that first (a stop before it would be undone)."""
    connector = host.get_network().auto_connector
    with trio.move_on_after(10):
        while not connector._started:
            await trio.sleep(0.01)
    if not connector._started:
        raise RuntimeError("py-libp2p's auto-connector did not start: is libp2p still 0.8.1 (pyproject.toml)?")
    await connector.stop()
    network = host.get_network()

    async def no_dial(peer_id: ID) -> list[Any]:
        # the swarm's own dials (a stream to a peer we are not connected to: DCUtR, a circuit transport) go
        # to the addresses in the peerstore, which identify fills with what a peer announces of itself
        if live := [c for c in network.get_connections(peer_id) if c is not None and not getattr(c, "is_closed", 0)]:
            return live
        raise ConnectionError(f"not connected to {peer_id.to_base58()[-8:]}; this host dials only addresses it chose")

    network.dial_peer = no_dial
