"""A real swarm on the WAN test bed: a learner and N llama.cpp workers, each in a network namespace of its own
on an emulated last mile (echo_cli/netlab.py Wan), the last K workers behind NAT routers of their own. The
workers run `worker join` with its defaults (it listens on every interface: the site's own address), so this
is the README's worker line on a network that is not loopback. Reports, per worker, its round trip to the
learner, whether it is behind NAT, the versions it installed of those published, and its accepted groups
per second (and an environment's turns per episode). Root only.

    .venv/bin/python scripts/bench_wan_swarm.py --workers 4 --nat 2 --rtt 40-160 --steps 20 --model tiny
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from echo_cli.bench_broadcast import wan_sites  # noqa: E402
from echo_cli.netlab import Wan, missing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--nat", type=int, default=2, help="the last K workers are behind NAT routers")
    parser.add_argument("--rtt", default="40-160", help="LO-HI ms: the workers' round trips to the learner")
    parser.add_argument("--up", type=float, default=20.0, help="every site's uplink, Mbit/s")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--learner-arg", action="append", default=[], help="one more `learner start` flag")
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="one more `worker join` flag, e.g. --uplink-mbit=20"
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if why := missing():
        sys.exit(f"bench_wan_swarm needs network namespaces: {why}")
    lo, hi = (float(x) for x in args.rtt.split("-"))
    n = args.workers
    sites = wan_sites(n, (lo, hi), args.nat, args.up, args.up, None, 0.0)  # the broadcast benchmark's layout
    echo = [sys.executable, "-m", "echo_cli"]
    wan = Wan(sites)
    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="echo-rl-wan-") as tmp:
            tmp = Path(tmp)
            run_dir = tmp / "run"
            learner = subprocess.Popen(
                [*wan.exec_prefix(wan.ns[0]), *echo, "learner", "start", "--model", args.model, "--steps",
                 str(args.steps), "--run-dir", str(run_dir), "--listen", "/ip4/0.0.0.0/tcp/0", "--min-workers",
                 str(n), "--no-autoscale", *args.learner_arg],
                cwd=ROOT, stdout=open(tmp / "learner.log", "w"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            procs.append(learner)
            addr_file = run_dir / "learner.addr"
            deadline = time.monotonic() + 300
            while not (addr_file.exists() and addr_file.read_text().strip()) and time.monotonic() < deadline:
                assert learner.poll() is None, (tmp / "learner.log").read_text()[-2000:]
                time.sleep(0.2)
            addr = addr_file.read_text().strip()
            for k in range(n):
                procs.append(subprocess.Popen(
                    [*wan.exec_prefix(wan.ns[k + 1]), *echo, "worker", "join", "--learner", addr, "--name", f"w{k}",
                     "--identity", str(tmp / f"w{k}.key"), "--work-dir", str(tmp / f"w{k}"), "--threads", "1",
                     "--max-groups", "1", *args.worker_arg],
                    cwd=ROOT, stdout=open(tmp / f"w{k}.log", "w"), stderr=subprocess.STDOUT,
                ))  # fmt: skip
            started = time.monotonic()
            learner.wait(args.timeout)
            seconds = time.monotonic() - started
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            from p2p.identity import load_identity, peer_id_of

            rows = []
            for k in range(n):
                short = peer_id_of(load_identity(tmp / f"w{k}.key"))[-8:]
                log = (tmp / f"w{k}.log").read_text()
                installed = len(set(re.findall(r"now on v(\d+)", log)))
                row = metrics[-1]["workers"].get(short, {})
                accepted = row.get("groups_accepted", 0)
                rows.append({
                    "worker": f"w{k}", "rtt_ms": round(wan.rtt_ms(0, k + 1)), "behind_nat": wan.sites[k + 1].nat,
                    "versions_installed": installed, "groups_accepted": accepted,
                    "groups_per_s": round(accepted / seconds, 3), "punched": row.get("punched", 0),
                    "tracebacks": log.count("Traceback"),
                })  # fmt: skip
            episodes = [m["turns_per_episode"] for m in metrics if "turns_per_episode" in m]  # an --env run's
            turns = {"turns_per_episode": round(sum(episodes) / len(episodes), 2)} if episodes else {}
            print(json.dumps({"steps": len(metrics), "versions_published": len(metrics) + 1,
                              "seconds": round(seconds, 1), **turns, "workers": rows}))  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        wan.close()


if __name__ == "__main__":
    main()
