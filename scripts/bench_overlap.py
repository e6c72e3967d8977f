"""A worker's rollouts per second while new policy versions keep arriving, against no new versions.

    .venv/bin/python scripts/bench_overlap.py [--period 15] [--seconds 90] [--rounds 2] [--wire f16] [--topk 1]
        [--lora-rank 0] [--json]

First `--versions` real GRPO steps (SmolLM2-135M on arithmetic, sampled by llama.cpp, the demo's
learning rate) are trained and encoded as the learner's Publisher does (`--wire` f16 or bf16, `--topk`
share of each matrix's changes; deltas, signed; or with `--lora-rank r`, rank-r adapters trained at
`--lr` and versions that carry only them after v0). Then
the same worker pipeline runs in three modes, interleaved for `--rounds` rounds of `--seconds` each
(side by side, so the machine's noise hits all three alike):

    static      no new version: the worker generates leases back to back with v0
    overlap     a new version is announced every `--period` seconds; the worker's fetcher
                (worker/fetcher.py) syncs it over libp2p and stages it in the engine while the engine
                generates, and the worker installs it between leases (the daemon's default)
    sequential  the same stream; before each lease the worker waits until it holds the newest
                version (the daemon with --no-overlap, and every worker before #17)

`--learner-up` caps the learner host's upload (a token bucket, as `bench broadcast` does), so a
version takes the time a real link needs; without it the transfer is loopback, bound by CPU.

A lease is 4 prompt groups x 8 completions of up to 48 tokens (the demo's shape). The learner side is
a real Seeder on another libp2p host of this process; versions are encoded before the timed part, so
encoding costs the worker's CPU nothing (on a real swarm the learner is another machine). Reported:
rollouts/s per mode, overlap and sequential as a share of static, versions installed, and the seconds
from seeing a version announced to having it staged (the worker's part of B).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from grpo_steps import train  # scripts/grpo_steps.py

from learner.orchestrate.publisher import Publisher
from learner.tasks import make_task
from learner.train.lora import add_lora
from learner.train.models import Policy, load_policy, model_spec
from learner.train.wire_weights import wire_tensors
from p2p.broadcast import BroadcastPeer, Seeder
from p2p.chunk_store import ChunkStore
from p2p.host import Host, HostConfig
from p2p.messages import GenerationRequest, SamplingParams
from p2p.versions import PolicyVersion
from worker.engines.llamacpp import LlamaCppEngine
from worker.fetcher import VersionFetcher


def policy_with(model: str, lora_rank: int) -> Policy:
    """The model, with rank-`lora_rank` adapters (alpha 16, the learner's default) when > 0."""
    policy = load_policy(model, "~/.cache/echo-rl")
    if lora_rank:
        add_lora(policy.model, lora_rank, 16.0)
        policy.lora_rank, policy.lora_alpha = lora_rank, 16.0
    return policy


def encode_versions(
    model: str, n: int, lr: float, wire: str, topk: float, lora_rank: int
) -> tuple[list[PolicyVersion], dict]:
    """v0 (a full snapshot) and n deltas (or adapter versions), each after one real GRPO step, encoded
    and signed as the learner's Publisher does (`wire` 16-bit format, `topk` share of each matrix's changes)."""
    policy = policy_with(model, lora_rank)
    engine = LlamaCppEngine(tempfile.mkdtemp(prefix="echo-overlap-"), threads=2, max_batch=32)
    engine.load_policy(model_spec(policy), wire_tensors(policy.model))
    signer = Host().start()
    publisher = Publisher(seeder=None, run_id="bench", full_every=10**6, dtype=wire, topk=topk, lora=lora_rank > 0)
    versions = []

    def publish(step: int) -> None:
        versions.append(publisher.encode(step, publisher.carry(publisher.snapshot(policy.model)), signer))

    publish(0)
    train(policy, engine, n, lr, lora=lora_rank > 0, on_step=publish)
    engine.close()
    info = {
        "bf16_checkpoint_bytes": versions[0].manifest.raw_size,
        "delta_bytes_mean": round(statistics.mean(v.manifest.payload_size for v in versions[1:])),
        "signer": signer,
    }
    return versions, info


def run_mode(mode: str, versions: list[PolicyVersion], signer: Host, engine: LlamaCppEngine, spec, prompts,
             seconds: float, period: float, learner_up: float | None) -> dict:  # fmt: skip
    """One timed segment: a fresh seeder (the signer's identity) and a fresh worker peer."""
    cap = HostConfig(upload_bps=learner_up * 1e6 / 8 if learner_up else None)
    learner_host = Host(signer.key, cap).start()  # the learner's identity: the manifests are signed with it
    seeder = Seeder(learner_host, ChunkStore(memory_budget=2 << 30))
    seeder.publish(versions[0])
    worker_host = Host().start()
    peer = BroadcastPeer(worker_host, ChunkStore(memory_budget=2 << 30), learner_host.addrs[0])
    peer.join()
    running = {"version": -1}
    announced_at: dict[int, float] = {0: time.monotonic()}

    def newest() -> int:
        return max(seeder.store.manifests)

    fetcher = VersionFetcher(peer, engine, spec, newest, lambda: running["version"], poll_s=1.0).start()
    staged_after: list[float] = []
    installs = {"count": 0}

    def install() -> None:
        staged = fetcher.take()
        if staged is not None:
            engine.install(staged.engine_state)
            running["version"] = staged.version
            if staged.version > 0:
                installs["count"] += 1
                staged_after.append(staged.fetch_s)

    while running["version"] < 0:  # v0 before the clock starts
        fetcher.ready.wait(1.0)
        install()

    stop = threading.Event()

    def announce() -> None:
        for k, pv in enumerate(versions[1:], 1):
            if stop.wait(period):
                return
            announced_at[k] = time.monotonic()
            seeder.publish(pv)

    announcer = threading.Thread(target=announce, daemon=True)
    if mode != "static":
        announcer.start()
    params = SamplingParams(1.0, 1.0, 48, 0)
    rollouts, lease = 0, 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if mode == "sequential":
            while newest() != running["version"]:  # stop generating until the newest version is loaded
                fetcher.poke()
                fetcher.ready.wait(0.05)
                install()
        install()  # between leases: a lease is one version
        lease += 1
        requests = [GenerationRequest(p, 8, lease * 4 + k) for k, p in enumerate(prompts)]
        groups = engine.generate(requests, SamplingParams(params.temperature, params.top_p, 48, lease))
        rollouts += sum(len(g) for g in groups)
    elapsed = time.monotonic() - t0
    stop.set()
    fetcher.stop()
    worker_host.stop()
    learner_host.stop()
    return {
        "mode": mode,
        "rollouts_per_s": round(rollouts / elapsed, 3),
        "versions_announced": len(announced_at) - 1,
        "versions_installed": installs["count"],
        "fetch_and_stage_s_median": round(statistics.median(staged_after), 2) if staged_after else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--period", type=float, default=15.0, help="seconds between versions (a learner step)")
    parser.add_argument("--seconds", type=float, default=90.0, help="length of one timed segment")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads of the worker")
    parser.add_argument("--learner-up", type=float, default=None, help="learner upload cap, Mbit/s (none: loopback)")
    parser.add_argument("--lr", type=float, default=2e-5, help="lr of the steps (the demo's, full weights)")
    parser.add_argument("--wire", choices=("f16", "bf16"), default="f16", help="16-bit format of the versions")
    parser.add_argument("--topk", type=float, default=1.0, help="share of each matrix's changes a delta sends")
    parser.add_argument("--lora-rank", type=int, default=0, help="train rank-r LoRA adapters, ship only them")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    n = int(args.seconds / args.period) + 1
    versions, info = encode_versions(args.model, n, args.lr, args.wire, args.topk, args.lora_rank)
    signer = info.pop("signer")
    policy = policy_with(args.model, args.lora_rank)
    spec = model_spec(policy)
    task = make_task("arithmetic", {"ops": "+", "max_value": 20})
    rng = random.Random(0)
    prompts = [policy.render_prompt(task.sample(rng).prompt) for _ in range(4)]
    del policy
    engine = LlamaCppEngine(Path(tempfile.mkdtemp(prefix="echo-overlap-")), threads=args.threads, max_batch=32)
    segments = []
    for _ in range(args.rounds):
        for mode in ("static", "overlap", "sequential"):
            segments.append(
                run_mode(mode, versions, signer, engine, spec, prompts, args.seconds, args.period, args.learner_up)
            )
            if not args.json:
                print(json.dumps(segments[-1]), flush=True)
    rate = {
        m: statistics.mean(s["rollouts_per_s"] for s in segments if s["mode"] == m)
        for m in ("static", "overlap", "sequential")
    }
    result = {
        **info,
        "delta_of_bf16_checkpoint": round(info["delta_bytes_mean"] / info["bf16_checkpoint_bytes"], 4),
        "period_s": args.period,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "threads": args.threads,
        "learner_up_mbit": args.learner_up,
        "wire": args.wire,
        "topk": args.topk,
        "lora_rank": args.lora_rank,
        "lr": args.lr,
        "rollouts_per_s": {m: round(r, 3) for m, r in rate.items()},
        "overlap_of_static": round(rate["overlap"] / rate["static"], 3),
        "sequential_of_static": round(rate["sequential"] / rate["static"], 3),
        "segments": segments,
    }
    print(json.dumps(result, indent=None if args.json else 1))
    signer.stop()


if __name__ == "__main__":
    main()
