"""Who may work for a learner: an allow-list of peer ids and/or a swarm secret proven by HMAC challenge.

libp2p's Noise handshake already proves that a connection's peer id is the holder of its key, so
authorization is per peer id. With a secret, a worker asks /echo/auth/1 for a fresh nonce and answers

    proof = HMAC-SHA256(secret, "echo-auth/1" | nonce | learner peer id | worker peer id)

The secret never crosses the wire; a proof is bound to one nonce (used once, valid NONCE_TTL seconds)
and to both peer ids, so it cannot be replayed to another learner or by another peer. With an
allow-list, only listed peer ids may authenticate (and with no secret, listed peers are let in at
once). Status requests stay open to anyone: they are read-only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from pathlib import Path

from p2p.config import ConfigError
from p2p.host import BadRequest, Host, Misbehaviour, RemoteError, Unauthorized

AUTH = "/echo/auth/1"  # {} -> {"nonce"} ; {"nonce", "proof"} -> {"ok": true}
NONCE_TTL = 30.0  # seconds a challenge stays answerable
MAX_NONCES = 4096  # challenges outstanding at once (the oldest are forgotten first)


def proof(secret: bytes, nonce: bytes, learner: str, worker: str) -> bytes:
    return hmac.new(secret, b"echo-auth/1" + nonce + learner.encode() + worker.encode(), hashlib.sha256).digest()


def read_secret(path: str | Path) -> bytes:
    """The swarm secret in `path` (its first line, at least 16 characters)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"swarm secret file {str(path)!r} does not exist (create one: echo-rl secret > FILE)")
    secret = path.read_text().strip().encode()
    if len(secret) < 16:
        raise ConfigError(f"swarm secret in {path} is {len(secret)} characters: use at least 16 (echo-rl secret)")
    return secret


def read_allow_list(path: str | Path) -> set[str]:
    """Peer ids, one per line; blank lines and # comments are ignored."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"allow-list {str(path)!r} does not exist (one worker peer id per line)")
    ids = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not (line.startswith(("12D3Koo", "Qm")) and 40 <= len(line) <= 60 and line.isalnum()):
            raise ConfigError(f"allow-list {path}:{n}: {line[:60]!r} is not a peer id (like 12D3KooW...)")
        ids.add(line)
    return ids


class SwarmAuth:
    """The learner's gate: which peers are authorized, and the challenge protocol that authorizes them."""

    def __init__(self, learner: str, secret: bytes | None = None, allow: set[str] | None = None) -> None:
        self.learner = learner
        self.secret = secret
        self.allow = allow
        self.authorized: set[str] = set()
        self._nonces: dict[bytes, tuple[str, float]] = {}  # nonce -> (peer it was given to, when)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.secret is not None or self.allow is not None

    def allows(self, peer: str) -> bool:
        """Whether `peer` may use the guarded protocols (the host's gate)."""
        if not self.enabled:
            return True
        if self.secret is None:
            return peer in self.allow
        return peer in self.authorized

    def on_auth(self, peer: str, msg: dict) -> dict:
        """/echo/auth/1: hand out a nonce, or check a proof."""
        if self.allow is not None and peer not in self.allow:
            raise Misbehaviour("this peer id is not on the learner's allow-list")
        if self.secret is None:
            return {"ok": True}
        nonce, answer = msg.get("nonce"), msg.get("proof")
        now = time.monotonic()
        with self._lock:
            for old in [n for n, (_, t) in self._nonces.items() if now - t > NONCE_TTL]:
                del self._nonces[old]
            if nonce is None:
                while len(self._nonces) >= MAX_NONCES:
                    del self._nonces[next(iter(self._nonces))]
                nonce = secrets.token_bytes(32)
                self._nonces[nonce] = (peer, now)
                return {"nonce": nonce}
            if not isinstance(nonce, bytes) or not isinstance(answer, bytes):
                raise Misbehaviour("auth needs a nonce and a proof (bytes)")
            given = self._nonces.pop(nonce, None)
        if given is None or given[0] != peer:
            raise BadRequest("unknown or expired nonce: ask for a new one")
        if not hmac.compare_digest(answer, proof(self.secret, nonce, self.learner, peer)):
            raise Misbehaviour("wrong swarm secret")
        with self._lock:
            self.authorized.add(peer)
        return {"ok": True}


def authenticate(host: Host, learner_addr: str, secret: bytes | None, timeout: float = 10.0) -> None:
    """Prove to the learner at `learner_addr` that we may work for it (nothing to prove without a secret:
    the learner then only checks its allow-list, if it has one)."""
    learner = learner_addr.rsplit("/p2p/", 1)[-1]
    try:
        reply = host.request(learner_addr, AUTH, {}, timeout=timeout)
        if "nonce" not in reply:
            return
        if secret is None:
            raise Unauthorized("the learner wants a swarm secret: pass --secret-file FILE")
        nonce = reply["nonce"]
        if not isinstance(nonce, bytes) or len(nonce) > 64:
            raise Unauthorized("the learner sent a malformed challenge")
        answer = {"nonce": nonce, "proof": proof(secret, nonce, learner, host.peer_id)}
        host.request(learner, AUTH, answer, timeout=timeout)
    except RemoteError as exc:
        raise Unauthorized(f"the learner refused us: {exc}") from None
