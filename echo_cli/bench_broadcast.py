"""`echo-rl bench broadcast`: a learner and N peers as separate processes on 127.0.0.1 with capped bandwidth.

The orchestrator (`run_broadcast_bench`) starts every node as `python -m echo_cli.bench_broadcast node ...`, waits
until all listen, has every peer connect to the others (as workers in a swarm are before a version is
published), then tells all peers to start at once, and reports the seconds until the last peer holds
the verified version (`seconds`, the orchestrator's clock), the slowest peer's own time from its
start to a verified version, split into fetch and verify (`slowest_peer_s`), next to the star time
N*M/u_s and the lower bound of docs/design.md §4:
    T_min = max(M / u_s, M / min_i d_i, N * M / (u_s + sum_i u_i)).
The gap between `seconds` and `slowest_peer_s` is the orchestrator's messages to 8 processes and
back; before #17 the peers also connected to each other after the start, which the clock counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from echo_cli.netlab import ROOT, Site, Wan
from p2p.broadcast import UPLOAD_SLOTS

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


def t_min(m: float, learner_up: float, peer_up: float, peer_down: float | None, n: int) -> float:
    return max(m / learner_up, m / peer_down if peer_down else 0.0, n * m / (learner_up + n * peer_up))


def node_main(argv: list[str]) -> None:
    """One node. Prints a JSON line when listening; peers fetch on `go`, print their result, exit on `stop`."""
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["seeder", "peer"])
    p.add_argument("--size-mb", type=float, default=64)
    p.add_argument("--up", type=float, default=None, help="upload cap, Mbit/s")
    p.add_argument("--down", type=float, default=None, help="download cap, Mbit/s")
    p.add_argument("--learner", default=None)
    p.add_argument("--mode", choices=["star", "swarm"], default="swarm")
    p.add_argument("--chunk-mib", type=float, default=0.0, help="chunk size (0: the learner's, codec.chunk_size_for)")
    p.add_argument("--upload-slots", type=int, default=UPLOAD_SLOTS, help="chunk replies sent at once (0: all)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="multiaddr to listen on")
    p.add_argument("--versions", type=int, default=0, help="then publish this many more versions, timed one by one")
    p.add_argument("--every", type=float, default=2.0, help="seconds between those versions")
    args = p.parse_args(argv)

    import logging

    import numpy as np

    from p2p.broadcast import BroadcastPeer, ChunkStore, Seeder
    from p2p.host import Host, HostConfig
    from p2p.identity import new_identity
    from p2p.versions import build_version, rebuild_raw

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = HostConfig(
        listen=[args.listen], upload_bps=args.up * MBIT if args.up else None,
        download_bps=args.down * MBIT if args.down else None,
        relay=args.role == "seeder", hole_punch=args.role == "peer",  # as the learner and worker join do
    )  # fmt: skip
    key = new_identity()
    host = Host(key, config).start()
    say = lambda **kw: print(json.dumps(kw), flush=True)  # noqa: E731
    if args.role == "seeder":
        rng = np.random.default_rng(0)  # random bits: the codec cannot shrink them, so M is the size asked for
        n_words = int(args.size_mb * 1024 * 1024) // 2
        tensors = {"weights": rng.integers(0, 2**16, n_words, dtype=np.uint16)}
        pv, _ = build_version("bench", 1, tensors, {"weights": "bf16"}, chunk_size=int(args.chunk_mib * 2**20) or None)
        pv.manifest = pv.manifest.signed(key, host.peer_id)
        seeder = Seeder(host, ChunkStore(), args.upload_slots or None)
        seeder.publish(pv)
        say(ready=True, addr=host.addrs[0], payload_bytes=pv.manifest.payload_size, chunks=len(pv.chunks),
            chunk_bytes=pv.manifest.chunks[0][1])  # fmt: skip
        if args.versions:  # "go": publish the timed versions, each announced to the peers as the learner does
            sys.stdin.readline()
            published = {}
            for version in range(2, args.versions + 2):
                tensors = {"weights": rng.integers(0, 2**16, n_words, dtype=np.uint16)}
                pv, _ = build_version("bench", version, tensors, {"weights": "bf16"})
                pv.manifest = pv.manifest.signed(key, host.peer_id)
                published[version] = time.time()  # (the peers run on this machine: one wall clock)
                seeder.publish(pv)
                time.sleep(args.every)
            say(published=published)
        sys.stdin.readline()  # until stop
        return
    star = args.mode == "star"
    peer = BroadcastPeer(
        host, ChunkStore(), args.learner, max_inflight=1 if star else 6, use_peers=not star,
        upload_slots=args.upload_slots or None,
    )  # fmt: skip
    peer.join()
    say(ready=True, addr=host.addrs[0])
    # "connect N P": every peer has joined; connect to the N others that can be dialled, and to P behind NATs
    line = sys.stdin.readline().split()
    others, behind = (int(line[1]) if len(line) > 1 else 0), (int(line[2]) if len(line) > 2 else 0)
    tick = time.perf_counter()
    for _ in range(120):  # learn the full peer list and connect to every peer (swarm mode), as workers that were
        peer.join()  # in the swarm before a version are (the learner lists a peer once it dialled it back, and
        # tells a peer behind NAT so once the dial-back failed: then it punches holes to the others behind NATs)
        if star or (peer.wait_for_peers(others, 1.0) and len(peer.punched()) >= behind):
            break
    say(
        connected=len(peer.peers) >= others or star,
        peers=len(peer.peers),
        punched=len(peer.punched()),
        connect_s=round(time.perf_counter() - tick, 2),
    )
    sys.stdin.readline()  # go
    if args.versions:
        say(**timed_versions(peer, args.versions))
        sys.stdin.readline()  # stop
        host.stop()
        return
    start, mono = time.perf_counter(), time.monotonic()
    manifest = peer.fetch_manifest()
    chunks = peer.fetch(manifest, timeout=3600)
    fetched = time.perf_counter() - start
    rebuild_raw(manifest, chunks)  # raises unless every chunk and the whole are exact
    seconds = time.perf_counter() - start
    learner_done = max(peer.learner_chunk_at.values(), default=mono) - mono
    from_learner = {i: round(t - mono, 3) for i, t in peer.learner_chunk_at.items()}
    arrivals = sorted(t - mono for t in peer.chunk_at.values())
    held_at = {f"{q:.0%}": round(arrivals[max(int(q * len(arrivals)) - 1, 0)], 1) for q in (0.25, 0.5, 0.75, 0.9, 1.0)}
    say(done=True, seconds=seconds, fetch_s=round(fetched, 2), verify_s=round(seconds - fetched, 2),
        learner_done_s=round(learner_done, 2), from_learner=from_learner, held_at=held_at, verified=True,
        stats=peer.stats_dict())  # fmt: skip
    sys.stdin.readline()  # stop: keep serving until every peer is done
    host.stop()


def first_from_learner(results: list[dict], chunks: int) -> dict[str, float]:
    """Seconds until the first 25%, 50%, ... of the chunks had each come from the learner to some peer (the
    learner's uplink sends every chunk once; after "100%", peers relay and the learner sends copies)."""
    first: dict[str, float] = {}
    for r in results:
        for index, t in r.get("from_learner", {}).items():  # (JSON keys are strings)
            first[index] = min(first.get(index, t), t)
    times = sorted(first.values())
    if len(times) < chunks:
        return {}
    return {f"{q:.0%}": round(times[max(int(q * chunks) - 1, 0)], 2) for q in (0.25, 0.5, 0.75, 1.0)}


def timed_versions(peer: Any, count: int, timeout: float = 300.0) -> dict[str, Any]:
    """Fetch each version the learner announces, as a worker's fetcher does: {version: wall time held}."""
    import queue

    from p2p.versions import rebuild_raw

    announced: queue.Queue[int] = queue.Queue()
    peer.on_announce = announced.put
    held: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(held) < count and time.monotonic() < deadline:
        try:
            version = announced.get(timeout=1.0)
        except queue.Empty:
            continue
        if version in held or version < 2:
            continue
        manifest = peer.fetch_manifest(version)
        rebuild_raw(manifest, peer.fetch(manifest, timeout=60))
        held[version] = time.time()
    return {"done": True, "verified": len(held) == count, "held": held, "stats": peer.stats_dict()}


def version_latency(published: dict[int, float], results: list[dict], wan: Wan | None, info: dict) -> dict[str, Any]:
    """Per peer: the median seconds from a version's publication to holding it, and in round trips to the
    learner; how many of the versions it held."""
    out = []
    for k, r in enumerate(results):
        lags = sorted(t - published[int(v)] for v, t in r.get("held", {}).items())
        rtt = wan.rtt_ms(0, k + 1) / 1000 if wan is not None else None
        median = lags[len(lags) // 2] if lags else None
        out.append({
            "rtt_ms": round(rtt * 1000) if rtt else None, "held": f"{len(lags)}/{len(published)}",
            "median_s": round(median, 3) if median is not None else None,
            "median_rtts": round(median / rtt, 1) if median is not None and rtt else None,
            "behind_nat": bool(wan is not None and wan.sites[k + 1].nat),
            "from_learner": r.get("stats", {}).get("from_learner", 0),
            "from_peers": r.get("stats", {}).get("from_peers", 0),
        })  # fmt: skip
    return {"versions": len(published), "chunks": info["chunks"], "payload_bytes": info["payload_bytes"], "peers": out}


def wan_sites(peers: int, rtt: tuple[float, float], nat: int, learner_up: float, peer_up: float,
              peer_down: float | None, loss: float) -> list[Site]:  # fmt: skip
    """The learner (site 0, 1 ms from the core) and `peers` sites whose round trips to it spread evenly over
    `rtt` (ms); the last `nat` of them behind NAT routers. Rates in Mbit/s, as the benchmark's flags."""
    sites = [Site(delay_ms=1.0, up=learner_up * MBIT)]
    for k in range(peers):
        ms = rtt[0] + (rtt[1] - rtt[0]) * k / max(peers - 1, 1)
        down = peer_down * MBIT if peer_down else None
        delay = max(ms / 2 - 1.0, 0.0)
        sites.append(Site(delay_ms=delay, up=peer_up * MBIT, down=down, loss=loss, nat=k >= peers - nat))
    return sites


class BedError(Exception):
    """The test bed could not be built as asked (a setting its kernel refuses): a one-line user error."""


def congestion_control(wan: Wan | None) -> str:
    """The TCP congestion control the nodes run under: the learner's site's (else this machine's)."""
    if wan is None:
        path = "/proc/sys/net/ipv4/tcp_congestion_control"
        return open(path).read().strip() if os.path.exists(path) else "unknown"
    ran = subprocess.run([*wan.exec_prefix(wan.ns[0]), "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return ran.stdout.strip() or "unknown"


def run_broadcast_bench(
    peers: int, size_mb: float, learner_up: float, peer_up: float, peer_down: float | None, mode: str, chunk_mib: float,
    upload_slots: int | None = None, rtt: tuple[float, float] | None = None, nat: int = 0, loss: float = 0.0,
    versions: int = 0, every: float = 2.0, idle_restart: bool = True, tcp: str = "", peer_pace: float = 0.0,
    learner_pace: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """`chunk_mib` 0: the learner's own chunk size; `upload_slots` None: the nodes' own (0: all at once).
    With `rtt` (ms, lo and hi) every node runs on a site of an echo_cli.netlab.Wan whose links do the
    rate caps, delays and `loss`, the last `nat` peers behind NAT routers; else on 127.0.0.1, capped by the
    hosts' own token buckets; `idle_restart` False turns Linux's slow start after idle off on every site,
    `tcp` sets every site's TCP congestion control (the result says which ran: it changes the figures),
    `peer_pace` > 0 has each peer's own host pace its uploads at that share of `peer_up` (with `rtt`), and
    `learner_pace` the learner's at that share of `learner_up` (`uplink_mbit` in a learner's or worker's
    config paces at 0.9).
    With `versions`, the learner then publishes that many more versions of `size_mb`, `every` seconds
    apart, and the result is each peer's time from publication to holding one."""
    node = [sys.executable, "-m", "echo_cli.bench_broadcast", "node"]
    timed = ["--versions", str(versions), "--every", str(every)] if versions else []
    procs: list[subprocess.Popen] = []
    tuning = () if idle_restart else ("net.ipv4.tcp_slow_start_after_idle=0",)
    tuning += (f"net.ipv4.tcp_congestion_control={tcp}",) if tcp else ()
    try:
        wan = Wan(wan_sites(peers, rtt, nat, learner_up, peer_up, peer_down, loss), sysctls=tuning) if rtt else None
    except subprocess.CalledProcessError as exc:  # (Wan tears down what it built)
        raise BedError(f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or b'').decode().strip()}") from None
    tcp = congestion_control(wan)

    def spawn(args: list[str], site: int) -> tuple[subprocess.Popen, dict]:
        where = [*wan.exec_prefix(wan.ns[site])] if wan is not None else []
        listen = ["--listen", f"/ip4/{wan.ip[site]}/tcp/0"] if wan is not None else []
        proc = subprocess.Popen(where + node + args + listen, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)  # fmt: skip
        procs.append(proc)
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench node {args[0]} exited before it was ready (code {proc.wait()})")
        return proc, json.loads(line)

    try:
        caps = ["--down", str(peer_down)] if peer_down and wan is None else []
        upload_slots = UPLOAD_SLOTS if upload_slots is None else upload_slots
        slots = ["--upload-slots", str(upload_slots)]
        learner_cap = ["--up", str(learner_up * (learner_pace or 1.0))] if wan is None or learner_pace else []
        seeder, info = spawn(["seeder", "--size-mb", str(size_mb), *learner_cap, "--chunk-mib", str(chunk_mib), *slots,
                              *timed], 0)  # fmt: skip
        if wan is None:  # the hosts' own token buckets are the links
            peer_cap = ["--up", str(peer_up)]
        else:  # the links cap; a peer may also pace itself (its host's token bucket) under its link's rate
            peer_cap = ["--up", str(peer_up * peer_pace)] if peer_pace else []
        workers = [
            spawn(["peer", "--learner", info["addr"], *peer_cap, "--mode", mode, *caps, *slots, *timed], k + 1)[0]
            for k in range(peers)
        ]
        behind_nat = [wan is not None and wan.sites[k + 1].nat for k in range(peers)]
        public = behind_nat.count(False)
        for w, hidden in zip(workers, behind_nat, strict=True):  # peers connect to the others they can reach
            w.stdin.write(f"connect {public - (0 if hidden else 1)} {nat - 1 if hidden else 0}\n")  # as joined
            w.stdin.flush()  # swarm workers are (nobody can dial a peer behind NAT)
        connected = [json.loads(w.stdout.readline() or "{}") for w in workers]
        if versions:
            for proc in [*workers, seeder]:  # the peers wait for announcements before the learner publishes
                proc.stdin.write("go\n")
                proc.stdin.flush()
            published = {int(v): t for v, t in json.loads(seeder.stdout.readline())["published"].items()}
            results = [json.loads(w.stdout.readline() or "{}") for w in workers]
            return version_latency(published, results, wan, info) | {"tcp": tcp}
        start = time.perf_counter()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        results = [json.loads(w.stdout.readline() or "{}") for w in workers]
        wall = time.perf_counter() - start
        if not all(r.get("verified") for r in results):
            raise RuntimeError("a peer did not finish with a verified version")
    finally:
        for proc in procs:
            try:
                proc.stdin.write("stop\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if wan is not None:
            wan.close()

    m = info["payload_bytes"]
    bound = t_min(m, learner_up * MBIT, peer_up * MBIT, peer_down * MBIT if peer_down else None, peers)
    star = peers * m / (learner_up * MBIT)
    learner_chunks = sum(r["stats"].get("from_learner", 0) for r in results)
    return {
        "mode": mode,
        "peers": peers,
        "payload_mb": round(m / 2**20, 2),
        "chunks": info["chunks"],
        "learner_up_mbit": learner_up,
        "peer_up_mbit": peer_up,
        "peer_down_mbit": peer_down,
        "chunk_kib": info["chunk_bytes"] // 1024,
        "upload_slots": upload_slots or None,
        "seconds": round(wall, 2),
        "slowest_peer_s": round(max(r["seconds"] for r in results), 2),  # its own clock: fetch + verify
        "slowest_fetch_s": round(max(r["fetch_s"] for r in results), 2),
        "slowest_verify_s": round(max(r["verify_s"] for r in results), 2),
        "connect_s_max": max(c.get("connect_s", 0.0) for c in connected),
        "punched": [c.get("punched", 0) for c in connected],  # per peer: direct connections hole punched
        "t_min_s": round(bound, 2),
        "star_s": round(star, 2),
        "vs_t_min": round(wall / bound, 3),
        "speedup_vs_star": round(star / wall, 2),
        "learner_uploads_per_chunk": round(learner_chunks / info["chunks"], 2),
        "last_learner_chunk_s": round(max(r["learner_done_s"] for r in results), 2),
        "first_from_learner_s": first_from_learner(results, info["chunks"]),
        "per_peer_s": sorted(round(r["seconds"], 1) for r in results),
        "held_at_s": [r["held_at"] for r in results],  # per peer: seconds until it held 25%, 50%, ... of the chunks
        "rtt_to_learner_ms": [round(wan.rtt_ms(0, k + 1)) for k in range(peers)] if wan is not None else None,
        "behind_nat": sum(behind_nat),
        "loss": loss,
        "idle_restart": idle_restart,
        "tcp": tcp,
        "peer_pace": peer_pace,
        "learner_pace": learner_pace,
        "cpu_count": os.cpu_count(),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_main(sys.argv[2:])
    else:
        sys.exit(
            "usage: python -m echo_cli.bench_broadcast node seeder|peer ... (started by `echo-rl bench broadcast`)"
        )
