"""Hole punching between workers behind NAT: py-libp2p's circuit relay v2 and DCUtR, checked.

Two workers behind NAT routers cannot dial each other. With `HostConfig(relay=True)` (the learner) a host
serves as a circuit relay v2 hop for the peers it allows (those that joined), with limits that let a
hole punch's handshakes through and nothing bigger (RELAY_LIMITS): chunks never cross the relay. With
`HostConfig(hole_punch=True)` (workers) a host accepts relayed connections and runs DCUtR: a worker
behind NAT reserves a slot at the relay, the other dials it through the relay, and both then dial each
other's observed address at once (TCP simultaneous open through both NAT routers); the relayed
connection is closed once the direct one works (py-libp2p closes it after a grace period).

What we add to py-libp2p 0.8.1's own classes: the relay serves only peers the learner allows, and DCUtR
dials only addresses at the IP the learner observed the far peer at (DCUtR takes the addresses a peer
reports of itself, so a hostile peer could otherwise have us dial any host it names).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from typing import Any

from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from multiaddr import Multiaddr

log = logging.getLogger(__name__)

# The relay carries a hole punch's handshakes (Noise, yamux, identify, DCUtR: tens of KB), not data:
# circuits end after two minutes or 1 MiB, a peer holds 4 at most, and 256 peers may hold a reservation.
RELAY_LIMITS = RelayLimits(duration=120, data=1 << 20, max_circuit_conns=4, max_reservations=256)
PUNCH_DIAL_TIMEOUT = 2  # seconds per dial of a punch (py-libp2p's 10 s default waits out private addresses)


class GatedRelay(CircuitV2Protocol):
    """A circuit relay v2 hop that serves only the peers `allowed(peer_id)` says yes to (reservations and
    circuits alike); anyone else's hop stream is reset unread."""

    def __init__(self, host: Any, allowed: Callable[[str], bool]) -> None:
        super().__init__(host, limits=RELAY_LIMITS, allow_hop=True)
        self.allowed = allowed

    async def _handle_hop_stream(self, stream: Any) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            allowed = self.allowed(peer)
        except Exception:  # noqa: BLE001 - a bug in the gate refuses, it does not crash the relay
            log.exception("relay gate failed on %s", peer[-8:])
            allowed = False
        if not allowed:
            await stream.reset()
            return
        await super()._handle_hop_stream(stream)


class CheckedDCUtR(DCUtRProtocol):
    """DCUtR that dials a peer only at the IP `ips[peer_id]` names (the learner's observation of it)."""

    def __init__(self, host: Any, ips: dict[str, str]) -> None:
        super().__init__(host, dial_timeout=PUNCH_DIAL_TIMEOUT)
        self.ips = ips

    async def _dial_peer(self, peer_id: Any, addr: Multiaddr, *args: Any, **kwargs: Any) -> None:
        expected, ip = self.ips.get(peer_id.to_base58()), tcp_ip(addr)
        if expected is None or ip != expected:
            log.debug("hole punch to %s: %s is not at %s; not dialled", peer_id.to_base58()[-8:], addr, expected)
            return
        await super()._dial_peer(peer_id, addr, *args, **kwargs)


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
