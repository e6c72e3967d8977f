"""The rollout journal: what the learner promised, on disk before the promise is made.

A worker is told "accepted" only after its groups are appended to the journal, and a step's batch is
appended before the step trains. So when the learner is killed, `--resume` restores the newest
checkpoint (step c), trains again the journaled steps after c on exactly the groups they used, and
puts every accepted group that no step used back into the replay buffer: no accepted rollout and no
optimizer step is lost. Groups that were leased but never returned are leased again.

Records (msgpack maps, each framed as u32 length, u32 crc32, body; a torn last record is ignored):

    {"t": "group", "group", "version", "worker", "rollouts": [[prompt, completion, logprobs, reward, advantage]]}
    {"t": "lease", "groups": [...], "next": n}           prompt groups handed out (n: the next group id)
    {"t": "step", "step", "batch": [...], "set_aside": [...], "stale": [...]}   group ids
    {"t": "drop", "groups": [...]}                       groups of a worker caught forging

Files: RUN_DIR/journal/NNNNNN.log holds what happened after checkpoint NNNNNN and starts with the
groups still pending then. After each checkpoint a new file is written (atomically) and older ones are
deleted, so the journal stays the size of the replay buffer. Appends are flushed and fsync'd.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from learner.orchestrate.rollouts import Rollout, ScoredGroup
from learner.plan.admission import within_staleness

log = logging.getLogger(__name__)

FRAME = struct.Struct(">II")  # body length, crc32 of the body


def group_record(group: ScoredGroup) -> dict[str, Any]:
    rollouts = [
        [r.prompt_ids, r.completion_ids, r.behaviour_logprobs, r.reward, r.advantage]
        + ([r.spans] if r.spans else [])
        + ([True] if r.failed else [])
        for r in group.rollouts
    ]  # an episode's spans as a sixth field, its failure as a seventh: older journals read the same
    return {"t": "group", "group": group.group_id, "version": group.version, "worker": group.worker,
            "rollouts": rollouts}  # fmt: skip


def group_of(record: dict[str, Any]) -> ScoredGroup:
    version = record["version"]
    rollouts = [Rollout(p, c, lp, reward, adv, version, *spans) for p, c, lp, reward, adv, *spans in record["rollouts"]]
    return ScoredGroup(record["group"], version, record["worker"], rollouts)


@dataclass
class JournalState:
    """What the journal files say, replayed from the newest checkpoint."""

    groups: dict[int, dict[str, Any]] = field(default_factory=dict)  # group id -> its record (accepted)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> its record
    issued: set[int] = field(default_factory=set)  # group ids leased out
    consumed: set[int] = field(default_factory=set)  # group ids in a journaled batch, set aside or stale
    next_group: int = 0  # the next prompt group id to lease

    def apply(self, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "group":
            self.groups[record["group"]] = record
        elif kind == "lease":
            self.issued.update(record["groups"])
            self.next_group = max(self.next_group, record.get("next", 0), max(record["groups"], default=-1) + 1)
        elif kind == "step":
            self.steps[record["step"]] = record
            self.consumed.update(record["batch"], record["set_aside"], record.get("stale", []))
        elif kind == "drop":
            self.consumed.update(record["groups"])

    def pending(self) -> list[int]:
        """Accepted groups that no journaled step used: they go back into the replay buffer."""
        return sorted(g for g in self.groups if g not in self.consumed)

    def unreturned(self) -> list[int]:
        """Leased groups that never came back: they are leased again."""
        return sorted(self.issued - set(self.groups) - self.consumed)


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The complete records of one journal file, and the number of bytes of a torn tail (0 if none)."""
    data = path.read_bytes()
    records, at = [], 0
    while at + FRAME.size <= len(data):
        length, crc = FRAME.unpack_from(data, at)
        body = data[at + FRAME.size : at + FRAME.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        records.append(msgpack.unpackb(body, raw=False, strict_map_key=False))
        at += FRAME.size + length
    return records, len(data) - at


def journal_files(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "journal"
    if not root.is_dir():
        return []
    return sorted((int(p.stem), p) for p in root.glob("*.log") if p.stem.isdigit())


def read_journal(run_dir: Path, checkpoint_step: int) -> JournalState:
    """Replay the journal of a run up to now, starting at the newest file written at or before
    `checkpoint_step` (a crash between a checkpoint and its journal file leaves the previous file)."""
    state = JournalState()
    files = [(step, path) for step, path in journal_files(run_dir) if step <= checkpoint_step]
    if not files:
        return state
    records, torn = read_records(files[-1][1])
    for record in records:
        state.apply(record)
    if torn:  # written when the learner died: its worker was never told "accepted"
        log.info("journal: a record cut short by the crash (%d bytes) is ignored", torn)
    return state


class RolloutJournal:
    """Appends records to the current journal file; thread-safe (handlers and the training loop write).

    Staleness S: a group generated by version x is dropped when a step at version v > x + S runs,
    as the replay buffer does, and the journal forgets it at that step too.
    """

    def __init__(self, run_dir: Path, staleness: int, fsync: bool = True) -> None:
        self.root = run_dir / "journal"
        self.staleness = staleness
        self.fsync = fsync
        self.state = JournalState()
        self._file: BinaryIO | None = None
        self._lock = threading.Lock()

    def open(self, checkpoint_step: int, state: JournalState | None = None) -> None:
        """Start the file of checkpoint `checkpoint_step` from `state` (a resumed run's journal)."""
        with self._lock:
            self._rewrite_locked(checkpoint_step, state or JournalState())

    def accept(self, groups: list[ScoredGroup]) -> None:
        """Record accepted groups (one fsync for all of a submission)."""
        self._append(*[group_record(g) for g in groups])

    def issue(self, group_ids: list[int]) -> None:
        self._append({"t": "lease", "groups": list(group_ids)})

    def drop(self, group_ids: list[int]) -> None:
        if group_ids:
            self._append({"t": "drop", "groups": list(group_ids)})

    def step(self, step: int, batch: list[ScoredGroup], set_aside: list[ScoredGroup]) -> list[int]:
        """Record the batch of `step` (trained at version step - 1) before it trains; returns the ids of
        the groups that fell out of the staleness bound (the replay buffer dropped them)."""
        version = step - 1
        with self._lock:
            used = {g.group_id for g in batch + set_aside}
            stale = [
                g for g in self.state.pending()
                if not within_staleness(version, self.state.groups[g]["version"], self.staleness) and g not in used
            ]  # fmt: skip
        record = {
            "t": "step", "step": step, "batch": [g.group_id for g in batch],
            "set_aside": [g.group_id for g in set_aside], "stale": stale,
        }  # fmt: skip
        self._append(record)
        return stale

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is on disk: start a new file holding only what is still pending."""
        with self._lock:
            self._rewrite_locked(step, self.state)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _append(self, *records: dict[str, Any]) -> None:
        bodies = [msgpack.packb(record, use_bin_type=True) for record in records]
        with self._lock:
            for body in bodies:
                self._write_locked(self._file, body)
            self._sync_locked(self._file)
            for record in records:
                self.state.apply(record)

    def _write_locked(self, f: BinaryIO | None, body: bytes) -> None:
        if f is None:
            raise RuntimeError("the rollout journal is not open")
        f.write(FRAME.pack(len(body), zlib.crc32(body)) + body)

    def _sync_locked(self, f: BinaryIO) -> None:
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def _rewrite_locked(self, step: int, old: JournalState) -> None:
        """Write journal file `step` (a checkpoint's) from `old`: pending groups, groups of steps after it,
        those steps, unreturned leases. Then delete every other file."""
        new = JournalState()
        records: list[dict[str, Any]] = []
        later = [old.steps[s] for s in sorted(old.steps) if s > step]
        needed = set(old.pending()) | {g for r in later for g in r["batch"] + r["set_aside"] if g in old.groups}
        records += [old.groups[g] for g in sorted(needed)]
        records.append({"t": "lease", "groups": old.unreturned(), "next": old.next_group})
        records += later
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{step:06d}.log"
        tmp = final.with_suffix(".tmp")
        with tmp.open("wb") as f:
            for record in records:
                self._write_locked(f, msgpack.packb(record, use_bin_type=True))
                new.apply(record)
            self._sync_locked(f)
        if self._file is not None:
            self._file.close()
        os.replace(tmp, final)
        self._file = final.open("ab")
        self.state = new
        for other_step, path in journal_files(self.root.parent):
            if other_step != step:
                path.unlink(missing_ok=True)
