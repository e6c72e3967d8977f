"""Policy versions as bytes on the wire: full snapshots and exact XOR deltas of 16-bit weights.

A version's tensors are laid end to end in a fixed order (the tensor index) as their raw bit patterns
(bf16 or f16 as uint16, or any other dtype as-is). A full snapshot is zstd(raw). A delta against a
base version is zstd(raw XOR base_raw): at RL learning rates most 16-bit values do not change between
versions, so the XOR is mostly zero bytes and compresses far below the snapshot. Before compressing,
the bytes are split into planes (all high bytes, then all low bytes) because the high byte (sign and
exponent) changes even more rarely than the low one. Reconstruction is bit-exact and checked against
the sha256 of the raw weights; a delta applies only to the base whose hash it names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

ZSTD_LEVEL = 3
DEFAULT_CHUNK = 1024 * 1024  # bytes; design: 1 to 4 MiB


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


def split_chunks(payload: bytes, chunk_size: int = DEFAULT_CHUNK) -> list[bytes]:
    return [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)] or [b""]
