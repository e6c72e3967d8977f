"""Frames on a libp2p stream: a 5-byte header (body length, flags) and a msgpack body, maybe zstd'd.

Sizes are checked before anything is decoded: a peer cannot make us allocate more than `max_size`
bytes for one frame, nor decompress a small frame into a huge one.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import msgpack
import zstandard

HEADER = struct.Struct(">IB")  # body length, flags
FLAG_ZSTD = 1
COMPRESS_ABOVE = 64 * 1024  # bytes; small frames are not worth compressing
DEFAULT_MAX_FRAME = 8 * 1024 * 1024


class FrameError(ValueError):
    """A frame that breaks the format or a size limit; the stream carrying it must be dropped."""


def encode_frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    flags = 0
    if len(body) > COMPRESS_ABOVE:
        packed = zstandard.ZstdCompressor(level=1).compress(body)
        if len(packed) < len(body) * 0.9:
            body, flags = packed, FLAG_ZSTD
    return HEADER.pack(len(body), flags) + body


def parse_header(header: bytes, max_size: int) -> tuple[int, int]:
    length, flags = HEADER.unpack(header)
    if length > max_size:
        raise FrameError(f"frame of {length} bytes exceeds the limit of {max_size}")
    if flags & ~FLAG_ZSTD:
        raise FrameError(f"unknown frame flags {flags:#x}")
    return length, flags


def decode_body(body: bytes, flags: int, max_size: int) -> dict[str, Any]:
    if flags & FLAG_ZSTD:
        try:  # a streaming read: the frame's own claimed content size is never trusted for allocation
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                body = reader.read(max_size + 1)
        except zstandard.ZstdError as exc:
            raise FrameError(f"bad zstd body: {exc}") from None
        if len(body) > max_size:
            raise FrameError(f"decompressed frame exceeds the limit of {max_size}")
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_array_len=1_000_000, max_map_len=10_000)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise FrameError(f"bad msgpack body: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise FrameError("a frame must hold a map")
    return message
