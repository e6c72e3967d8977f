"""Hole punching between workers behind NAT: py-libp2p's circuit relay v2 and DCUtR, fenced in.

Two workers behind NAT routers cannot dial each other. With `HostConfig(relay=True)` (the learner) a host
serves as a circuit relay v2 hop for the peers it is told to (those that joined from behind a NAT), for
handshakes only (RELAY_LIMITS): chunks never cross the relay. With `HostConfig(hole_punch=True)` (workers)
a host accepts relayed connections from its relay and runs DCUtR: a worker behind NAT reserves a slot at
the relay, another dials it through the relay, and both then dial each other's observed address at once
(TCP simultaneous open through both NAT routers); the relayed connection is closed once the direct one
works.

Long because py-libp2p 0.8.1's relay and DCUtR are written for a friendly network, and an open swarm is
not one. What we change, each in an override below:
- the relay serves reservations and circuits only between peers the learner allows (re-checked at each
  request), a reservation is always for the peer that asked (py-libp2p takes the peer named in the
  message), a circuit runs only from the peer that starts a punch (its id sorts first) to the other, each
  peer has few circuits open and few per minute at either end, all of them share RELAY_BYTES_PER_S, and a
  circuit ends after RELAY_LIMITS.duration seconds or data bytes, idle or not (py-libp2p checks its
  duration only between reads and counts circuits per destination, after awaits);
- the learner accepts no relayed connection, a worker only those its own relay brings;
- DCUtR dials a peer only at the IP the learner observed it at (DCUtR takes the addresses a peer reports
  of itself, so a hostile peer could otherwise have us dial any host), sprays no UDP at reported QUIC
  addresses, answers only peers we may punch with, one session each at a time, and runs only when
  Host.punch asks (its own loop would punch every relayed connection every 2 s). (p2p.host also stops the
  swarm from dialling a peer it is not connected to at the addresses identify stored.)
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeer
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from p2p.guard import TokenBucket

log = logging.getLogger(__name__)

# The relay carries a hole punch's handshakes (Noise, yamux, identify, DCUtR: tens of KB), not data: a
# circuit ends after a minute or 256 KiB; reservations last 10 minutes (workers renew them), 256 at most.
RELAY_LIMITS = RelayLimits(duration=60, data=256 << 10, max_circuit_conns=4, max_reservations=256,
                           reservation_ttl=600)  # fmt: skip
CIRCUITS_OPEN = 4  # circuits one peer may have open through the relay at once, from it or to it
CIRCUITS_PER_MINUTE = 12  # and may open, or be the destination of, in a minute
CIRCUITS_TOTAL = 64  # circuits open through the relay at once
RELAY_BYTES_PER_S = 64 << 10  # the relay's whole share of the learner's uplink and downlink (~0.5 Mbit/s)
MAX_OBSERVED_ADDRS = 8  # addresses of a DCUtR message we look at (4 KiB could hold hundreds)
SETUP_TIMEOUT = 10.0  # seconds the relay gives the destination to accept a circuit
PUNCH_DIAL_TIMEOUT = 2  # seconds per dial of a punch (py-libp2p's 10 s default waits out private addresses)


class GatedRelay(CircuitV2Protocol):
    """A circuit relay v2 hop for the peers `allowed(peer_id)` says yes to: their reservations, and their
    circuits to each other (bounded per peer); anyone else's hop stream is reset unread."""

    def __init__(self, host: Any, allowed: Callable[[str], bool]) -> None:
        super().__init__(host, limits=RELAY_LIMITS, allow_hop=True)
        self.allowed = allowed
        self._open: dict[str, int] = {}  # peer -> circuits open now that it opened or is the destination of
        self._opened: dict[str, list[float]] = {}  # peer -> when those of the last minute were opened
        self._bucket: TokenBucket | None = None  # RELAY_BYTES_PER_S (made in the trio thread, at first use)

    def _allows(self, peer: str) -> bool:
        try:
            return bool(self.allowed(peer))
        except Exception:  # noqa: BLE001 - a bug in the gate refuses, it does not crash the relay
            log.exception("relay gate failed on %s", peer[-8:])
            return False

    async def _handle_hop_stream(self, stream: Any) -> None:
        if not self._allows(stream.muxed_conn.peer_id.to_base58()):
            await _reset(stream)
            return
        await super()._handle_hop_stream(stream)

    async def _handle_stop_stream(self, stream: Any) -> None:
        await _reset(stream)  # the relay is nobody's destination

    async def _handle_reserve(self, stream: Any, msg: Any) -> None:
        if not self._allows(stream.muxed_conn.peer_id.to_base58()):  # (a hop stream outlives a ban)
            await self._refuse(stream, StatusCode.PERMISSION_DENIED)
            return
        msg.ClearField("peer")  # a reservation is for the peer that asks, never for one it names
        reservations = self.resource_manager._reservations  # (py-libp2p keeps them until they expire)
        if len(reservations) >= RELAY_LIMITS.max_reservations:  # full: drop those of peers that left
            for peer in [p for p in list(reservations) if not self._allows(p.to_base58())]:
                reservations.pop(peer, None)
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: Any, msg: Any) -> None:
        """A circuit from the asker to the peer it names: both allowed, the destination holding a slot and
        connected to us (we dial nobody), within the asker's quotas; piped until it closes, RELAY_LIMITS
        runs out, or either side stalls."""
        source = stream.muxed_conn.peer_id
        src = source.to_base58()
        try:
            dest = ID(msg.peer.id)
        except Exception:  # noqa: BLE001 - a malformed peer id
            await self._refuse(stream, StatusCode.MALFORMED_MESSAGE)
            return
        dst_id = dest.to_base58()
        connected = bool(self.host.get_network().get_connections(dest))  # we dial nobody for a circuit
        reserved = self.resource_manager.has_reservation(dest)
        # the one of two NATed peers whose id sorts first starts their punch (p2p.broadcast): only its circuits
        if not src < dst_id or not connected or not reserved or not self._allows(src) or not self._allows(dst_id):
            await self._refuse(stream, StatusCode.NO_RESERVATION)
            return
        if len(self._opened) > 1024:
            self._forget_idle()
        now = trio.current_time()
        for peer in (src, dst_id):
            self._opened[peer] = [t for t in self._opened.get(peer, []) if now - t < 60.0]
        if (
            sum(self._open.values()) >= 2 * CIRCUITS_TOTAL  # (each circuit counts for both its peers)
            or any(self._open.get(p, 0) >= CIRCUITS_OPEN for p in (src, dst_id))
            or any(len(self._opened[p]) >= CIRCUITS_PER_MINUTE for p in (src, dst_id))
        ):
            self._forget_idle()
            await self._refuse(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        for peer in (src, dst_id):
            self._opened[peer].append(now)
            self._open[peer] = self._open.get(peer, 0) + 1
        if self._bucket is None:
            self._bucket = TokenBucket(RELAY_BYTES_PER_S)
        limit = Limit(duration=RELAY_LIMITS.duration, data=RELAY_LIMITS.data)
        dst_stream = None
        try:
            with trio.move_on_after(RELAY_LIMITS.duration):
                with trio.fail_after(SETUP_TIMEOUT):
                    dst_stream = await self.host.new_stream(dest, [STOP_PROTOCOL_ID])
                    hello = StopMessage(type=StopMessage.CONNECT, peer=CircuitPeer(id=source.to_bytes()), limit=limit)
                    await write_delimited_msg(dst_stream, hello)
                    answer = await read_delimited_msg(dst_stream, StopMessage)
                if answer.status != StatusCode.OK:
                    await self._refuse(stream, StatusCode.CONNECTION_FAILED)
                    return
                await self._send_status(stream, StatusCode.OK, "circuit open", limit=limit)
                budget = [RELAY_LIMITS.data]  # bytes left, both ways together
                async with trio.open_nursery() as pipes:
                    pipes.start_soon(_pipe, stream, dst_stream, budget, self._bucket, pipes.cancel_scope)
                    pipes.start_soon(_pipe, dst_stream, stream, budget, self._bucket, pipes.cancel_scope)
        except Exception as exc:  # noqa: BLE001 - the destination refused, reset or timed out
            log.debug("circuit %s -> %s ended: %s: %s", src[-8:], dst_id[-8:], type(exc).__name__, exc)
        finally:
            for peer in (src, dst_id):
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]
            with trio.CancelScope(shield=True):
                await _reset(stream)
                if dst_stream is not None:
                    await _reset(dst_stream)

    def _forget_idle(self) -> None:
        """Drop the minute's records of peers with no circuit in it (the table stays as small as the traffic)."""
        now = trio.current_time()
        for peer in [p for p, times in self._opened.items() if not [t for t in times if now - t < 60.0]]:
            del self._opened[peer]

    async def _refuse(self, stream: Any, code: StatusCode) -> None:
        await self._send_status(stream, code, "refused")
        await _reset(stream)


class GatedStop(CircuitV2Protocol):
    """The destination side of circuits (STOP) for the relays in `relays` only: a worker accepts relayed
    connections from the learner it reserved a slot at, from nobody else."""

    def __init__(self, host: Any, relays: set[str]) -> None:
        super().__init__(host, limits=RELAY_LIMITS, allow_hop=False)
        self.relays = relays

    async def _handle_stop_stream(self, stream: Any) -> None:
        if stream.muxed_conn.peer_id.to_base58() not in self.relays:
            await _reset(stream)
            return
        await super()._handle_stop_stream(stream)


class CheckedDCUtR(DCUtRProtocol):
    """DCUtR that punches only with the peers in `ips` and dials each only at its IP there (the learner's
    observation of it); TCP only, and only when asked (initiate_hole_punch)."""

    def __init__(self, host: Any, ips: dict[str, str]) -> None:
        super().__init__(host, dial_timeout=PUNCH_DIAL_TIMEOUT)
        self.ips = ips

    async def _auto_drive_loop(self) -> None:
        return  # Host.punch starts each punch

    async def _try_unilateral_upgrade(self, peer_id: Any) -> bool:
        return False  # the peer is behind a NAT: the learner's dial-back found nothing to dial

    async def _spam_udp_for_hole_punch(self, addr: Multiaddr, stop: Any) -> None:
        return  # we punch TCP; a reported QUIC address may be anybody's

    async def _handle_dcutr_stream(self, stream: Any) -> None:
        peer = stream.muxed_conn.peer_id
        if peer.to_base58() not in self.ips or peer in self._in_progress:  # one session per peer at a time
            await _reset(stream)
            return
        await super()._handle_dcutr_stream(stream)

    async def _perform_hole_punch(self, peer_id: Any, addrs: list[Multiaddr], as_responder: bool = False) -> bool:
        expected = self.ips.get(peer_id.to_base58())
        addrs = [a for a in addrs if tcp_ip(a) == expected]
        if not addrs:  # nothing at the IP the learner saw: no rounds of dials to wait out
            return False
        self.host.get_peerstore().clear_addrs(peer_id)  # (py-libp2p adds the addresses the peer announced)
        return await super()._perform_hole_punch(peer_id, addrs, as_responder)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        return super()._decode_observed_addrs(addr_bytes[:MAX_OBSERVED_ADDRS])

    async def _dial_peer(self, peer_id: Any, addr: Multiaddr, *args: Any, **kwargs: Any) -> None:
        expected, ip = self.ips.get(peer_id.to_base58()), tcp_ip(addr)
        if expected is None or ip != expected:
            log.debug("hole punch to %s: %s is not at %s; not dialled", peer_id.to_base58()[-8:], addr, expected)
            return
        await super()._dial_peer(peer_id, addr, *args, **kwargs)


class PunchBook:
    """peer -> the one IP a hole punch with it may dial (the learner's observation), the MAX most recent;
    written from any thread, read by the trio thread (a plain dict read)."""

    MAX = 4096

    def __init__(self) -> None:
        self.ips: dict[str, str] = {}
        self._lock = threading.Lock()

    def allow(self, peer: str, ip: str) -> None:
        with self._lock:
            self.ips.pop(peer, None)
            self.ips[peer] = ip
            while len(self.ips) > self.MAX:
                self.ips.pop(next(iter(self.ips)))


async def _pipe(src: Any, dst: Any, budget: list[int], bucket: TokenBucket, done: trio.CancelScope) -> None:
    """Copy src to dst while the circuit's byte budget lasts, at the relay's rate; then end both directions."""
    try:
        while True:
            data = await src.read(65536)
            if not data:
                return
            budget[0] -= len(data)
            if budget[0] < 0:
                return
            await bucket.take(len(data))
            with trio.fail_after(10.0):
                await dst.write(data)
    except Exception:  # noqa: BLE001 - a reset or a stalled side ends the circuit
        return
    finally:
        done.cancel()


async def _reset(stream: Any) -> None:
    with trio.move_on_after(2.0):
        try:
            await stream.reset()
        except Exception:  # noqa: BLE001 - already closed or reset
            pass


def tcp_ip(addr: Multiaddr | str) -> str | None:
    """The IP of a plain /ip4|ip6/HOST/tcp/PORT address (None for anything else: DNS, circuits, QUIC)."""
    parts = str(addr).split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def checked_ip(value: object) -> str | None:
    """`value` as a canonical IP string if it is one (a peer's report of another's address), else None."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None
