"""The swarm side of a learner, started: its libp2p host, the seeder and publisher of policy versions, the
rollout journal, the verifier and the protocol handlers (learner/orchestrate). learner.swarm_loop drives
it step by step; so does the Python API's SwarmTrainingClient (echo_rl/client.py).

The learner keeps its identity (RUN_DIR/learner.key) and its port (RUN_DIR/learner.addr) across
restarts, so workers find it again after `--resume`. RUN_DIR/learner.addr is written last: once it
exists, every protocol has its handler.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import multiaddr
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig
from learner.orchestrate.handlers import LearnerService
from learner.orchestrate.hosting import STEP_CONCURRENCY, env_step_limits
from learner.orchestrate.journal import JournalState, RolloutJournal, read_journal
from learner.orchestrate.publisher import Publisher
from learner.orchestrate.verify import RolloutVerifier
from learner.orchestrate.verify_quantized import QuantEngines, QuantizedReplay
from learner.run import Run, sampler_departure
from learner.swarm_config import FOUR_BIT
from learner.train.data_parallel import full_state
from learner.train.models import model_spec
from learner.train.wire_weights import send_to_sampler
from p2p.auth import AUTH, SwarmAuth, read_allow_list, read_secret
from p2p.broadcast import ChunkStore, Seeder
from p2p.config import LEARNER_PACE, paced_bps
from p2p.host import Host, HostConfig
from p2p.identity import load_identity
from p2p.messages import ENV_STEP, Engine, ModelSpec

log = logging.getLogger(__name__)


def listen_addr(cfg: LearnerConfig, run_dir: Path) -> str:
    """The configured listen multiaddr; port 0 reuses the port of this run's previous start, if any."""
    addr = multiaddr.Multiaddr(cfg.swarm.listen)
    previous = run_dir / "learner.addr"
    if addr.value_for_protocol("tcp") == "0" and previous.exists():
        try:
            port = multiaddr.Multiaddr(previous.read_text().strip()).value_for_protocol("tcp")
            return cfg.swarm.listen.replace("/tcp/0", f"/tcp/{port}")
        except Exception:  # noqa: BLE001 - an unreadable old address just means a new port
            pass
    return cfg.swarm.listen


@dataclass
class SwarmSide:
    """What a learner serves its workers with, for one run (rank 0 only)."""

    run: Run
    host: Host
    publisher: Publisher
    journal: RolloutJournal
    verifier: RolloutVerifier
    service: LearnerService
    resumed: JournalState  # what the journal held at a --resume

    @property
    def seeder(self) -> Seeder:
        return self.service.seeder

    def snapshot(self) -> dict:
        """The policy's weights as a version carries them; with several ranks every rank takes part."""
        model = self.run.policy.model
        return self.publisher.snapshot(model, full_state(model, self.run.world))

    def publish(self, version: int, tensors: dict) -> None:
        """Sign and seed `tensors` as `version`; the verifier keeps them to replay workers' sampling."""
        tensors = self.publisher.carry(tensors)  # what workers will hold (the largest changes, with wire_topk < 1)
        manifest = self.publisher.publish(version, tensors)
        self.verifier.remember(version, tensors, manifest.adapter_base)
        self.service.mark_published(version, manifest.payload_size)

    def close(self) -> None:
        self.seeder.close()  # stops the host that dials announced addresses back
        self.host.stop()
        if self.verifier.quantized is not None:  # after the host: no handler replays on them any more
            self.verifier.close_quantized()
        self.journal.close()
        if self.service.intake.hosting is not None:  # a hosted environment's open episodes
            self.service.intake.hosting.close()


def refuse_departing_llamacpp(cfg: LearnerConfig, run: Run, probe: Callable[[ModelSpec], Engine | None] | None) -> None:
    """Sample with llama.cpp on this machine where it runs the model through its converter's recipe (`probe`
    builds the engine, or None where echo-rl's own llama layout writes the model: no family assumptions of
    llama.cpp's to check); if it departs from the learner (learner.run.sampler_departure), the recipe becomes
    the reason, so that llama.cpp workers refuse the model in one line at join and transformers workers run it."""
    policy = run.policy
    if probe is None or not cfg.swarm.check_llamacpp or run.world.size > 1:
        return  # (sharded weights: the check would need a gathered copy; not made)
    spec = model_spec(policy)
    if "arch" not in spec.recipe() or (engine := probe(spec)) is None:
        return
    try:
        send_to_sampler(engine, spec, policy.model)
        reason = sampler_departure(cfg, policy, engine)
    finally:
        engine.close()
    if reason:
        policy.gguf_recipe = json.dumps({"unsupported": reason})
        log.warning("%s: llama.cpp workers are refused, transformers workers run it", reason)


def warn_uncorrected_four_bit(cfg: LearnerConfig, quantized: bool) -> list[str]:
    """Warn once, at start, where swarm.quant_formats names 4-bit formats (an expert's choice: auto takes them only
    under a correcting objective) and the objective does not correct for their sampler; `quantized`: quantized
    workers are taken at all (llama.cpp replays them; single-turn). Returns the 4-bit formats warned about."""
    four_bit = sorted(set(FOUR_BIT) & set(cfg.swarm.weight_formats())) if quantized and not cfg.env.env else []
    if not four_bit or cfg.grpo.corrects_sampler():
        return []
    log.warning("swarm.quant_formats takes %s workers, and the objective does not correct for their sampler: "
                "4-bit workers learned little without it (docs/benchmarks.md); --objective decoupled "
                "--minibatches 2 (correction tis) does", " and ".join(four_bit))  # fmt: skip
    return four_bit


def start_swarm(
    cfg: LearnerConfig, run: Run, resume: bool, probe: Callable[[ModelSpec], Engine | None] | None = None,
    quant: QuantEngines | None = None,
) -> SwarmSide:
    """Start the host and every handler of `run`'s swarm side, then write RUN_DIR/learner.addr. `probe`: see
    refuse_departing_llamacpp; `quant`: llama.cpp engines to replay quantized workers with (None: refused)."""
    refuse_departing_llamacpp(cfg, run, probe)
    warn_uncorrected_four_bit(cfg, quant is not None)
    secret = read_secret(cfg.swarm.secret_file) if cfg.swarm.secret_file else None
    allow = read_allow_list(cfg.swarm.allow) if cfg.swarm.allow else None
    policy, swarm = run.policy, cfg.swarm
    # the hard cap (emulation), and the pacing at the declared uplink
    caps = [cap for cap in (swarm.upload_bps, paced_bps(swarm.uplink_mbit, LEARNER_PACE)) if cap]
    host_cfg = HostConfig(
        listen=[listen_addr(cfg, run.run_dir)],
        read_timeout=swarm.read_timeout,
        upload_bps=min(caps) if caps else None,
        relay=swarm.relay,
    )
    host = Host(load_identity(run.run_dir / "learner.key"), host_cfg)
    host.start()
    addr_file = run.run_dir / "learner.addr"
    addr_file.unlink(missing_ok=True)  # the previous start's address is no sign that this one is ready
    journal: RolloutJournal | None = None
    try:
        auth = SwarmAuth(host.peer_id, secret, allow)
        host.gate = auth.allows
        host.handle(AUTH, auth.on_auth, guarded=False)
        store = ChunkStore(spill_dir=run.run_dir / "chunks", memory_budget=swarm.chunk_memory_mb << 20)
        seeder = Seeder(host, store, silence=swarm.worker_silence)
        publisher = Publisher(
            seeder, run_id=secrets.token_hex(8), full_every=swarm.full_every, dtype=swarm.wire_dtype,
            lora=cfg.model.lora_rank > 0, topk=swarm.wire_topk, chunk_size=(swarm.chunk_kib << 10) or None,
        )  # fmt: skip
        # the journal: accepted groups and each step's batch, so that a killed learner loses none of them
        resumed = read_journal(run.run_dir, run.start_step) if resume else JournalState()
        journal = RolloutJournal(run.run_dir, staleness=0 if swarm.sync_mode == "pull" else swarm.staleness)
        journal.open(run.start_step, resumed)
        spec = model_spec(policy)  # (llama.cpp's quantized replay needs a family it runs)
        verifier = RolloutVerifier(
            lambda: AutoModelForCausalLM.from_config(copy.deepcopy(policy.model.config)),
            cfg.sampler.temperature, cfg.sampler.top_p, swarm.verify_first, swarm.verify_fraction,
            swarm.verify_tolerance, swarm.verify_draw_tolerance,
            lora_scale=cfg.model.lora_alpha / max(cfg.model.lora_rank, 1),
            keep=swarm.staleness + swarm.publish_every + 1, device=run.world.device,
            off_draw_tolerance=swarm.verify_off_draw,
            quantized=QuantizedReplay(quant, spec) if quant is not None and not quant.unsupported(spec) else None,
        )  # fmt: skip
        service = LearnerService(
            seeder, cfg, policy, run.task, spec, publisher.run_id, journal, verifier, resumed
        )
        if service.intake.hosting is not None:  # --env-host learner: workers ask it for every observation
            host.handle(ENV_STEP, service.intake.hosting.step, STEP_CONCURRENCY, limits=env_step_limits(cfg))
            if service.evals is not None:  # held-out episodes too
                service.evals.hosting = service.intake.hosting
        # the address file says "ready": written only once every protocol has its handler, so that a
        # worker or `status` dialing it at once is answered rather than told "protocol not supported"
        addr_file.with_suffix(".tmp").write_text(host.addrs[0] + "\n")
        os.replace(addr_file.with_suffix(".tmp"), addr_file)
        log.info("learner listening on %s", host.addrs[0])
        return SwarmSide(run, host, publisher, journal, verifier, service, resumed)
    except BaseException:
        host.stop()
        if journal is not None:
            journal.close()
        raise
