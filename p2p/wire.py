"""Frames on a libp2p stream: a 5-byte header (body length, flags) and a msgpack body, maybe zstd'd.

What a frame may cost is bounded before and while it is decoded (FrameLimits): its size on the wire is
checked before it is read, its size after decompression while it is decompressed, and msgpack refuses
arrays, maps, strings and binaries beyond the limits as it meets them. Every byte of msgpack makes at
most one object, so a frame of n bytes costs O(n) to decode: a request protocol's small limit keeps
a peer from making us decode much (a 1 KiB zstd frame may not expand into 8 MB of tiny objects).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

HEADER = struct.Struct(">IB")  # body length, flags
FLAG_ZSTD = 1
COMPRESS_ABOVE = 64 * 1024  # bytes; small frames are not worth compressing
DEFAULT_MAX_FRAME = 8 * 1024 * 1024


@dataclass(frozen=True)
class FrameLimits:
    """What one frame may hold: bytes (on the wire and decompressed), and per container or string."""

    max_bytes: int = DEFAULT_MAX_FRAME
    max_array: int = 1_000_000
    max_map: int = 10_000
    max_str: int = 1 << 20
    max_bin: int = DEFAULT_MAX_FRAME


REQUEST_LIMITS = FrameLimits(max_bytes=64 * 1024, max_array=4096, max_map=64, max_str=4096, max_bin=64 * 1024)
"""The default for requests a host serves: every request but a rollout submission is small."""


def rollout_frame_limits(tokens: int, completions: int, arrays: int) -> FrameLimits:
    """What a rollout submission of `completions` samples holding `tokens` tokens in all may take: 16 bytes of
    msgpack per token (an int and a float64), 64 per sample and 4 KiB of framing, twice that as slack; no
    array longer than `arrays`."""
    size = 16 * tokens + 64 * completions + 4096
    return FrameLimits(max_bytes=2 * size, max_array=arrays, max_map=16, max_str=64, max_bin=0)


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


def bounded_decompress(data: bytes, max_size: int) -> bytes:
    """zstd `data` decompressed, at most max_size bytes (FrameError otherwise, or if it is not zstd)."""
    try:  # a streaming read: the frame's own claimed content size is never trusted for allocation
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
            out = reader.read(max_size + 1)
    except (zstandard.ZstdError, TypeError) as exc:
        raise FrameError(f"bad zstd body: {exc}") from None
    if len(out) > max_size:
        raise FrameError(f"decompressed data exceeds the limit of {max_size}")
    return out


def decode_body(body: bytes, flags: int, limits: FrameLimits) -> dict[str, Any]:
    """The message of a frame's body, within `limits` (FrameError otherwise)."""
    if flags & FLAG_ZSTD:
        body = bounded_decompress(body, limits.max_bytes)
    try:
        message = msgpack.unpackb(
            body, raw=False, strict_map_key=True,
            max_array_len=limits.max_array, max_map_len=limits.max_map,
            max_str_len=limits.max_str, max_bin_len=limits.max_bin, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise FrameError(f"bad msgpack body: {type(exc).__name__}: {str(exc)[:80]}") from None
    if not isinstance(message, dict):
        raise FrameError("a frame must hold a map")
    return message
