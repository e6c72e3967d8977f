"""The worker's background fetcher: keeps the next policy version ready while the engine generates.

    every poll_s, and at once when the learner announces a version (/echo/announce/1):
    heartbeat -> newest version v' announced by the learner
    v' newer than what the engine runs (or has staged)?  sync to it through the swarm (deltas, checked
    by hash), then stage it in the engine beside the live weights; the daemon installs it between leases

So a new version costs the worker only the swap (microseconds for llama.cpp: a pointer; a copy for
transformers), not the broadcast time B: the capacity model's supply is no longer reduced by B
(docs/capacity-model.md). One version is staged at a time: a newer one is fetched once the staged one
is installed, so the engine is at most one fetch behind the learner.

The fetcher owns the raw weights last fetched (`held`, the base the next delta applies to); the daemon
owns the engine's version. Errors are the fetcher's to absorb: it logs, waits and tries again; the
daemon's own requests notice an unreachable learner.

Several LoRA versions at once (`slots` > 1: SpecReply.adapter_slots, `echo-rl serve`'s tenants): once the base
runs, the fetcher stages nothing more; it fetches the adapters of the active versions (the heartbeat's
`active`: requests wait on them), or of the newest while none is, keeps `slots` of them (dropping those no
request waits on first), and the daemon loads a lease's version itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2p.broadcast import BroadcastPeer, VersionDropped
from p2p.codec import CodecError
from p2p.host import PeerUnavailable, RemoteError, Unauthorized
from p2p.manifest import Manifest, ManifestError
from p2p.messages import MessageError, ModelSpec, is_adapter
from p2p.versions import tensors_of

log = logging.getLogger(__name__)


@dataclass
class StagedVersion:
    """A version fetched and loaded into the engine beside the live weights, not yet installed."""

    version: int
    engine_state: Any  # what engine.stage() returned
    fetch_s: float  # seconds from seeing the version announced to staged


class VersionFetcher:
    """Runs on its own thread for one run of the learner (a new run_id gets a new fetcher).

    `newest()` sends a heartbeat and returns the newest version the learner announced. `running()` is
    the version the engine runs (-1: none yet)."""

    def __init__(
        self,
        peer: BroadcastPeer,
        engine: Any,
        spec: ModelSpec,
        newest: Callable[[], int],
        running: Callable[[], int],
        poll_s: float = 1.0,
        slots: int = 1,
        active: Callable[[], tuple[int, ...]] = tuple,
    ) -> None:
        self.peer = peer
        self.engine = engine
        self.spec = spec
        self._newest = newest
        self._running = running
        self.poll_s = poll_s
        self.slots = slots  # LoRA versions whose adapters are kept, the daemon switching per lease (docstring)
        self._active = active  # () -> the versions the learner has requests waiting on
        self.adapters: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # version -> adapters, oldest first
        self.held: tuple[int, bytes] | None = None  # (version, raw 16-bit weights as published)
        self._held_manifest: Manifest | None = None  # the manifest of held[0]
        self.announced = -1  # newest version the learner announced
        self.fetching = -1  # version being fetched now (-1: none)
        self.engine_base = -1  # the weights version last staged (the engine's base once installed)
        self._staged: StagedVersion | None = None
        self.taken = -1  # the version the daemon took last (it installs it, then runs it)
        self._lock = threading.Lock()
        self.ready = threading.Event()  # set while a staged version waits to be installed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fetcher", daemon=True)
        peer.on_announce = lambda version: self.poke()  # the learner published: sync now, not at the next poll

    def start(self) -> VersionFetcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop fetching (a sync in flight is abandoned) and free a staged version."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.engine.discard(staged.engine_state)

    def poke(self) -> None:
        """Check the learner's newest version now rather than at the next poll."""
        self._wake.set()

    def take(self) -> StagedVersion | None:
        """The staged version, for the daemon to install between leases (None if none is ready)."""
        with self._lock:
            staged, self._staged = self._staged, None
            self.ready.clear()
            if staged is not None:
                self.taken = staged.version
        if staged is not None:
            self._wake.set()  # the slot is free: fetch the next one if there is one
        return staged

    def held_adapters(self) -> dict[int, dict[str, np.ndarray]]:
        """The LoRA versions whose adapters are kept now (slots > 1), for one lease request and its lease."""
        with self._lock:
            return dict(self.adapters)

    def _keep(self, version: int, adapters: dict[str, np.ndarray], wanted: frozenset[int] = frozenset()) -> None:
        """Keep `version`'s adapters; beyond `slots`, drop the oldest fetched, those not `wanted` first."""
        with self._lock:
            self.adapters[version] = adapters
            while len(self.adapters) > self.slots:
                old = next((v for v in self.adapters if v not in wanted), next(iter(self.adapters)))
                del self.adapters[old]

    def _current(self) -> int:
        """The version the engine runs, or the one the daemon took to install (not to be fetched again)."""
        return max(self._running(), self.taken)

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        backoff = self.poll_s
        while not self._stop.is_set():
            try:
                self.announced = self._newest()
                if self.slots > 1 and self._current() >= 0 and self.held is not None:  # adapters only, never staged
                    self._fetch_held()
                elif self._staged is None and self.announced >= 0 and self.announced != self._current():
                    self._fetch_and_stage()
                backoff = self.poll_s
            except VersionDropped as exc:  # the learner moved on while we fetched: go for the newest at once
                log.debug("fetcher: %s; fetching the newest", exc)
                backoff = self.poll_s
                self._wake.set()
            except (PeerUnavailable, Unauthorized, RemoteError, MessageError, TimeoutError) as exc:
                if self._stop.is_set():
                    return
                log.info("fetcher: %s; trying again in %.0fs", exc, backoff)
                backoff = min(backoff * 2, 10.0)
            except (CodecError, ManifestError) as exc:  # a bad version: start over from a full snapshot
                log.warning("could not rebuild the policy (%s); fetching it again", exc)
                self.held = None
            except (OSError, RuntimeError) as exc:  # the engine could not stage it (disk full, a bad GGUF):
                # the worker keeps generating with its version while the learner admits it; say so loudly
                log.error("fetcher: could not stage v%d (%s); trying again in %.0fs", self.announced, exc, backoff)
                backoff = min(backoff * 2, 30.0)
            finally:
                self.fetching = -1
            self._wake.wait(backoff)
            self._wake.clear()

    def _fetch_and_stage(self) -> None:
        """Sync to the learner's newest version and stage it in the engine.

        A LoRA version carries only adapters for the full weights of an earlier version (its adapter_base):
        sync the weights to that base if they are not held, then fetch the adapters and stage them (on the
        staged base, or on the engine's loaded one)."""
        tick = time.perf_counter()
        self.fetching = self.announced
        # LoRA: adapters on a base that stays; otherwise the newest weights, whichever version that is by
        # the time the learner answers (pinning a version a fast learner has dropped since would livelock)
        lora = self.peer.fetch_manifest() if self.spec.lora_rank else None
        base = None if lora is None else lora.version if lora.adapter_base is None else lora.adapter_base
        if base is None or self.held is None or self.held[0] != base:
            known = self._held_manifest.weights_sha256 if self.held is not None and self._held_manifest else None
            result = self.peer.sync(self.held, stop=self._stop, version=base, held_sha256=known)
            if result is not None:
                self._held_manifest, self.held = result[0], (result[0].version, result[1])
        if self.held is None:
            return
        weights, adapters, version = None, None, self._current()
        if self.held[0] != self.engine_base:  # new weights (a LoRA run's full snapshot carries adapters too)
            tensors = tensors_of(self._held_manifest, self.held[1])
            weights = {name: a for name, a in tensors.items() if not is_adapter(name)}
            adapters = {name: a for name, a in tensors.items() if is_adapter(name)} or None
            version = self.held[0]
        if lora is not None and lora.adapter_base is not None and lora.version != version:
            adapters = tensors_of(lora, self.peer.fetch_adapters(lora, stop=self._stop))
            version = lora.version
            if self.slots > 1:
                self._keep(version, adapters)
        if weights is None and adapters is None:
            return
        state = self.engine.stage(self.spec, weights, adapters)
        if weights is not None:
            self.engine_base = self.held[0]
        staged = StagedVersion(version, state, time.perf_counter() - tick)
        with self._lock:
            self._staged = staged
            self.ready.set()
        log.debug("v%d staged (%.1fs to fetch and load)", version, staged.fetch_s)

    def _fetch_held(self) -> None:
        """(slots > 1) Fetch the adapters of the active versions not kept (at most `slots` of them), or of the
        newest where none is active, newest first; the version the engine runs counts as kept."""
        base = self.held[0] if self.held is not None else -1
        active = frozenset(v for v in self._active() if v > base)
        wanted = sorted(active, reverse=True)[: self.slots] if active else [self.announced]
        for version in [v for v in wanted if v > base and v not in self.held_adapters() and v != self._running()]:
            if self._stop.is_set():
                return
            self.fetching = version
            manifest = self.peer.fetch_manifest(version)
            if manifest.adapter_base != base:  # adapters on another base: not a version to switch to
                continue
            self._keep(version, tensors_of(manifest, self.peer.fetch_adapters(manifest, stop=self._stop)), active)
            log.debug("v%d's adapters kept (%d versions held)", version, len(self.adapters))
