"""py-libp2p's Yamux muxer, except that its read loop never waits to write.

libp2p 0.8.1's read loop answers some frames itself (a ping with a pong, a new stream with its ACK, an
unknown stream with a reset) and writes the answer inline, under the connection's write lock. When two
peers send each other large replies at once (workers serving each other chunks), each side's write lock
is held by a reply blocked on a full TCP buffer; the read loop that would drain the other side's buffer
then waits for that lock, and so does the other side's: neither reads again, and every request on the
connection times out (tests/test_p2p.py: a 3-peer fetch stalled at 5 of 7 chunks, ~1 run in 10). The
same deadlock is known in other yamux implementations (rust-yamux: "read-side deadlock under symmetric
back-pressure").

Here the read loop queues its answers instead, and a sender task writes them when the lock is free; any
other write sends what is queued first, so frames still leave in the order they were made. The queue is
bounded: a peer that sends pings faster than its connection lets us answer gets no more pongs.
"""

from __future__ import annotations

import logging

import trio
from libp2p.stream_muxer import muxer_multistream
from libp2p.stream_muxer.yamux.yamux import Yamux

log = logging.getLogger(__name__)

MAX_QUEUED = 4096  # control frames (12 bytes each) the read loop may leave for the sender


def use_nonblocking_yamux() -> None:
    """Have every connection of this process use NonBlockingYamux. libp2p 0.8.1 builds its Yamux by name in
    muxer_multistream (a muxer class given to new_host is not used for Yamux), so that name is replaced."""
    if getattr(muxer_multistream, "Yamux", None) not in (Yamux, NonBlockingYamux):
        raise RuntimeError("libp2p no longer builds Yamux in muxer_multistream: is it still 0.8.1 (pyproject.toml)?")
    muxer_multistream.Yamux = NonBlockingYamux


class NonBlockingYamux(Yamux):
    """Yamux whose read loop hands the frames it must write to a sender task (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - Yamux's own signature
        super().__init__(*args, **kwargs)
        self._reader: trio.lowlevel.Task | None = None
        self._queued: list[bytes] = []
        self._sending = False

    async def handle_incoming(self) -> None:
        self._reader = trio.lowlevel.current_task()
        await super().handle_incoming()

    async def _write_frame(self, data: bytes) -> None:
        if trio.lowlevel.current_task() is self._reader:
            self._queue(data)
            return
        async with self._write_lock:
            await self._write_queued()
            await self.secured_conn.write(data)
        await trio.lowlevel.checkpoint()

    def _queue(self, frame: bytes) -> None:
        if len(self._queued) >= MAX_QUEUED:
            return  # the peer sends control frames faster than it reads our answers: it loses them
        self._queued.append(frame)
        if not self._sending and self._nursery is not None:
            try:
                self._nursery.start_soon(self._send_queued)
                self._sending = True
            except RuntimeError:  # the connection is closing: nothing more is sent
                self._queued.clear()

    async def _write_queued(self) -> None:
        """Write what the read loop queued (the caller holds the write lock)."""
        while self._queued:
            frames, self._queued = self._queued, []
            await self.secured_conn.write(b"".join(frames))

    async def _send_queued(self) -> None:
        try:
            async with self._write_lock:
                await self._write_queued()
        except Exception as exc:  # noqa: BLE001 - the connection broke: the read loop notices and closes it
            log.debug("yamux control frames to %s not sent: %s", self.peer_id, exc)
            self._queued.clear()
        finally:
            self._sending = False
        if self._queued:  # queued after the lock was let go
            self._queue(self._queued.pop())
