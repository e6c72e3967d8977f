"""`echo-rl worker join`: fetch policy versions from the swarm, generate rollouts, push them back.

    join the learner (and its peers) -> get the model spec -> loop:
        heartbeat (newest version?) -> sync to it through the swarm, swap the engine's weights
        lease prompt groups -> generate G completions each with the version held -> push rollouts

The worker serves the chunks it holds to other workers the whole time. It keeps going when the
learner disappears (it retries until the learner is back, e.g. after `learner start --resume`).
SIGINT/SIGTERM let the current lease finish and be pushed, then the worker leaves.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from p2p.auth import authenticate, read_secret
from p2p.broadcast import BroadcastPeer, ChunkStore
from p2p.codec import CodecError
from p2p.config import ConfigError
from p2p.host import Host, HostConfig, PeerUnavailable, RemoteError, RemoteFailure, Unauthorized
from p2p.identity import load_identity
from p2p.manifest import Manifest, ManifestError
from p2p.messages import (
    HEARTBEAT,
    LEASE,
    ROLLOUT,
    SPEC,
    GroupSubmission,
    Heartbeat,
    HeartbeatReply,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    MessageError,
    ModelSpec,
    RolloutReply,
    RolloutSubmission,
    SpecReply,
    describe_hardware,
)
from p2p.versions import tensors_of
from p2p.weights import to_float32
from worker.config import WorkerConfig
from worker.engines import make_engine

log = logging.getLogger(__name__)


class WorkerDaemon:
    """One worker process: swarm peer, engine, lease loop."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.host: Host | None = None
        self.peer: BroadcastPeer | None = None
        self.engine: Any = None
        self.spec: ModelSpec | None = None
        self.held: tuple[int, bytes] | None = None  # (version, raw 16-bit weights as published)
        self.version = -1  # the policy version the engine runs: held[0], or a LoRA version on that base
        self.run_id: str | None = None
        self.tokens_per_s = 0.0
        self.leases_done = 0
        self.newest = -1  # newest version the learner announced
        # declared to the learner with every heartbeat: what this worker runs on
        self.hardware = {
            "engine": cfg.engine,
            "threads": cfg.threads,
            "max_batch": cfg.max_batch,
            "machine": platform.machine(),
            "cores": os.cpu_count() or 0,
        }
        self.state = "starting"  # what the worker is doing now, for the live view
        self.secret = read_secret(cfg.secret_file) if cfg.secret_file else None

    def install_signal_handlers(self) -> None:
        def leave(signum: int, frame: object) -> None:
            log.info("signal %d: finishing the current lease, then leaving", signum)
            self.stop.set()

        signal.signal(signal.SIGINT, leave)
        signal.signal(signal.SIGTERM, leave)

    def run(self) -> None:
        cfg = self.cfg
        work_dir = Path(cfg.work_dir).expanduser()
        self.host = Host(load_identity(cfg.identity), HostConfig(listen=[cfg.listen])).start()
        log.info("worker %s listening on %s", self.host.peer_id, self.host.addrs[0])
        store = ChunkStore(spill_dir=work_dir / "chunks", persist=True)
        found = store.recover(cfg.learner.rsplit("/p2p/", 1)[-1])  # what a previous run of this worker fetched
        if found["versions"]:
            log.info("store: %d versions, %d chunks kept, %d corrupt or truncated chunks deleted (fetched again)",
                     found["versions"], found["chunks"], found["corrupt"])  # fmt: skip
        self.peer = BroadcastPeer(self.host, store, cfg.learner)
        self.engine = make_engine(
            cfg.engine, work_dir / "engine", cfg.threads, cfg.max_batch, cfg.gpu_layers, cfg.device
        )
        self.hardware |= self.engine.backend()  # cpu, or the GPU backend, GPU name and memory
        log.info("engine %s on %s", cfg.engine, describe_hardware(self.hardware))
        backoff = 1.0
        try:
            while not self.stop.is_set():
                try:
                    self._step()
                    backoff = 1.0
                except (PeerUnavailable, Unauthorized) as exc:  # Unauthorized: a wrong secret, or a
                    # restarted learner that forgot us; either way join again (and authenticate) later
                    self.state = "not authorized" if isinstance(exc, Unauthorized) else "learner unreachable"
                    log.warning("%s (%s); retrying in %.0fs", self.state, exc, backoff)
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                    self.spec = None
                except RemoteFailure as exc:  # the learner failed on its side (e.g. its disk): not our fault
                    self.state = "learner error"
                    log.warning("learner error (%s); retrying in %.0fs", exc, backoff)
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                except RemoteError as exc:
                    log.warning("learner refused: %s", exc)
                    self.stop.wait(1.0)
                except MessageError as exc:  # a reply that breaks its schema: not a learner we can work with
                    log.warning("unreadable reply from the learner (%s); joining again", exc)
                    self.spec = None
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                except (CodecError, ManifestError) as exc:  # a bad version: start over from a full snapshot
                    log.warning("could not rebuild the policy (%s); fetching it again", exc)
                    self.held, self.version = None, -1
                    self.stop.wait(1.0)
        finally:
            self.host.stop()
            log.info("worker left after %d leases", self.leases_done)

    def _request(self, protocol: str, message: dict, timeout: float = 30.0) -> dict:
        return self.host.request(self.cfg.learner, protocol, message, timeout=timeout)

    def _step(self) -> None:
        if self.spec is None:
            self.state = "joining"
            authenticate(self.host, self.cfg.learner, self.secret)
            self.peer.join()
            reply = SpecReply.from_wire(self._request(SPEC, {}))
            if reply.group_size > self.cfg.max_batch:
                raise ConfigError(
                    f"worker.max_batch {self.cfg.max_batch} is below the learner's group size {reply.group_size}: "
                    f"join with --max-batch {reply.group_size} or more"
                )
            self.spec = reply.spec
            if reply.run_id != self.run_id:  # a new run, or the learner restarted: versions start over
                self.run_id, self.held, self.version = reply.run_id, None, -1
                store = self.peer.store
                for version, manifest in list(store.manifests.items()):  # the old run's v6 is not the new
                    if manifest.run_id != self.run_id:  # run's v6: never serve its chunks under that number
                        store.drop(version)
        self.newest = HeartbeatReply.from_wire(self._request(HEARTBEAT, self._heartbeat())).newest
        if self.newest != self.version:
            self._update()
        if self.version < 0:
            return
        reply = LeaseReply.from_wire(self._request(LEASE, LeaseRequest(self.version, self.cfg.max_groups).to_wire()))
        if reply.grant is None:
            self.newest = reply.newest
            if self.newest != self.version:
                self._update()
            elif reply.inactive:
                self.state = "inactive: the learner has cheaper workers enough; relaying chunks only"
                self.stop.wait(min(max(reply.wait, 0.05), 5.0))
            else:
                self.state = "idle: the learner needs no more rollouts now"
                self.stop.wait(min(max(reply.wait, 0.05), 5.0))
            return
        self._work(reply.grant)

    def _heartbeat(self) -> dict:
        return Heartbeat(self.version, self.tokens_per_s, self.cfg.price, self.hardware).to_wire()

    def _update(self) -> None:
        """Sync to the newest version through the swarm and swap it into the engine.

        A LoRA version carries only adapters for the full weights of an earlier version (its
        adapter_base): the worker syncs its weights to that base if it does not hold it, then fetches the
        adapters and hot-swaps them into the engine, which keeps its loaded base.
        """
        tick = time.perf_counter()
        self.state = f"fetching v{self.newest}"
        # LoRA: adapters on a base that stays; otherwise the newest weights, whichever version that is by
        # the time the learner answers (pinning a version a fast learner has dropped since would livelock)
        newest = self.peer.fetch_manifest() if self.spec.lora_rank else None
        base = None if newest is None else newest.version if newest.adapter_base is None else newest.adapter_base
        if base is None or self.held is None or self.held[0] != base:
            result = self.peer.sync(self.held, stop=self.stop, version=base)
            if result is not None:
                manifest, raw = result
                self.engine.load_policy(self.spec, self._floats(manifest, raw))
                self.held = (manifest.version, raw)
                self.version = manifest.version
        if newest is not None and newest.adapter_base is not None and newest.version != self.version:
            raw = self.peer.fetch_adapters(newest, stop=self.stop)
            self.engine.load_adapters(self.spec, self._floats(newest, raw))
            self.version = newest.version
        self._request(HEARTBEAT, self._heartbeat(), timeout=10)  # tell the learner at once
        log.info("now on v%d (%.1fs to fetch and load)", self.version, time.perf_counter() - tick)

    @staticmethod
    def _floats(manifest: Manifest, raw: bytes) -> dict[str, np.ndarray]:
        return {name: to_float32(array) for name, array in tensors_of(manifest, raw).items()}

    def _work(self, lease: LeaseGrant) -> None:
        version, requests = self.version, lease.requests
        log.debug("lease %d: %d groups on v%d", lease.id, len(requests), version)
        self.state = f"generating lease {lease.id} ({len(requests)} groups) on v{version}"
        tick = time.perf_counter()
        groups = self.engine.generate(requests, lease.params)
        elapsed = time.perf_counter() - tick
        tokens = sum(len(c.tokens) for g in groups for c in g)
        self.tokens_per_s = tokens / max(elapsed, 1e-9)
        payload = RolloutSubmission(
            lease.id, version, [GroupSubmission(r.group, cs) for r, cs in zip(requests, groups, strict=True)]
        ).to_wire()
        try:
            reply = RolloutReply.from_wire(self._request(ROLLOUT, payload, timeout=60))
            self.leases_done += 1
            log.debug("lease %d accepted: %d groups", lease.id, reply.accepted)
        except RemoteError as exc:  # e.g. the lease expired while we generated: the work is discarded
            log.warning("rollouts refused: %s", exc)
