"""Live terminal views of `learner start` and `worker join`; plain log lines when not on a terminal."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

log = logging.getLogger("echo_rl")


def step_line(m: dict, total: int) -> str:
    """One log line per step: what CI logs and files get."""
    line = f"step {m['step']}/{total} reward {m['reward_mean']:.3f} acc {m['accuracy']:.2f} loss {m['loss']:.4f}"
    line += f" kl {m['kl']:.4f} train {m['seconds']['train']:.1f}s"
    if "workers" in m:
        line += f" wait {m['seconds']['wait']:.1f}s util {m['utilisation']:.0%} buffer {m['buffer']}"
    else:
        line += f" gen {m['seconds']['generate']:.1f}s ({m['gen_tokens_per_s']:.0f} tok/s)"
    if "turns_per_episode" in m:  # a multi-turn environment
        line += f" episodes {m['turns_per_episode']:.1f} turns, {m['tokens_per_episode']:.0f} tokens"
        line += f", {m['failed_episodes']} failed" if m.get("failed_episodes") else ""
    return line + (f"; held-out {held_out(m['eval'])}" if "eval" in m else "")


def held_out(e: dict) -> str:
    """A step's held-out evaluation in a few words (learner.evaluation)."""
    return f"acc {e['accuracy']:.2f} pass@{e['k']} {e['pass_at_k']:.2f} reward {e['reward_mean']:.3f}"


def learner_table(m: dict, rewards: deque[float]) -> Table:
    """The newest step of a run: reward, losses, and in a swarm the learner's load and every worker."""
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("reward", f"{m['reward_mean']:.3f}  (last {len(rewards)} steps: {sum(rewards) / len(rewards):.3f})")
    table.add_row("accuracy", f"{m['accuracy']:.2f}   completion {m['completion_len_mean']:.1f} tokens")
    table.add_row("loss / kl", f"{m['loss']:.4f} / {m['kl']:.4f}   clipped {m['clip_frac']:.1%}")
    table.add_row("utilisation", f"{m['utilisation']:.0%}   train {m['seconds']['train']:.1f}s per step")
    if "eval" in m:
        table.add_row("held-out", f"{held_out(m['eval'])}   ({m['eval']['prompts']} prompts, step {m['step']})")
    if "workers" not in m:
        table.add_row("generation", f"{m['gen_tokens_per_s']:.0f} tok/s, {m['seconds']['generate']:.1f}s per step")
        return table
    stale = ", ".join(f"{k}: {v}" for k, v in m["staleness"].items())
    table.add_row("version", f"v{m['step']}   batch staleness {stale}   {m['stale_dropped']} dropped as stale")
    leases = m["leases"]
    table.add_row("buffer", f"{m['buffer']} groups   leases issued {leases['issued']}, expired {leases['expired']}")
    workers = m["workers"]
    total_tps = sum(w["tokens_per_s"] for w in workers.values())
    table.add_row("workers", f"{len(workers)}, {total_tps:.0f} tok/s together")
    for peer, w in sorted(workers.items()):
        state = "" if w.get("active", True) else "[yellow]inactive[/]  "
        table.add_row(
            f"  {peer}",
            f"{state}v{w['version']} (lag {w['version_lag']})  {w['tokens_per_s']:.0f} tok/s"
            f"  {w['groups_accepted']} groups  seen {w['last_seen_s']:.0f}s ago",
        )
    for d in m.get("decisions", []):
        table.add_row("decision", f"{'activate' if d['active'] else 'deactivate'} {d['worker']}: {d['reason']}")
    return table


def show_learner(steps: Iterable[dict], total: int, console: Console) -> None:
    """A progress bar and the newest step's figures on a terminal; one log line per step otherwise."""
    if not console.is_terminal:
        for m in steps:
            log.info("%s", step_line(m, total))
        return
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    progress = Progress(*columns, console=console)
    bar = progress.add_task("train", total=total)
    rewards: deque[float] = deque(maxlen=10)
    with Live(progress, console=console, refresh_per_second=4) as live:
        for m in steps:
            rewards.append(m["reward_mean"])
            progress.update(bar, completed=m["step"])
            live.update(Group(progress, learner_table(m, rewards)))


def worker_table(daemon: Any) -> Table:
    """What a worker is doing: its version against the learner's newest, throughput, leases, peers."""
    from p2p.host import PeerUnavailable  # here, not at the top: the CLI starts without libp2p

    table = Table(show_header=False, box=None, padding=(0, 2))
    held = daemon.version if daemon.version >= 0 else None
    table.add_row("now", daemon.state)
    fetcher = daemon.fetcher
    newest = f"newest published: v{fetcher.announced}" if fetcher is not None else "not joined yet"
    if fetcher is not None and fetcher.fetching >= 0:
        newest += f", fetching v{fetcher.fetching} while generating"
    table.add_row("version", f"{'-' if held is None else f'v{held}'}  ({newest})")
    table.add_row("throughput", f"{daemon.tokens_per_s:.0f} tok/s on the last lease")
    table.add_row("leases done", str(daemon.leases_done))
    if daemon.host is not None and daemon.peer is not None:
        try:
            peers = f"{len(daemon.host.connected_peers())} connected"
        except PeerUnavailable:  # starting or stopping
            peers = "-"
        table.add_row("peers", f"{peers}, {daemon.peer.chunks_served} chunks served")
    return table


def show_worker(daemon: Any, console: Console) -> None:
    """Run the daemon; on a terminal, with a live view refreshed from its state twice a second."""
    if not console.is_terminal:
        daemon.run()
        return

    class View:  # rich asks for the renderable at each refresh
        def __rich__(self) -> Table:
            return worker_table(daemon)

    with Live(View(), console=console, refresh_per_second=2):
        daemon.run()
