"""A worker's rollouts per second while new policy versions keep arriving, against no new versions.

    .venv/bin/python scripts/bench_overlap.py [--period 15] [--seconds 90] [--rounds 2] [--learner-up MBIT]
        [--wire f16] [--topk 1] [--lora-rank 0] [--lr 2e-5] [--json]

First seconds / period + 1 real GRPO steps (SmolLM2-135M on arithmetic, sampled by llama.cpp) are
trained at `--lr` and encoded as the learner's Publisher does (`--wire` f16 or bf16, `--topk` share of
each matrix's changes; deltas, signed; or with `--lora-rank r`, rank-r adapters and versions that carry
only them after v0). Then the same worker pipeline runs in three modes, interleaved for `--rounds`
rounds of `--seconds` each, each round starting with another mode (side by side, so the machine's
noise hits all three alike):

    static      no new version: the worker generates leases back to back with v0
    overlap     a new version is announced every `--period` seconds; the worker's fetcher
                (worker/fetcher.py) syncs it over libp2p and stages it in the engine while the engine
                generates, and the worker installs it between leases (the daemon's default)
    sequential  the same stream; before each lease the worker waits until it holds the newest version
                (the daemon with --no-overlap; its fetcher still runs during a lease, so it waits for
                what is left of the fetch when the lease ends, where before #17 it waited for all of it)

`--learner-up` caps the learner host's upload (a token bucket, as `bench broadcast` does), so a
version takes the time a real link needs; without it the transfer is loopback, bound by CPU. Each
segment starts a fresh learner host and worker; the worker's chunk store already holds v0 (as a
worker that followed the run would), so only the versions under test cross the link.

A lease is 4 prompt groups x 8 completions of 48 tokens (the demo's shape), end-of-sequence ignored:
a lease is the same work whatever the policy answers, so a version that learned to answer shorter does
not pass for a faster worker (with EOS, rollouts/s rose with the trained versions and tokens/s fell).
The learner side is a real Seeder on another libp2p host of this process; versions are encoded before
the timed part, so encoding costs the worker's CPU nothing (on a real swarm the learner is another
machine; serving them here does cost this process some). Reported: rollouts/s per mode, overlap and
sequential as a share of static (the mean over rounds of each round's ratio, with its standard error),
versions installed, the seconds from seeing a version announced to having it staged (the worker's part
of B), and the worker's CPU seconds per version on its fetcher and libp2p threads (what a version takes
from generation on a machine whose cores all generate).
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
from learner.train.wire_weights import send_to_sampler
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
    send_to_sampler(engine, model_spec(policy), policy.model)
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
    # the worker had v0 (its fetcher finds every chunk already held): only the versions under test
    # cross the capped link, not the 227 MB base before the clock starts
    store = ChunkStore(memory_budget=2 << 30)
    store.add_version(versions[0])
    peer = BroadcastPeer(worker_host, store, learner_host.addrs[0])
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
            engine.eos_ids = set()  # every completion runs to the token limit: see the module docstring
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
    # the worker's CPU for versions, not generating: its fetcher's thread and its libp2p host's (by name)
    version_threads = [t for t in threading.enumerate() if t.name in ("fetcher", f"p2p-{worker_host.peer_id[-6:]}")]
    assert len(version_threads) == 2, [t.name for t in threading.enumerate()]
    cpu0 = [thread_cpu_s(t) for t in version_threads]
    rollouts, tokens, lease = 0, 0, 0
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
        tokens += sum(len(c.tokens) for g in groups for c in g)
    elapsed = time.monotonic() - t0
    version_cpu = sum(thread_cpu_s(t) - c for t, c in zip(version_threads, cpu0, strict=True))
    stop.set()
    fetcher.stop()
    worker_host.stop()
    learner_host.stop()
    return {
        "mode": mode,
        "rollouts_per_s": round(rollouts / elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
        "tokens_per_rollout": round(tokens / max(rollouts, 1), 1),
        "versions_announced": len(announced_at) - 1,
        "versions_installed": installs["count"],
        "fetch_and_stage_s_median": round(statistics.median(staged_after), 2) if staged_after else None,
        "worker_cpu_s_per_version": round(version_cpu / installs["count"], 2) if installs["count"] else None,
    }


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds a running thread has used (Linux: its own clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


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
    modes = ("static", "overlap", "sequential")
    segments = []
    for k in range(args.rounds):
        for mode in modes[k % 3 :] + modes[: k % 3]:  # each round starts with another mode: no order bias
            segments.append(
                run_mode(mode, versions, signer, engine, spec, prompts, args.seconds, args.period, args.learner_up)
            )
            segments[-1]["round"] = k
            if not args.json:
                print(json.dumps(segments[-1]), flush=True)

    def mean_of(mode: str, key: str) -> float:
        return statistics.mean(s[key] for s in segments if s["mode"] == mode)

    def of_static(mode: str, key: str) -> dict[str, float]:
        """The mode's rate as a share of the static rate of the same round: mean and standard error."""
        by_round = {(s["round"], s["mode"]): s[key] for s in segments}
        ratios = [by_round[k, mode] / by_round[k, "static"] for k in range(args.rounds)]
        sem = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
        return {"mean": round(statistics.mean(ratios), 3), "sem": round(sem, 3) if sem is not None else None}

    cpu = [s["worker_cpu_s_per_version"] for s in segments if s["worker_cpu_s_per_version"] is not None]
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
        "rollouts_per_s": {m: round(mean_of(m, "rollouts_per_s"), 3) for m in modes},
        "tokens_per_s": {m: round(mean_of(m, "tokens_per_s"), 1) for m in modes},
        "overlap_of_static": of_static("overlap", "rollouts_per_s"),
        "sequential_of_static": of_static("sequential", "rollouts_per_s"),
        "overlap_tokens_of_static": of_static("overlap", "tokens_per_s"),
        "sequential_tokens_of_static": of_static("sequential", "tokens_per_s"),
        "worker_cpu_s_per_version": round(statistics.mean(cpu), 2) if cpu else None,
        "segments": segments,
    }
    print(json.dumps(result, indent=None if args.json else 1))
    signer.stop()


if __name__ == "__main__":
    main()
