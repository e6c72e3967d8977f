"""`echo-rl status`: ask a learner for its status document and show it (tables, JSON, or live)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from p2p.host import Host, HostConfig, PeerUnavailable, RemoteError
from p2p.messages import STATUS


class StatusError(Exception):
    """The learner could not be asked; the message says why."""


def learner_address(learner: str | None, run_dir: str | None) -> str:
    if learner:
        return learner
    if run_dir:
        path = Path(run_dir) / "learner.addr"
        if not path.is_file():
            raise StatusError(f"{path} does not exist: is a learner running with --run-dir {run_dir}?")
        return path.read_text().strip()
    raise StatusError("pass --learner MULTIADDR or --run-dir RUN_DIR")


def fetch_status(host: Host, addr: str, timeout: float) -> dict:
    try:
        return host.request(addr, STATUS, {}, timeout=timeout)
    except (PeerUnavailable, RemoteError, ValueError) as exc:
        raise StatusError(f"learner at {addr} did not answer within {timeout:g}s: {exc}") from None


def render(doc: dict) -> Group:
    run = Table(title=f"learner {doc['peer_id'][-12:]}  run {doc['run_id']}", show_header=False)
    util = doc.get("utilisation")
    reward = doc.get("reward")
    rows = [
        ("step", f"{doc['step']} / {doc['steps']}  (newest version published: {doc['version_published']})"),
        ("mode", f"{doc['mode']}, staleness S={doc['staleness']}, publish every {doc['publish_every']}"),
        ("utilisation", "-" if util is None else f"{util:.0%}"),
        ("reward (last step)", "-" if reward is None else f"{reward:.3f}"),
        ("buffer", f"{doc['buffer']} groups, {doc['stale_dropped']} dropped as stale"),
        ("rollouts/s", f"{doc['rollouts_per_s']:.2f}"),
        ("address", doc["addrs"][0] if doc["addrs"] else "-"),
    ]
    for key, value in rows:
        run.add_row(key, value)
    peers = Table(title=f"{len(doc['peers'])} peers")
    for col in (
        "peer",
        "role",
        "price $/h",
        "version",
        "lag",
        "newest held",
        "tok/s",
        "leases",
        "groups",
        "refused",
        "seen",
    ):
        peers.add_column(col, justify="left" if col in ("peer", "role") else "right")
    for p in doc["peers"]:
        peers.add_row(
            p["peer_id"][-8:], p["role"], f"{p['price']:.2f}", str(p["version"]),
            "-" if p["version_lag"] is None else str(p["version_lag"]), f"{p['newest_share']:.0%}",
            f"{p['tokens_per_s']:.0f}", str(p["open_leases"]), str(p["groups_accepted"]), str(p["refused"]),
            f"{p['last_seen_s']:.0f}s",
        )  # fmt: skip
    return Group(run, peers)


def show_status(addr: str, as_json: bool, watch: bool, timeout: float, interval: float) -> None:
    with Host(None, HostConfig(start_timeout=timeout)) as host:
        doc = fetch_status(host, addr, timeout)
        if as_json and not watch:
            print(json.dumps(doc))
            return
        if not watch:
            Console().print(render(doc))
            return
        with Live(render(doc), console=Console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                doc = fetch_status(host, addr, timeout)
                if as_json:
                    print(json.dumps(doc), flush=True)
                else:
                    live.update(render(doc), refresh=True)
