"""Signed manifests: what a policy version is made of, vouched for by the learner's key.

A worker accepts a manifest only if it is signed by the learner it joined (its peer id embeds the
ed25519 public key), then trusts each chunk only if its sha256 matches the manifest, and the
reconstructed weights only if their sha256 matches too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from p2p.codec import TensorEntry
from p2p.identity import verify_signature

CODECS = ("full-zstd", "xor-zstd", "sparse-zstd")


class ManifestError(ValueError):
    """A manifest that is malformed or not signed by the expected learner."""


@dataclass(frozen=True)
class Manifest:
    run_id: str
    version: int
    base_version: int | None  # None for a full snapshot
    base_sha256: str | None  # hash of the base's raw weights a delta must be applied to
    codec: str
    tensors: list[TensorEntry]
    chunks: list[tuple[str, int]]  # (sha256 hex, size) per chunk of the encoded payload
    raw_size: int  # bytes of the reconstructed weights
    weights_sha256: str  # hash of the reconstructed weights
    adapter_base: int | None = None  # a LoRA version: adapters only, for the full weights of this version
    signer: str = ""  # the learner's peer id
    signature: bytes = field(default=b"", repr=False)

    @property
    def payload_size(self) -> int:
        return sum(size for _, size in self.chunks)

    def _body(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "base_version": self.base_version,
            "base_sha256": self.base_sha256,
            "codec": self.codec,
            "tensors": [t.to_list() for t in self.tensors],
            "chunks": [list(c) for c in self.chunks],
            "raw_size": self.raw_size,
            "weights_sha256": self.weights_sha256,
            "adapter_base": self.adapter_base,
            "signer": self.signer,
        }

    def signing_bytes(self) -> bytes:
        return msgpack.packb(self._body(), use_bin_type=True)

    def signed(self, key: Any, signer: str) -> Manifest:
        """A copy signed with `key` (an ed25519 private key) as learner `signer`."""
        unsigned = replace(self, signer=signer, signature=b"")
        return replace(unsigned, signature=key.sign(unsigned.signing_bytes()))

    def verify(self, learner_peer_id: str) -> None:
        """Raise ManifestError unless this manifest is signed by `learner_peer_id`."""
        if self.signer != learner_peer_id:
            raise ManifestError(f"manifest v{self.version} is signed by {self.signer[-8:]!r}, not by our learner")
        if not verify_signature(learner_peer_id, self.signing_bytes(), self.signature):
            raise ManifestError(f"manifest v{self.version} has an invalid signature")

    def to_dict(self) -> dict[str, Any]:
        return {**self._body(), "signature": self.signature}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        try:
            manifest = cls(
                run_id=str(data["run_id"]),
                version=int(data["version"]),
                base_version=None if data["base_version"] is None else int(data["base_version"]),
                base_sha256=None if data["base_sha256"] is None else str(data["base_sha256"]),
                codec=str(data["codec"]),
                tensors=[TensorEntry.from_list(t) for t in data["tensors"]],
                chunks=[(str(h), int(s)) for h, s in data["chunks"]],
                raw_size=int(data["raw_size"]),
                weights_sha256=str(data["weights_sha256"]),
                adapter_base=None if data.get("adapter_base") is None else int(data["adapter_base"]),
                signer=str(data["signer"]),
                signature=bytes(data["signature"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from None
        if manifest.codec not in CODECS:
            raise ManifestError(f"unknown codec {manifest.codec!r}")
        if (manifest.codec != "full-zstd") != (manifest.base_version is not None):
            raise ManifestError("a delta names its base version; a full snapshot has none")
        if manifest.adapter_base is not None and (
            manifest.codec != "full-zstd" or manifest.adapter_base >= manifest.version
        ):
            raise ManifestError("a LoRA version is encoded whole and names an earlier version as its base weights")
        return manifest
