"""Building a policy version (manifest + chunks) from tensors, and rebuilding tensors from chunks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from p2p.codec import (
    SPARSE_BELOW,
    CodecError,
    TensorEntry,
    changed_words,
    decode,
    decode_sparse,
    encode,
    encode_sparse,
    layout,
    sha256,
    split_chunks,
    unlayout,
)
from p2p.manifest import Manifest
from p2p.weights import to_float32


@dataclass
class PolicyVersion:
    """A signed manifest and the chunks of its encoded payload."""

    manifest: Manifest
    chunks: list[bytes]


def build_version(
    run_id: str,
    version: int,
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | None = None,
    base: tuple[int, bytes] | None = None,
    chunk_size: int | None = None,
    adapter_base: int | None = None,
) -> tuple[PolicyVersion, bytes]:
    """Encode `tensors` as a full snapshot, or as a delta against `base` = (base version, base raw bytes).
    With `adapter_base`, `tensors` are LoRA adapters for the full weights of that version.

    Returns the (unsigned) version and the raw bytes, which the caller keeps as the next delta's base.
    """
    entries, raw = layout(tensors, dtypes)
    return build_from_raw(run_id, version, entries, raw, base, chunk_size, adapter_base), raw


def build_from_raw(
    run_id: str,
    version: int,
    entries: list[TensorEntry],
    raw: bytes,
    base: tuple[int, bytes] | None = None,
    chunk_size: int | None = None,
    adapter_base: int | None = None,
) -> PolicyVersion:
    """build_version for weights already laid out (`entries`, `raw`): e.g. a full snapshot of the raw
    bytes a delta was just built from."""
    codec = "full-zstd"
    if base is not None:
        changed = changed_words(raw, base[1]) if len(raw) == len(base[1]) and len(raw) % 2 == 0 else None
        sparse = changed is not None and len(changed) < SPARSE_BELOW * len(raw) // 2
        codec = "sparse-zstd" if sparse else "xor-zstd"
    if codec == "sparse-zstd":
        payload = encode_sparse(raw, base[1], changed)
    else:
        payload = encode(raw, None if base is None else base[1])
    chunks = split_chunks(payload, chunk_size)
    manifest = Manifest(
        run_id=run_id,
        version=version,
        base_version=None if base is None else base[0],
        base_sha256=None if base is None else sha256(base[1]),
        codec=codec,
        tensors=entries,
        chunks=[(sha256(c), len(c)) for c in chunks],
        raw_size=len(raw),
        weights_sha256=sha256(raw),
        adapter_base=adapter_base,
    )
    return PolicyVersion(manifest, chunks)


def rebuild_raw(
    manifest: Manifest, chunks: list[bytes], base_raw: bytes | None = None, base_sha256: str | None = None
) -> bytes:
    """Check every chunk and the result against the manifest; return the raw weights bytes.

    base_sha256: the hash of base_raw when the caller knows it (it rebuilt base_raw against a manifest
    and has not changed it since), which saves hashing the whole base again."""
    if len(chunks) != len(manifest.chunks):
        raise CodecError(f"have {len(chunks)} chunks, manifest lists {len(manifest.chunks)}")
    for i, (chunk, (digest, size)) in enumerate(zip(chunks, manifest.chunks, strict=True)):
        if len(chunk) != size or sha256(chunk) != digest:
            raise CodecError(f"chunk {i} does not match its hash")
    if manifest.base_version is not None:
        if base_raw is None:
            raise CodecError(f"version {manifest.version} is a delta on version {manifest.base_version}: base needed")
        if (base_sha256 if base_sha256 is not None else sha256(base_raw)) != manifest.base_sha256:
            raise CodecError(f"version {manifest.version} must be applied to a different base")
    payload = b"".join(chunks)
    if manifest.codec == "sparse-zstd":
        raw = decode_sparse(payload, manifest.raw_size, base_raw)
    else:
        raw = decode(payload, manifest.raw_size, base_raw if manifest.base_version is not None else None)
    if sha256(raw) != manifest.weights_sha256:
        raise CodecError(f"version {manifest.version} rebuilt to the wrong weights (hash mismatch)")
    return raw


def tensors_of(manifest: Manifest, raw: bytes) -> dict[str, np.ndarray]:
    return unlayout(manifest.tensors, raw)


def float_tensors(manifest: Manifest, raw: bytes) -> dict[str, np.ndarray]:
    """A version's tensors as float32 arrays, as engines load them."""
    return {name: to_float32(array) for name, array in tensors_of(manifest, raw).items()}
