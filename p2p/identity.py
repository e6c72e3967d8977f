"""Peer identities: a worker's or learner's ed25519 key on disk, its libp2p peer id, signatures by it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.peer.id import ID

from p2p.config import ConfigError


class IdentityError(ConfigError):
    """An identity file that cannot be used (or is in use)."""


def load_identity(path: str | Path) -> Ed25519PrivateKey:
    """Load the ed25519 key in `path`, or create it (mode 0600) if the file does not exist."""
    path = Path(path).expanduser()
    if path.exists():
        data = path.read_bytes()
        try:
            return Ed25519PrivateKey.from_bytes(data)
        except Exception:  # noqa: BLE001 - any decoding failure means the same thing to the user
            raise IdentityError(
                f"identity file {path} is not an ed25519 key ({len(data)} bytes); move it away to create a new one"
            ) from None
    key = Ed25519PrivateKey.new()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    os.replace(tmp, path)
    return key


def hold_identity(path: str | Path) -> IO:
    """Hold `path`.lock exclusively for as long as the returned file stays open (the process's life): two
    processes on one identity would be one peer to the swarm, and the second would fight the first over
    its store. IdentityError if another process holds it."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path.with_name(path.name + ".lock"), "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise IdentityError(
            f"identity {path} is in use by another worker on this machine (pid {holder}): give this one its own "
            "with --name NAME (or --gpu N)"
        ) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def peer_id_of(key: Ed25519PrivateKey) -> str:
    return ID.from_pubkey(key.get_public_key()).to_base58()


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True if `signature` over `data` was made by the key behind `peer_id` (an ed25519 peer id)."""
    try:
        public_key = ID.from_base58(peer_id).extract_public_key()
        return public_key is not None and public_key.verify(data, signature)
    except Exception:  # noqa: BLE001 - a malformed id or signature is simply not valid
        return False


def new_identity() -> Ed25519PrivateKey:
    """A throwaway identity (a benchmark node, `echo-rl status`)."""
    return Ed25519PrivateKey.new()
