"""Policy versions as bytes on the wire: full snapshots and exact XOR deltas of 16-bit weights.

A version's tensors are laid end to end in a fixed order (the tensor index) as their raw bit patterns
(bf16 or f16 as uint16, or any other dtype as-is). A full snapshot is zstd(raw). A delta against a
base version is zstd(raw XOR base_raw): at RL learning rates most 16-bit values do not change between
versions, so the XOR is mostly zero bytes and compresses far below the snapshot. Before compressing,
the bytes are split into planes (all high bytes, then all low bytes) because the high byte (sign and
exponent) changes even more rarely than the low one. Reconstruction is bit-exact and checked against
the sha256 of the raw weights; a delta applies only to the base whose hash it names.

A sparse delta (when few 16-bit words changed, as with the learner's --wire-topk) lists them instead:
zstd(count, the gaps between the indices of changed words as uint32, the XOR of each changed word),
integers in byte planes too. It costs bytes in proportion to the changed words (scattered changes
break the zero runs of a dense XOR into many short ones), and the worker applies it in time
proportional to them as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

ZSTD_LEVEL = 3
MIN_CHUNK, MAX_CHUNK = 256 * 1024, 4 * 1024 * 1024  # bytes
CHUNKS_PER_VERSION = 128
# chunks a version may have beyond its default count when a smaller chunk size is asked for: a manifest costs
# ~72 bytes a chunk, and a joining worker's reply holds a snapshot's and up to ~20 deltas' in one 8 MiB frame
MOST_CHUNKS = 4096


def chunk_size_for(payload_size: int) -> int:
    """The largest power of two <= payload_size / CHUNKS_PER_VERSION, within [MIN_CHUNK, MAX_CHUNK].

    Once the learner's last chunk of a version has left it, peers relay that chunk to the rest in a few
    hops, each the time one chunk takes on a peer's uplink: smaller chunks shorten that tail, while every
    chunk costs a request (a 64 MiB version in 512 KiB chunks, docs/benchmarks.md "Broadcast"). So a
    version has 128 to 256 chunks, fewer only when they would be smaller than 256 KiB (a LoRA version of
    4 MB: 16) or more when larger than 4 MiB (a 14 GB snapshot: 3,500)."""
    size = MIN_CHUNK
    while size < MAX_CHUNK and size * 2 * CHUNKS_PER_VERSION <= payload_size:
        size *= 2
    return size


class CodecError(ValueError):
    """A payload that cannot be decoded into the weights it claims to be."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # "bf16", "f16", or a numpy dtype name
    shape: tuple[int, ...]
    offset: int  # byte offset in the raw layout
    nbytes: int

    def to_list(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_list(cls, item: list) -> TensorEntry:
        name, dtype, shape, offset, nbytes = item
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))


def bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even as torch does."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def layout(
    tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None
) -> tuple[list[TensorEntry], bytes]:
    """The tensor index and the raw bytes of `tensors` (in sorted name order).

    `dtypes` names 16-bit float kinds for uint16 arrays ("bf16" or "f16"); other arrays keep their dtype.
    """
    entries, parts, offset = [], [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        kind = (dtypes or {}).get(name) or ("f16" if array.dtype == np.float16 else array.dtype.name)
        data = array.tobytes()
        entries.append(TensorEntry(name, kind, tuple(array.shape), offset, len(data)))
        parts.append(data)
        offset += len(data)
    return entries, b"".join(parts)


def unlayout(entries: list[TensorEntry], raw: bytes) -> dict[str, np.ndarray]:
    out = {}
    for e in entries:
        dtype = np.uint16 if e.dtype == "bf16" else np.float16 if e.dtype == "f16" else np.dtype(e.dtype)
        out[e.name] = np.frombuffer(
            raw, dtype=dtype, count=e.nbytes // np.dtype(dtype).itemsize, offset=e.offset
        ).reshape(e.shape)
    return out


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _planes(raw: bytes) -> bytes:
    """Byte-plane split of 16-bit words: [b1 of every word][b0 of every word] (+ a trailing odd byte)."""
    even = len(raw) - len(raw) % 2
    words = np.frombuffer(raw, dtype=np.uint8, count=even).reshape(-1, 2)
    return words[:, 1].tobytes() + words[:, 0].tobytes() + raw[even:]


def _unplanes(data: bytes, xor_with: bytes | None = None) -> bytes:
    """Inverse of _planes; with `xor_with`, XORed with it on the way (one copy of the weights, not three:
    each fresh buffer of a version's size costs a page fault per 4 KiB)."""
    half = len(data) // 2
    out = np.empty((half, 2), dtype=np.uint8)
    out[:, 1] = np.frombuffer(data, dtype=np.uint8, count=half)
    out[:, 0] = np.frombuffer(data, dtype=np.uint8, count=half, offset=half)
    tail = data[2 * half :]
    if xor_with is not None:
        if len(xor_with) != len(data):
            raise CodecError(f"delta and base differ in size ({len(data)} vs {len(xor_with)} bytes): wrong base")
        flat = out.reshape(-1)
        np.bitwise_xor(flat, np.frombuffer(xor_with, dtype=np.uint8, count=2 * half), out=flat)
        tail = xor_bytes(tail, xor_with[2 * half :])
    return out.tobytes() + tail


def xor_bytes(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise CodecError(f"delta and base differ in size ({len(a)} vs {len(b)} bytes): wrong base")
    return np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)).tobytes()


def encode(raw: bytes, base_raw: bytes | None = None) -> bytes:
    """Compress a full snapshot (base_raw None) or the XOR delta of raw against base_raw."""
    payload = raw if base_raw is None else xor_bytes(raw, base_raw)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(_planes(payload))


def decode(payload: bytes, raw_size: int, base_raw: bytes | None = None) -> bytes:
    """Inverse of `encode`; raises CodecError on corrupt input."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            planes = reader.read(raw_size + 1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt payload: {exc}") from None
    if len(planes) != raw_size:
        raise CodecError(f"payload decodes to {len(planes)} bytes, expected {raw_size}")
    return _unplanes(planes, base_raw)


SPARSE_BELOW = 0.05  # share of changed 16-bit words under which a delta is encoded sparse


def changed_words(raw: bytes, base_raw: bytes) -> np.ndarray:
    """Indices of the 16-bit words in which raw and base_raw differ (both of one even size)."""
    if len(raw) != len(base_raw) or len(raw) % 2:
        raise CodecError(f"delta and base differ in size or are odd ({len(raw)} vs {len(base_raw)} bytes)")
    return np.flatnonzero(np.frombuffer(raw, np.uint16) != np.frombuffer(base_raw, np.uint16))


def encode_sparse(raw: bytes, base_raw: bytes, changed: np.ndarray) -> bytes:
    """A sparse delta: the changed words' index gaps and XORs (see the module docstring)."""
    gaps = np.diff(changed, prepend=-1).astype(np.uint32)  # [k] >= 1
    xors = np.frombuffer(raw, np.uint16)[changed] ^ np.frombuffer(base_raw, np.uint16)[changed]  # [k]
    gap_planes = gaps.view(np.uint8).reshape(-1, 4).T.tobytes()  # 4 planes: the high ones mostly zero
    body = np.uint64(len(changed)).tobytes() + gap_planes + _planes(xors.tobytes())
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(body)


def decode_sparse(payload: bytes, raw_size: int, base_raw: bytes) -> bytearray:
    """Inverse of `encode_sparse` on `base_raw`; raises CodecError on corrupt input."""
    if len(base_raw) != raw_size or raw_size % 2:
        raise CodecError(f"a sparse delta of {raw_size} bytes needs a base of that size (got {len(base_raw)})")
    try:
        body = zstandard.ZstdDecompressor().decompress(payload, max_output_size=8 + 3 * raw_size)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt payload: {exc}") from None
    k = int(np.frombuffer(body[:8], np.uint64)[0]) if len(body) >= 8 else -1
    if k < 0 or k > raw_size // 2 or len(body) != 8 + 6 * k:
        raise CodecError(f"sparse delta of {len(body)} bytes does not hold the {k} changes it announces")
    gaps = np.frombuffer(body, np.uint8, count=4 * k, offset=8).reshape(4, k).T.copy().view(np.uint32).reshape(-1)
    positions = np.cumsum(gaps, dtype=np.int64) - 1  # [k]
    if k and (gaps.min() < 1 or positions[-1] >= raw_size // 2):
        raise CodecError("sparse delta names a word outside the weights")
    xors = np.frombuffer(_unplanes(body[8 + 4 * k :]), np.uint16)
    out = bytearray(base_raw)  # the one copy of the weights (a bytearray: no second copy into bytes)
    np.frombuffer(out, np.uint16)[positions] ^= xors
    return out


def split_chunks(payload: bytes, chunk_size: int | None = None) -> list[bytes]:
    """`payload` cut into chunks of `chunk_size` bytes (None: chunk_size_for the payload); a size asked for is
    raised where it would make more than MOST_CHUNKS chunks (never above chunk_size_for's)."""
    default = chunk_size_for(len(payload))
    if chunk_size is None:
        chunk_size = default
    else:
        chunk_size = max(chunk_size, min(default, -(-len(payload) // MOST_CHUNKS)))
    return [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)] or [b""]
