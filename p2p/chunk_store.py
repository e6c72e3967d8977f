"""Where a peer keeps the chunks of policy versions: in memory up to a budget, spilled to disk beyond it,
and (for a worker, `persist`) kept across restarts and checked again when it starts."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import msgpack

from p2p.codec import sha256
from p2p.manifest import Manifest, ManifestError
from p2p.versions import PolicyVersion

log = logging.getLogger(__name__)


class ChunkStore:
    """Verified chunks by (version, index): in memory up to `memory_budget` bytes, then spilled to disk.

    `persist` (a worker's store): every chunk and signed manifest is also written to `spill_dir`
    (atomically: a temporary file renamed into place), so a restarted worker need not fetch again what
    it held. `recover` checks those files at start: manifests against the learner's signature, chunks
    against their size and hash; anything corrupt or truncated is deleted, and so fetched again.
    """

    def __init__(
        self, spill_dir: str | Path | None = None, memory_budget: int = 1 << 30, persist: bool = False
    ) -> None:
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.memory_budget = memory_budget
        self.persist = persist and self.spill_dir is not None
        self.memory_used = 0
        self.manifests: dict[int, Manifest] = {}
        self._memory: dict[tuple[int, int], bytes] = {}
        self._on_disk: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def _path(self, version: int, index: int) -> Path:
        return self.spill_dir / f"v{version}" / f"{index:06d}.chunk"

    def add_manifest(self, manifest: Manifest) -> None:
        """Hold `manifest`'s version. One form per version: a manifest listing other chunks than the one
        held (the full snapshot where we began fetching the delta, another run's version) replaces it."""
        with self._lock:
            held = self.manifests.get(manifest.version)
            if held is not None and held.chunks == manifest.chunks and held.run_id == manifest.run_id:
                return
        if held is not None:
            self.drop(manifest.version)
        with self._lock:
            self.manifests[manifest.version] = manifest
        if self.persist:
            _write_atomic(self.spill_dir / f"v{manifest.version}" / "manifest.msgpack",
                          msgpack.packb(manifest.to_dict(), use_bin_type=True))  # fmt: skip

    def put(self, version: int, index: int, data: bytes) -> bool:
        """Keep a chunk; False if it was held already (the second copy of a doubled request)."""
        with self._lock:
            key = (version, index)
            if key in self._memory or key in self._on_disk:
                return False
            to_disk = self.spill_dir is not None and (self.persist or self.memory_used + len(data) > self.memory_budget)
            if to_disk:
                _write_atomic(self._path(version, index), data)
                self._on_disk.add(key)
            if not to_disk or self.memory_used + len(data) <= self.memory_budget:
                self._memory[key] = data
                self.memory_used += len(data)
            return True

    def get(self, version: int, index: int) -> bytes | None:
        key = (version, index)
        with self._lock:
            if key in self._memory:
                return self._memory[key]
            on_disk = key in self._on_disk
        if on_disk:
            try:
                return self._path(version, index).read_bytes()
            except OSError:  # deleted under us: we no longer hold it
                with self._lock:
                    self._on_disk.discard(key)
        return None

    def held(self, version: int) -> set[int]:
        with self._lock:
            return {i for v, i in set(self._memory) | self._on_disk if v == version}

    def add_version(self, pv: PolicyVersion) -> None:
        self.add_manifest(pv.manifest)
        for i, chunk in enumerate(pv.chunks):
            self.put(pv.manifest.version, i, chunk)

    def drop(self, version: int) -> None:
        with self._lock:
            for key in [k for k in self._memory if k[0] == version]:
                self.memory_used -= len(self._memory.pop(key))
            for key in [k for k in self._on_disk if k[0] == version]:
                self._on_disk.discard(key)
            self.manifests.pop(version, None)
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir / f"v{version}", ignore_errors=True)

    def recover(self, learner: str) -> dict[str, int]:
        """Take back the versions a previous run of this worker left in `spill_dir` (persist only).

        Keeps a version only if its manifest is signed by `learner`, and a chunk only if its size and
        sha256 match; deletes the rest. Returns counts: versions, chunks kept, chunks corrupt."""
        counts = {"versions": 0, "chunks": 0, "corrupt": 0}
        if not self.persist or not self.spill_dir.is_dir():
            return counts
        for folder in sorted(self.spill_dir.glob("v*")):
            try:
                manifest = Manifest.from_dict(msgpack.unpackb((folder / "manifest.msgpack").read_bytes(), raw=False))
                manifest.verify(learner)
                if folder.name != f"v{manifest.version}":
                    raise ManifestError(f"{folder.name} holds the manifest of v{manifest.version}")
            except (OSError, ValueError, msgpack.UnpackException) as exc:
                log.warning("stored version %s is unusable (%s): deleted", folder.name, exc)
                shutil.rmtree(folder, ignore_errors=True)
                continue
            with self._lock:
                self.manifests[manifest.version] = manifest
            counts["versions"] += 1
            for path in folder.glob("*.chunk"):
                index = int(path.stem) if path.stem.isdigit() else -1
                data = path.read_bytes()
                if 0 <= index < len(manifest.chunks) and (sha256(data), len(data)) == tuple(manifest.chunks[index]):
                    with self._lock:
                        self._on_disk.add((manifest.version, index))
                    counts["chunks"] += 1
                else:
                    log.warning("stored chunk %s of v%d is corrupt or truncated: deleted, it will be fetched again",
                                path.name, manifest.version)  # fmt: skip
                    path.unlink(missing_ok=True)
                    counts["corrupt"] += 1
            for tmp in folder.glob("*.tmp"):  # a write cut short by a crash
                tmp.unlink(missing_ok=True)
        return counts


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
