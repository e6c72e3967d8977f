"""`echo-rl status`: ask a learner for its status document and show it (tables, JSON, or live)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
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


def evaluation_line(evaluation: dict) -> str:
    """The newest held-out evaluation (learner.orchestrate.evaluations) and what is still to come."""
    from echo_cli.live import held_out

    last, leases = evaluation.get("last"), evaluation.get("leases") or []
    line = "none yet" if last is None else f"v{last['version']}: {held_out(last)} ({last['prompts']} prompts)"
    if leases:
        line += f"; v{leases[0]['version']} being evaluated by {', '.join(x['worker'] for x in leases)}"
    elif evaluation.get("pending"):
        line += f"; waiting for a worker holding v{evaluation['pending'][0]}"
    return line


def render(doc: dict) -> Group:
    if doc.get("kind") == "serve":
        return render_serve(doc)
    run = Table(title=f"learner {doc['peer_id'][-12:]}  run {doc['run_id']}", show_header=False)
    util = doc.get("utilisation")
    reward = doc.get("reward")
    rows = [
        ("step", f"{doc['step']} / {doc['steps']}  (newest version published: {doc['version_published']})"),
        ("mode", f"{doc['mode']}, staleness S={doc['staleness']}, publish every {doc['publish_every']}"),
        ("learner", learner_line(doc)),
        ("utilisation", "-" if util is None else f"{util:.0%}"),
        ("reward (last step)", "-" if reward is None else f"{reward:.3f}"),
        *([("environment", environment_line(doc["environment"]))] if doc.get("environment") else []),
        (
            "buffer",
            f"{doc['buffer']} groups, {doc['stale_dropped']} dropped as stale, "
            f"{doc.get('set_aside', 0)} set aside without signal",
        ),
        ("rollouts/s", f"{doc['rollouts_per_s']:.2f}"),
        ("verification", verification_line(doc)),
        *([("held-out", evaluation_line(doc["evaluation"]))] if doc.get("evaluation") else []),
        ("address", doc["addrs"][0] if doc["addrs"] else "-"),
    ]
    for key, value in rows:
        run.add_row(key, value)
    peers = Table(title=f"{len(doc['peers'])} peers")
    columns = ("peer", "address", "reach", "state", "$/h", "ver", "lag", "newest", "tok/s", "leases", "groups")
    for col in (*columns, "refused", "stale", "seen"):
        peers.add_column(col, justify="left" if col in ("peer", "address", "reach", "state") else "right", no_wrap=True)
    peers.add_column("runs on", overflow="fold")
    notes = []
    for p in doc["peers"]:
        active = p.get("active", True)
        if not active:
            notes.append(f"{p['peer_id'][-8:]}: {p.get('activity', '')}")
        if p.get("reach", "nat" if p.get("addr") and p.get("listed") is False else None) == "nat":  # (older learners)
            seen = f", seen at {short_addr(p['observed'])}" if p.get("observed") else ""
            direct = f", direct to {p['punched']} behind NATs (hole punched)" if p.get("punched") else ""
            notes.append(f"{p['peer_id'][-8:]}: behind a NAT{seen}; it dials out{direct}")
        if p.get("flagged"):
            notes.append(f"{p['peer_id'][-8:]} flagged: {p['flagged']}")
        peers.add_row(
            p["peer_id"][-8:], short_addr(p.get("addr")), reach_cell(p),
            "[red]flagged[/]" if p.get("flagged") else "active" if active else "[yellow]inactive[/]",
            f"{p['price']:.2f}", str(p["version"]), "-" if p["version_lag"] is None else str(p["version_lag"]),
            f"{p['newest_share']:.0%}", f"{p['tokens_per_s']:.0f}", str(p["open_leases"]), str(p["groups_accepted"]),
            str(p["refused"]), str(p.get("stale_dropped", 0)), f"{p['last_seen_s']:.0f}s",
            escape(p.get("hardware") or "-"),  # a worker's own words: never rich markup
        )  # fmt: skip
    if notes:
        peers.caption = "; ".join(notes)
    return Group(run, peers)


def render_serve(doc: dict) -> Group:
    """`echo-rl serve`'s swarm side (docs/status.md): its sampler versions, requests and workers."""
    side = Table(title=f"serve {doc['peer_id'][-12:]}  sampling {doc['base_model']}", show_header=False)
    versions = ", ".join(f"v{v}" for v in doc["versions"]) or "none"
    rows = [
        ("versions", f"newest v{doc['version']}; with requests: {versions} (workers hold {doc['adapter_slots']})"),
        ("requests", f"{doc['queued']} queued, {doc['leases']} leases out, {doc['answered']} answered by workers, "
                     f"{doc['sampled_here']} given back to serve"),
        ("draws", "each request alone (--sample-seed)" if doc.get("draws_alone") else "requests batched"),
        ("verification", verification_line(doc)),
        ("address", doc["addrs"][0] if doc["addrs"] else "-"),
    ]  # fmt: skip
    for key, value in rows:
        side.add_row(key, value)
    peers = Table(title=f"{len(doc['peers'])} workers")
    for col in ("peer", "state", "ver", "batch", "answered", "tok/s", "timed at", "seen", "runs on"):
        left = col in ("peer", "state", "runs on")
        peers.add_column(col, justify="left" if left else "right", no_wrap=col != "runs on")
    for p in doc["peers"]:
        state = ("[red]flagged[/]" if p.get("flagged") else f"[yellow]banned {p['banned_s']:.0f}s[/]"
                 if p["banned_s"] > 0 else p.get("lease") or "idle")  # fmt: skip
        rate = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"
        hardware = " ".join(str(v) for k, v in p["hardware"].items() if k in ("engine", "machine", "gpu"))
        peers.add_row(p["peer_id"][-8:], state, str(p["version"]), str(p["max_batch"]), str(p["answered"]), rate,
                      f"{p['lease_rate']:.1f}", f"{p['last_seen_s']:.0f}s", escape(hardware or "-"))  # fmt: skip
    flagged = [f"{p['peer_id'][-8:]} flagged: {p['flagged']}" for p in doc["peers"] if p.get("flagged")]
    if flagged:
        peers.caption = "; ".join(flagged)
    return Group(side, peers)


def environment_line(env: dict) -> str:
    """The run's multi-turn environment and its last step's episodes: turns and tokens per episode."""
    if env.get("turns_per_episode") is None:
        return f"{env['name']} (no step yet)"
    failed = f"; {env['failed_episodes']} failed (the environment raised)" if env.get("failed_episodes") else ""
    return (
        f"{env['name']}: {env['turns_per_episode']:.1f} turns, {env['tokens_per_episode']:.0f} tokens per episode "
        f"({env['model_tokens_per_episode']:.0f} sampled, the rest observations), last step{failed}"
    )


def learner_line(doc: dict) -> str:
    """Where the learner trains and its newest step's memory: peak of the training phase, resident now."""
    line = doc.get("device") or "-"
    memory = doc.get("memory_gib") or {}
    if "peak_train" in memory:
        line += f"; memory: {memory['peak_train']:.1f} GiB peak in training, {memory['resident']:.1f} GiB resident"
    return line


def verification_line(doc: dict) -> str:
    v = doc.get("verification")
    if not v:
        return "-"
    line = f"{v['groups_checked']} groups checked"
    if v["divergence_max"] is not None:
        line += f", divergence median {v['divergence_median']:.4f} max {v['divergence_max']:.4f} nats/token"
    if v.get("draw_miss_max") is not None:
        line += f", draw miss max {v['draw_miss_max']:.4f}"
    exact = any(p.get("weights", "f16") != "f16" for p in doc.get("peers", []))  # quantized: replayed exactly
    tolerance = f"{v['tolerance']}; quantized workers: 0" if exact else v["tolerance"]
    line += f" (tolerance {tolerance}), {len(v['flagged'])} workers flagged"
    banned = doc.get("banned", [])
    return line + (f", {len(banned)} peers banned" if banned else "")


def console() -> Console:
    """The terminal's width; piped into a file or a script, wide enough for every column."""
    plain = Console()
    return plain if plain.is_terminal else Console(width=160)


def short_addr(addr: str | None) -> str:
    """/ip4/1.2.3.4/tcp/4001/p2p/... -> 1.2.3.4:4001"""
    parts = (addr or "").split("/")
    return f"{parts[2]}:{parts[4]}" if len(parts) > 4 and parts[1] in ("ip4", "ip6", "dns4", "dns") else "-"


def show_status(addr: str, as_json: bool, watch: bool, timeout: float, interval: float) -> None:
    with Host(None, HostConfig(start_timeout=timeout)) as host:
        doc = fetch_status(host, addr, timeout)
        if as_json and not watch:
            print(json.dumps(doc))
            return
        if not watch:
            console().print(render(doc))
            return
        with Live(render(doc), console=console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                doc = fetch_status(host, addr, timeout)
                if as_json:
                    print(json.dumps(doc), flush=True)
                else:
                    live.update(render(doc), refresh=True)


def reach_cell(peer: dict) -> str:
    """public; NAT (it dials out); NAT+K (and holds K hole-punched connections to peers behind NATs); ?."""
    reach = peer.get("reach")
    if reach == "nat":
        return f"NAT+{peer['punched']}" if peer.get("punched") else "NAT"
    return "public" if reach == "public" else "?"
