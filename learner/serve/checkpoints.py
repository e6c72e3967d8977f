"""`echo-rl serve`'s checkpoints on disk, so that a restart of the server loses none of them.

    ROOT/OWNER/RUN/run.json                    what the training run is (base model, LoRA rank)
    ROOT/OWNER/RUN/weights/NAME/               save_state: adapters.safetensors, optimizer.pt, meta.json
    ROOT/OWNER/RUN/sampler_weights/NAME/       save_weights_for_sampler(NAME): adapters.safetensors, meta.json

RUN is the training client's model id (its tinker:// path is tinker://RUN/weights/NAME). OWNER is a hash of
the API key, so a key finds its own checkpoints after a restart and no other key's (anyone else's are "not
found"), and lists only its own folder. A checkpoint is written to a temporary folder (.NAME.tmp), the old
one renamed aside (.NAME.old), the new one into place, the old one deleted: a crash leaves one of them, and
the next start puts an orphaned .old back. The swap, deletes and expiry hold one lock (saves run on the model
thread, deletes on the event loop). Paths from clients are matched against RUN_ID and NAME (no leading dot)
before they touch the disk; TTLs are kept (an expired checkpoint is gone at its next lookup).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy

from learner.serve.futures import NotFound
from learner.serve.wire import RequestError

RUN_ID = re.compile(r"sess-[0-9a-f]{16}:train:\d{1,9}")  # the model ids learner.serve.service makes
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # no leading dot: ".", "..", and our .tmp/.old
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> the SDK's checkpoint_type
MAX_CHECKPOINTS_PER_KEY = 256


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RunInfo:
    """What a training client is: enough to build its model again from a checkpoint."""

    base_model: str
    lora_rank: int  # 0: full fine-tuning (every weight trained; "adapters" then hold them all)
    head: bool  # adapters on the output layer too (train_unembed)
    seed: int = 0

    @property
    def full(self) -> bool:
        return self.lora_rank == 0

    def lora_fields(self) -> dict:
        """What the SDK's types say of the run's weights (TrainingRun, WeightsInfoResponse, GetInfoResponse)."""
        return {"is_lora": not self.full, "lora_rank": None if self.full else self.lora_rank}


@dataclass(frozen=True)
class Found:
    """A checkpoint found on disk: its folder, its run and its meta.json."""

    folder: Path
    run_id: str
    kind: str  # weights or sampler_weights
    run: RunInfo
    meta: dict


class CheckpointStore:
    """The checkpoints under `root` (made if missing)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        for old in self.root.glob("*/*/*/.*.old"):  # a crash between the two renames of a save
            final = old.with_name(old.name[1:].removesuffix(".old"))
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(final)
        for tmp in self.root.glob("*/*/*/.*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)

    # -- runs

    def add_run(self, run_id: str, key: str, run: RunInfo, user_metadata: dict | None) -> None:
        folder = self.root / owner_of(key) / run_id
        folder.mkdir(parents=True, exist_ok=True)
        record = {"owner": owner_of(key), "run": asdict(run), "user_metadata": _strings(user_metadata),
                  "created": time.time()}  # fmt: skip
        _write_json(folder / "run.json", record)

    def run_record(self, key: str, run_id: str) -> dict:
        """run.json of `run_id` if `key` owns it (else NotFound)."""
        if not RUN_ID.fullmatch(run_id):
            raise NotFound(f"training run {run_id!r}")
        try:
            return json.loads((self.root / owner_of(key) / run_id / "run.json").read_text())
        except (OSError, ValueError):
            raise NotFound(f"training run {run_id!r}") from None

    def runs(self, key: str) -> list[tuple[str, dict]]:
        """(run id, run.json) of every run of `key`, newest first."""
        out = []
        mine = self.root / owner_of(key)
        for folder in mine.iterdir() if mine.is_dir() else ():
            try:
                out.append((folder.name, self.run_record(key, folder.name)))
            except NotFound:
                continue
        return sorted(out, key=lambda item: -item[1].get("created", 0))

    # -- checkpoints

    def save(
        self, key: str, run_id: str, kind: str, name: str, adapters: dict[str, np.ndarray],
        optimizer: dict | None = None, ttl_seconds: int | None = None, user_metadata: dict | None = None,
        overwrite: bool = True,
    ) -> str:  # fmt: skip
        """Write a checkpoint of `key`'s run; returns its tinker:// path."""
        self.run_record(key, run_id)
        if not NAME.fullmatch(name):
            raise RequestError(f"checkpoint name {name[:40]!r}: use 1 to 128 letters, digits, . _ or -")
        if ttl_seconds is not None and not 1 <= ttl_seconds <= 10 * 365 * 86400:
            raise RequestError(f"ttl_seconds {ttl_seconds}: 1 s to 10 years, or none (never expires)")
        final = self.root / owner_of(key) / run_id / kind / name
        if final.exists() and not overwrite:
            raise RequestError(f"checkpoint {kind}/{name} exists: pass overwrite=True, or another name")
        if not final.exists() and len(self.checkpoints(key)) >= MAX_CHECKPOINTS_PER_KEY:
            raise RequestError(f"this key holds {MAX_CHECKPOINTS_PER_KEY} checkpoints (the server's limit): "
                               "delete some (RestClient.delete_checkpoint)")  # fmt: skip
        tmp = final.with_name(f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        now = time.time()
        meta = {"time": now, "expires": now + ttl_seconds if ttl_seconds else None,
                "user_metadata": _strings(user_metadata)}  # fmt: skip
        try:
            tmp.mkdir(parents=True)
            save_numpy({n: np.ascontiguousarray(a) for n, a in adapters.items()}, str(tmp / "adapters.safetensors"))
            if optimizer is not None:
                torch.save(optimizer, tmp / "optimizer.pt")
            meta["size_bytes"] = sum(f.stat().st_size for f in tmp.iterdir())
            _write_json(tmp / "meta.json", meta)
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(f"could not write checkpoint {final}: {exc}") from None
        old = final.with_name(f".{name}.old")
        with self.lock:
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        return f"tinker://{run_id}/{kind}/{name}"

    def find(self, key: str, path: str, kind: str | None = None) -> Found:
        """The checkpoint at tinker:// `path` if `key` owns it (else NotFound; RequestError if no such path)."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or (kind is not None and parts[1] != kind):
            want = f"tinker://RUN/{kind or 'weights'}/NAME"
            raise RequestError(f"{path[:80]!r} is not a checkpoint path of this kind ({want})")
        run_id, found_kind, name = parts
        record = self.run_record(key, run_id)
        folder = self.root / owner_of(key) / run_id / found_kind / name
        try:
            meta = json.loads((folder / "meta.json").read_text()) if NAME.fullmatch(name) else None
        except (OSError, ValueError):
            meta = None
        if meta is None:
            raise NotFound(f"checkpoint {path!r}")
        if meta.get("expires") and meta["expires"] < time.time():
            with self.lock:
                shutil.rmtree(folder, ignore_errors=True)
            raise NotFound(f"checkpoint {path!r} (it expired)")
        return Found(folder, run_id, found_kind, RunInfo(**record["run"]), meta)

    def adapters(self, found: Found) -> dict[str, np.ndarray]:
        return load_numpy(str(found.folder / "adapters.safetensors"))

    def optimizer(self, found: Found) -> dict:
        file = found.folder / "optimizer.pt"
        if not file.exists():
            raise RequestError("this checkpoint holds no optimizer state (a sampler checkpoint?): load without it")
        return torch.load(file, map_location="cpu", weights_only=True)

    def checkpoints(self, key: str, run_id: str | None = None) -> list[dict]:
        """The SDK's Checkpoint objects of `key` (of one run), newest first."""
        out = []
        if run_id is not None:
            self.run_record(key, run_id)  # (checks the id before it names a folder)
        for rid, _ in [(run_id, None)] if run_id is not None else self.runs(key):
            for kind, kind_name in KINDS.items():
                for folder in sorted((self.root / owner_of(key) / rid / kind).glob("[!.]*")):
                    path = f"tinker://{rid}/{kind}/{folder.name}"
                    try:
                        meta = self.find(key, path).meta
                    except (NotFound, RequestError):
                        continue
                    out.append(_checkpoint(path, kind, kind_name, folder.name, meta))
        return sorted(out, key=lambda c: c["time"], reverse=True)

    def delete(self, key: str, path: str) -> None:
        folder = self.find(key, path).folder
        with self.lock:
            try:
                shutil.rmtree(folder)
            except FileNotFoundError:
                raise NotFound(f"checkpoint {path!r}") from None


def _checkpoint(path: str, kind: str, kind_name: str, name: str, meta: dict) -> dict:
    expires = meta.get("expires")
    return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": kind_name, "time": iso(meta["time"]),
            "tinker_path": path, "size_bytes": meta.get("size_bytes"), "public": False,
            "user_metadata": meta.get("user_metadata"), "expires_at": iso(expires) if expires else None}  # fmt: skip


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _strings(metadata: dict | None) -> dict[str, str] | None:
    """User metadata as the SDK types it (str -> str), bounded."""
    if not metadata:
        return None
    out = {str(k)[:128]: str(v)[:1024] for k, v in list(metadata.items())[:64]}
    return out


def _write_json(file: Path, record: Any) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(file)
