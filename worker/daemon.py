"""`echo-rl worker join`: fetch policy versions from the swarm, generate rollouts, push them back.

    join the learner (and its peers) -> get the model spec -> start the fetcher -> loop:
        a newer version staged by the fetcher? install it (between leases)
        lease prompt groups -> generate G completions each with the version installed -> push rollouts

The fetcher (worker/fetcher.py) heartbeats on its own thread, syncs each new version through the swarm
and stages it in the engine while the engine generates with the previous one, so versions cost no
generation time (with --no-overlap the loop waits for the newest version before each lease instead,
the sequential worker kept for comparison). The worker serves the chunks it holds to other workers the
whole time. It keeps going when the
learner disappears (it retries until the learner is back, e.g. after `learner start --resume`).
SIGINT/SIGTERM let the current lease finish and be pushed, then the worker leaves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Any

from envs import EnvError, EnvSpec
from envs.chat import ChatFormat
from envs.episode import EpisodeRules, generate_rollouts
from p2p.auth import authenticate, read_secret
from p2p.broadcast import BroadcastPeer, ChunkStore
from p2p.config import UPLINK_PACE, ConfigError
from p2p.host import Host, HostConfig, PeerUnavailable, RemoteError, RemoteFailure, Unauthorized
from p2p.identity import hold_identity, load_identity
from p2p.messages import (
    ENV_STEP,
    HEARTBEAT,
    LEASE,
    PROTOCOL,
    ROLLOUT,
    SPEC,
    UPGRADE,
    EnvStepReply,
    EnvStepRequest,
    EpisodeStep,
    EpisodeTurn,
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
    SpecRequest,
    describe_hardware,
    sampled_count,
)
from worker.config import WorkerConfig
from worker.engines import make_engine
from worker.fetcher import VersionFetcher
from worker.sampling import generate_alone

PUSH_TIMEOUT = 60.0  # seconds one send of a lease's rollouts may take (a slow uplink)
HOSTED_STEP_TIMEOUT = 120.0  # seconds the learner may take to step a hosted environment on a round of turns
PUSH_GRACE = 30.0  # seconds a send may run past its lease's end: the learner checks a submission that
# arrived in time before it answers (verification: a second or two a group), and its clock is not ours

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
        self.episodes: EpisodeRules | None = None  # a run on a multi-turn environment: its rules
        self.fetcher: VersionFetcher | None = None  # syncs and stages new versions in the background
        self.version = -1  # the policy version the engine runs (a LoRA version: adapters on their base)
        self.active: tuple[int, ...] = ()  # the versions the learner has requests waiting on (its heartbeat's)
        self.versions_installed = 0
        self.run_id: str | None = None
        self.tokens_per_s = 0.0
        self.leases_done = 0
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
        if cfg.gpu >= 0:  # before any engine starts CUDA: llama.cpp and torch read it when they do
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cfg.gpu)
            os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # N counts as nvidia-smi counts (not fastest first)

    def install_signal_handlers(self) -> None:
        def leave(signum: int, frame: object) -> None:
            log.info("signal %d: finishing the current lease, then leaving", signum)
            self.stop.set()

        signal.signal(signal.SIGINT, leave)
        signal.signal(signal.SIGTERM, leave)

    def run(self) -> None:
        cfg = self.cfg
        work_dir = Path(cfg.work_dir).expanduser()
        self._identity_lock = hold_identity(cfg.identity)  # one worker process per identity (and store)
        host_cfg = HostConfig(listen=[cfg.listen], upload_bps=cfg.upload_bps(), hole_punch=cfg.hole_punch)
        self.host = Host(load_identity(cfg.identity), host_cfg).start()
        paced = f", sending at most {cfg.uplink_mbit * UPLINK_PACE:g} Mbit/s" if cfg.uplink_mbit else ""
        log.info("worker %s listening on %s%s", self.host.peer_id, self.host.addrs[0], paced)
        store = ChunkStore(spill_dir=work_dir / "chunks", persist=True)
        found = store.recover(cfg.learner.rsplit("/p2p/", 1)[-1])  # what a previous run of this worker fetched
        if found["versions"]:
            log.info("store: %d versions, %d chunks kept, %d corrupt or truncated chunks deleted (fetched again)",
                     found["versions"], found["chunks"], found["corrupt"])  # fmt: skip
        self.peer = BroadcastPeer(self.host, store, cfg.learner, announce=[cfg.announce] if cfg.announce else None)
        quant = "f16" if cfg.quant == "auto" else cfg.quant  # auto: chosen at the first join (_check_weights)
        self.engine = make_engine(cfg.engine, work_dir / "engine", cfg.threads, cfg.max_batch, cfg.gpu_layers,
                                  cfg.device, quant)  # fmt: skip
        self.hardware |= self.engine.backend()  # cpu, or the GPU backend, GPU name and memory
        log.info("engine: %s", describe_hardware(self.hardware))
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
        finally:
            if self.fetcher is not None:
                self.fetcher.stop()
            self.host.stop()
            self.peer.close()  # after the host: the dials under way fail at once
            self._identity_lock.close()
            stats = self.peer.stats
            log.info(
                "worker left after %d leases; fetched %.1f MB from the learner and %.1f MB from peers, "
                "derived %d full snapshots", self.leases_done, stats.get("bytes_from_learner", 0) / 1e6,
                stats.get("bytes_from_peers", 0) / 1e6, stats.get("snapshots_derived", 0),
            )  # fmt: skip

    def _request(self, protocol: str, message: dict, timeout: float = 30.0) -> dict:
        return self.host.request(self.cfg.learner, protocol, message, timeout=timeout)

    def _step(self) -> None:
        if self.spec is None:
            self._join()
        self._install()
        several = self.fetcher.slots > 1  # several LoRA versions held, switched per lease (worker.fetcher)
        if self.version < 0 or (not self.cfg.overlap and not several and self.fetcher.announced != self.version):
            self.state = f"fetching v{max(self.fetcher.announced, 0)}"
            self.fetcher.ready.wait(0.5)
            return
        held = self.fetcher.held_adapters() if several else {}
        ask = LeaseRequest(self.version, self.cfg.max_groups, tuple(v for v in held if v != self.version))
        reply = LeaseReply.from_wire(self._request(LEASE, ask.to_wire()))
        if reply.grant is not None:
            self._work(reply.grant, held)
            return
        self.fetcher.announced = max(self.fetcher.announced, reply.newest)
        wait = min(max(reply.wait, 0.05), 5.0)
        if reply.inactive:
            self.state = "inactive: the learner has cheaper workers enough; relaying chunks only"
        elif reply.newest != self.version and reply.newest not in held:  # too stale: the newer one is on its way
            self.state = f"waiting for v{reply.newest}"
            self.fetcher.poke()
            self.fetcher.ready.wait(wait)
            return
        else:
            self.state = "idle: the learner needs no more rollouts now"
        self.stop.wait(wait)

    def _join(self) -> None:
        """Authenticate, read the model spec, join the swarm; a new run gets a new fetcher."""
        self.state = "joining"
        authenticate(self.host, self.cfg.learner, self.secret)
        reply = SpecReply.from_wire(self._request(SPEC, SpecRequest().to_wire()))
        if reply.protocol > PROTOCOL:  # a learner before versioning (1) sends a llama spec we still run
            raise ConfigError(
                f"the learner speaks protocol {reply.protocol} and this worker {PROTOCOL}: upgrade echo-rl on the "
                f"worker ({UPGRADE})"
            )
        if reason := self.engine.unsupported(reply.spec):
            raise ConfigError(reason)
        self._check_weights(reply)
        self._join_swarm()
        if reply.group_size > self.cfg.max_batch:
            raise ConfigError(
                f"worker.max_batch {self.cfg.max_batch} is below the learner's group size {reply.group_size}: "
                f"join with --max-batch {reply.group_size} or more"
            )
        if reply.run_id != self.run_id or self.fetcher is None:  # a new run, or the learner restarted:
            self.run_id, self.version = reply.run_id, -1  # versions start over
            store = self.peer.store
            for version, manifest in list(store.manifests.items()):  # the old run's v6 is not the new
                if manifest.run_id != self.run_id:  # run's v6: never serve its chunks under that number
                    store.drop(version)
            if self.fetcher is not None:
                self.fetcher.stop()
            self.fetcher = VersionFetcher(
                self.peer, self.engine, reply.spec, self._beat, lambda: self.version, self.cfg.poll_s,
                reply.adapter_slots, lambda: self.active,
            ).start()  # fmt: skip
        self.episodes = None if reply.env is None else episode_rules(reply.env, self.cfg.allow_env)
        self.spec = reply.spec

    def _check_weights(self, reply: SpecReply) -> None:
        """The weight format, checked against what the learner takes and can replay (quantized: its llama.cpp
        build is this worker's); --quant auto chooses it anew for each run (a restarted learner may differ)."""
        if self.cfg.quant == "auto" and reply.run_id != self.run_id:  # no version of the run is loaded yet
            from worker.quantize import auto_weights, memory_budget  # llama.cpp engines only (transformers: f16)

            budget, where = memory_budget(self.cfg.memory_gib, self.engine.backend())
            self.engine.quant = auto_weights(reply, self.engine.build, self.cfg.max_batch, budget, where)
            self.hardware = {k: v for k, v in self.hardware.items() if k != "build"} | self.engine.backend()
        quant, build = self.hardware.get("weights", "f16"), self.hardware.get("build")
        flag = f"--quant auto ({quant})" if self.cfg.quant == "auto" else f"--quant {quant}"
        if quant == "f16":
            return
        if reply.weights_bytes and quant not in reply.weights_bytes:  # not in the learner's swarm.quant_formats
            raise ConfigError(f"{flag}: this learner takes {', '.join(reply.weights_bytes)} workers only: "
                              "join with one of them, or with --quant auto")  # fmt: skip
        if reply.env is not None:
            raise ConfigError(f"{flag}: multi-turn episodes are verified on 16-bit weights only: join "
                              "with --quant f16")  # fmt: skip
        if reply.quant_build != build:
            theirs = f"on llama.cpp build {reply.quant_build}" if reply.quant_build else "on no llama.cpp build"
            fix = "--gpu-layers 0 (it replays on its CPU)" if "-gpu-" in str(build) else "its llama-cpp-python build"
            raise ConfigError(f"{flag}: the learner verifies quantized workers {theirs}, this worker "
                              f"runs {build}: join with --quant f16, or with {fix}")  # fmt: skip

    def _join_swarm(self) -> None:
        """Register with the learner's peer list. Peer discovery never holds up work: the listed peers are
        dialled in the background, and a join the learner refuses (its list is full) or that fails costs only
        peer-assisted fetching until the fetcher joins again (it does while it fetches)."""
        try:
            self.peer.join()
        except (PeerUnavailable, RemoteError) as exc:
            log.warning("not on the swarm's peer list for now (%s); fetching from the learner", exc)

    def _beat(self) -> int:
        """One heartbeat (the fetcher's thread sends them): the learner's newest version."""
        reply = HeartbeatReply.from_wire(self._request(HEARTBEAT, self._heartbeat(), timeout=10))
        self.active = reply.active
        return reply.newest

    def _heartbeat(self) -> dict:
        punched = len(self.peer.punched()) if self.peer is not None else 0  # hole-punched peers (status shows it)
        return Heartbeat(self.version, self.tokens_per_s, self.cfg.price, self.hardware, punched).to_wire()

    def _install(self) -> None:
        """Swap in the version the fetcher staged, if any (between leases: a lease is one version)."""
        staged = self.fetcher.take()
        if staged is None:
            return
        tick = time.perf_counter()
        self.engine.install(staged.engine_state)
        self.version = staged.version
        self.versions_installed += 1
        self._request(HEARTBEAT, self._heartbeat(), timeout=10)  # tell the learner at once
        log.info("now on v%d (%.1fs to fetch and load in the background, %.3fs to swap)",
                 self.version, staged.fetch_s, time.perf_counter() - tick)  # fmt: skip

    def _work(self, lease: LeaseGrant, held: dict[int, dict]) -> None:
        """Generate a lease's groups and push them; `held`: the adapters of the versions this worker said it holds
        (a lease on one of them switches to it first)."""
        if lease.min_version != self.version and self.fetcher.slots > 1:  # a lease on a version held: switch
            if lease.min_version not in held:  # (never granted so: the learner leases only versions named)
                log.warning("lease %d is for v%d, whose adapters this worker does not hold; dropped", lease.id,
                            lease.min_version)  # fmt: skip
                return
            tick = time.perf_counter()
            self.engine.load_adapters(self.spec, held[lease.min_version])
            self.version = lease.min_version
            log.debug("switched to v%d for lease %d (%.3fs)", self.version, lease.id, time.perf_counter() - tick)
        version, requests = self.version, lease.requests
        log.debug("lease %d: %d groups on v%d", lease.id, len(requests), version)
        self.state = f"generating lease {lease.id} ({len(requests)} groups) on v{version}"
        tick, leased_at = time.perf_counter(), time.monotonic()
        if any((r.episode is not None) != (self.episodes is not None) for r in requests):
            raise MessageError("a lease's groups must be episodes exactly when the run names an environment")
        hosted = self.episodes is not None and self.episodes.spec.hosted  # the learner steps the environment

        def remote(turns: list[EpisodeTurn]) -> list[EpisodeStep]:  # one round trip per round of turns
            message, wait = EnvStepRequest(lease.id, turns).to_wire(), 1.0
            while True:
                try:
                    reply = self._request(ENV_STEP, message, timeout=HOSTED_STEP_TIMEOUT)
                    return EnvStepReply.from_wire(reply, len(turns)).steps
                except PeerUnavailable:  # a cut link or a lost reply: the learner answers the same turns alike
                    if self.stop.is_set() or time.monotonic() + wait > leased_at + lease.deadline_s:
                        raise
                    self.stop.wait(wait)
                    wait = min(wait * 2, 10.0)

        try:  # an environment's groups are episodes, played turn by turn; greedy ones: held-out evaluation
            quantized = self.hardware.get("weights", "f16") != "f16"  # each group in its own wave, as replayed
            alone = lease.alone or quantized
            generate = functools.partial(generate_alone, self.engine.generate) if alone else self.engine.generate
            groups = generate_rollouts(generate, requests, lease.params, self.episodes, remote if hosted else None)
        except (EnvError, PeerUnavailable, RemoteError) as exc:  # its lease goes back to the learner when it expires
            log.warning("lease %d dropped: %s", lease.id, exc)
            return
        elapsed = time.perf_counter() - tick
        tokens = sum(sampled_count(len(c.tokens), c.spans) for g in groups for c in g)  # sampled ones
        self.tokens_per_s = tokens / max(elapsed, 1e-9)
        payload = RolloutSubmission(
            lease.id, version, [GroupSubmission(r.group, cs) for r, cs in zip(requests, groups, strict=True)]
        ).to_wire()
        self._push(lease.id, payload, leased_at + lease.deadline_s)

    def _push(self, lease_id: int, payload: dict, deadline: float) -> None:
        """Send a lease's rollouts until the learner answers or the lease ends (time.monotonic() > deadline):
        a cut link or a learner restarting is retried, authenticating again if it asks (a resend of rollouts
        it took gets the same reply: learner.orchestrate.intake); a refusal drops them."""
        wait = 1.0
        while True:
            # a send outlives the lease by PUSH_GRACE at most (one arriving later is refused): a stalled link does
            # not hold the worker a minute for rollouts nobody takes any more
            timeout = min(PUSH_TIMEOUT, max(deadline - time.monotonic() + PUSH_GRACE, PUSH_GRACE))
            try:
                reply = RolloutReply.from_wire(self._request(ROLLOUT, payload, timeout=timeout))
                self.leases_done += 1
                log.debug("lease %d accepted: %d groups", lease_id, reply.accepted)
                return
            except Unauthorized:  # the learner restarted and forgot us (its journal kept our lease)
                retry = "not authorized"
                with contextlib.suppress(PeerUnavailable, RemoteError):
                    authenticate(self.host, self.cfg.learner, self.secret)
            except PeerUnavailable as exc:
                retry = str(exc)
            except RemoteError as exc:  # e.g. the lease expired while we generated: the work is discarded
                log.warning("rollouts refused: %s", exc)
                return
            if self.stop.is_set() or time.monotonic() + wait > deadline:
                log.warning("lease %d: rollouts not delivered before the lease ended (%s); dropped", lease_id, retry)
                return
            log.info("lease %d: rollouts not delivered (%s); sending again in %.0fs", lease_id, retry, wait)
            self.stop.wait(wait)
            wait = min(wait * 2, 10.0)


def episode_rules(env: dict, allowed: str) -> EpisodeRules:
    """The rules of the learner's environment (p2p.messages.SpecReply.env). A plugin environment is code this
    worker would import by a name the learner sent, so only one the operator allowed (--allow-env) is."""
    spec = EnvSpec.from_wire(env["spec"])
    if ":" in spec.name and not spec.hosted and spec.name not in [a.strip() for a in allowed.split(",")]:
        raise ConfigError(
            f"the learner's run plays environment {spec.name!r}, which this worker would import: join with "
            f"--allow-env {spec.name} if you trust it (and have it installed)"
        )
    return EpisodeRules.of(spec, ChatFormat.from_wire(env["chat"]))
