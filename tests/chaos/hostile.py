"""A hostile peer for the chaos tests: raw bytes on libp2p streams, and requests a buggy or malicious
worker would send. It drives a p2p.Host from the test thread (its trio internals, which only tests use)."""

from __future__ import annotations

import trio
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2p.host import Host


def hostile_host(key: Ed25519PrivateKey | None = None) -> Host:
    return Host(key or Ed25519PrivateKey.new()).start()


def send_raw(host: Host, peer: str, protocol: str, data: bytes, timeout: float = 10.0, close: bool = False) -> str:
    """Write `data` on a fresh stream (and close our side if `close`) and read until the other side answers,
    closes or resets. Returns "reset" (the stream was reset or closed without a reply) or "reply"."""

    async def go() -> str:
        with trio.fail_after(timeout):
            try:
                stream = await host._host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
            except Exception:  # noqa: BLE001 - refused before a stream opened (e.g. we are banned)
                return "reset"
            try:
                await stream.write(data)
                if close:
                    await stream.close()
                got = await stream.read(5)
                return "reply" if got else "reset"
            except Exception:  # noqa: BLE001 - a reset shows up as an exception on read
                return "reset"

    return host._run(go)


def hold_streams(host: Host, peer: str, protocol: str, n: int, timeout: float) -> list[str]:
    """Open `n` streams, send 2 bytes of a 5-byte header on each and never finish the request.
    Returns how each ended: "reset" (the peer gave up on us) or "open" (still open after `timeout`)."""

    async def one(results: list[str]) -> None:
        try:
            stream = await host._host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
            await stream.write(b"\x00\x00")
            with trio.move_on_after(timeout):
                try:
                    await stream.read(5)
                except Exception:  # noqa: BLE001
                    pass
                results.append("reset")
                return
            results.append("open")
        except Exception:  # noqa: BLE001 - refused at once
            results.append("reset")

    async def go() -> list[str]:
        results: list[str] = []
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one, results)
        return results

    return host._run(go)
