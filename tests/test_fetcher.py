"""The worker's fetcher (worker/fetcher.py): versions synced and staged beside the live engine, over real
libp2p hosts on 127.0.0.1, installed only when the daemon says so."""

import threading

import numpy as np
import torch

from learner.orchestrate.publisher import Publisher
from learner.train.models import model_spec
from learner.train.wire_weights import wire_dtypes
from p2p.broadcast import BroadcastPeer, Seeder
from p2p.chunk_store import ChunkStore
from p2p.host import Host
from p2p.versions import build_version, tensors_of
from worker.engines.llamacpp import LlamaCppEngine
from worker.fetcher import VersionFetcher


def start_fetcher(worker: Host, learner: Host, engine, spec, publisher: Publisher, running: dict) -> VersionFetcher:
    """A worker's fetcher following `publisher`'s versions, the engine running running["version"]."""
    peer = BroadcastPeer(worker, ChunkStore(), learner.addrs[0])
    peer.join()
    return VersionFetcher(
        peer, engine, spec, lambda: publisher.published - 1, lambda: running["version"], poll_s=0.1
    ).start()


def test_the_next_version_is_staged_while_the_engine_runs_the_previous(tiny, tmp_path):
    learner, worker = Host().start(), Host().start()
    try:
        seeder = Seeder(learner, ChunkStore())
        publisher = Publisher(seeder, run_id="run", full_every=10, dtype="f16")
        publisher.publish(0, publisher.snapshot(tiny.model))
        spec = model_spec(tiny)
        engine = LlamaCppEngine(tmp_path / "engine", threads=2, max_batch=8)
        running = {"version": -1}
        fetcher = start_fetcher(worker, learner, engine, spec, publisher, running)
        assert fetcher.ready.wait(60)
        staged = fetcher.take()
        assert staged.version == 0 and fetcher.take() is None  # taken once
        assert not fetcher.ready.wait(2.0)  # taken, not installed yet: not fetched and staged again meanwhile
        engine.install(staged.engine_state)
        running["version"] = 0
        tokens = [1, 5, 9, 3]
        v0_logits = engine.logits(tokens)

        with torch.no_grad():  # the learner trains a step and publishes v1 as a delta
            for p in tiny.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        publisher.publish(1, publisher.snapshot(tiny.model))
        assert fetcher.ready.wait(60)
        assert np.array_equal(engine.logits(tokens), v0_logits)  # staged, not installed: still v0
        staged = fetcher.take()
        assert staged.version == 1 and fetcher.held[0] == 1
        engine.install(staged.engine_state)
        running["version"] = 1

        # what a worker that loads v1 from scratch computes
        tensors = publisher.snapshot(tiny.model)
        pv, raw = build_version("run", 1, tensors, wire_dtypes(tensors))
        reference = LlamaCppEngine(tmp_path / "reference", threads=2, max_batch=8)
        reference.load_policy(spec, tensors_of(pv.manifest, raw))
        assert np.array_equal(engine.logits(tokens), reference.logits(tokens))
        assert not np.array_equal(v0_logits, reference.logits(tokens))
        assert not fetcher.ready.wait(0.5)  # nothing newer: nothing staged
        stopped = threading.Thread(target=fetcher.stop)
        stopped.start()
        stopped.join(30)
        assert not stopped.is_alive()
        engine.close()
        reference.close()
    finally:
        learner.stop()
        worker.stop()


def test_a_lora_version_taken_is_not_staged_again_before_it_is_installed(caplog):
    """A LoRA run: the daemon took the staged version and installs it between leases; until it runs it, the
    fetcher does not fetch and stage the same adapters a second time (its wake-up at take() once did)."""
    from dataclasses import replace

    from learner.train.lora import add_lora
    from learner.train.models import tiny_policy
    from worker.engines import make_engine

    policy = tiny_policy(seed=0)
    add_lora(policy.model, rank=2, alpha=2.0)
    learner, worker = Host().start(), Host().start()
    try:
        publisher = Publisher(Seeder(learner, ChunkStore()), run_id="run", full_every=10, dtype="f16", lora=True)
        publisher.publish(0, publisher.snapshot(policy.model))
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01 * torch.randn_like(p))
        publisher.publish(1, publisher.snapshot(policy.model))  # the adapters alone, on v0
        spec = replace(model_spec(policy), lora_rank=2, lora_alpha=2.0)
        engine = make_engine("transformers", "", threads=1, max_batch=4, device="cpu")
        running = {"version": -1}
        fetcher = start_fetcher(worker, learner, engine, spec, publisher, running)
        assert fetcher.ready.wait(60)
        staged = fetcher.take()
        assert staged.version == 1
        assert not fetcher.ready.wait(2.0)  # the daemon has not installed it yet: nothing staged again
        assert not [r.message for r in caplog.records if r.name == "worker.fetcher" and r.levelname == "ERROR"]
        engine.install(staged.engine_state)
        running["version"] = 1
        assert not fetcher.ready.wait(0.5)
        fetcher.stop()
    finally:
        worker.stop()
        learner.stop()
