"""How long a libp2p connection takes to set up across a shaped link: a host in the netlab's `inet`
namespace, dialled from `home` behind the NAT router (echo_cli/netlab.py), for each one-way delay and loss.
The peer list's timeouts (p2p.peer_list.PROBE_TIMEOUT, DIAL_TIMEOUT) are chosen from these figures. Root only.

    .venv/bin/python scripts/bench_dial.py --delays 20,100,200 --loss 0,0.01 --dials 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from echo_cli import netlab  # noqa: E402

SERVE = """
import sys, time
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from p2p.host import Host, HostConfig
host = Host(Ed25519PrivateKey.new(), HostConfig(listen=[sys.argv[1]])).start()
print(host.addrs[0], flush=True)
sys.stdin.read()
"""

DIAL = """
import json, sys, time
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from p2p.host import Host
seconds = []
for _ in range(int(sys.argv[2])):
    host = Host(Ed25519PrivateKey.new()).start()  # a fresh identity: a new connection every time
    started = time.monotonic()
    host.connect(sys.argv[1], timeout=60)
    seconds.append(time.monotonic() - started)
    host.stop()
print(json.dumps(seconds))
"""


def measure(shape: netlab.Shape, dials: int) -> list[float]:
    lab = netlab.Netlab(shape)
    try:
        server = subprocess.Popen(
            [*lab.exec_prefix(lab.inet), sys.executable, "-c", SERVE, f"/ip4/{netlab.INET_IP}/tcp/0"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        addr = server.stdout.readline().strip()
        out = subprocess.run(
            [*lab.exec_prefix(lab.home), sys.executable, "-c", DIAL, addr, str(dials)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
        server.stdin.close()
        server.wait(30)
        return json.loads(out.stdout)
    finally:
        lab.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="20,100,200", help="one-way delays in ms, comma-separated")
    parser.add_argument("--loss", default="0,0.01", help="shares of packets lost, comma-separated")
    parser.add_argument("--dials", type=int, default=8, help="connections per setting")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args()
    why = netlab.missing()
    if why is not None:
        sys.exit(f"bench_dial: {why}")
    rows = []
    for delay in (float(d) for d in args.delays.split(",")):
        for loss in (float(x) for x in args.loss.split(",")):
            started = time.monotonic()
            seconds = measure(netlab.Shape(delay_ms=delay, loss=loss, rate=2e6), args.dials)
            median = statistics.median(seconds)
            row = {"rtt_ms": 2 * delay, "loss": loss, "median_s": round(median, 3), "max_s": round(max(seconds), 3),
                   "dials": len(seconds), "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
            rows.append(row)
            if not args.json:
                trips = median * 1000 / row["rtt_ms"]
                print(f"rtt {row['rtt_ms']:.0f} ms, loss {loss:.0%}: connect median {median:.2f} s, "
                      f"max {max(seconds):.2f} s ({trips:.1f} round trips)", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
