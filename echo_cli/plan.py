"""`echo-rl plan`: evaluate the capacity model for a list of workers (learner/plan/capacity.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from echo_cli.config import table_values
from learner.plan.capacity import LearnerFigures, Plan, WorkerProfile, fresh_rate, plan
from learner.plan.simulator import LearnerProfile, WorkerClass, check_profile
from p2p.config import ConfigError, read_toml

REQUIRED = {"name": str, "rollouts_per_s": (int, float), "lease_s": (int, float), "price_per_hour": (int, float)}


def load_workers(path: Path) -> list[WorkerProfile]:
    """[[workers]] tables with name, rollouts_per_s, lease_s, price_per_hour and optionally overlap (false:
    a worker run with --no-overlap, which stops generating to fetch; other keys are ignored)."""
    doc = read_toml(path, "--workers")
    tables = doc.get("workers")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path} needs [[workers]] tables with name, rollouts_per_s, lease_s, price_per_hour")
    workers, names = [], set()
    for k, table in enumerate(tables, 1):
        for key, kind in REQUIRED.items():
            value = table.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"{path}: worker {k} needs {key} ({'a string' if kind is str else 'a number'})")
            if kind is not str and (not math.isfinite(value) or value < 0):
                raise ConfigError(f"{path}: worker {k} ({table['name']}): {key} must be a finite number >= 0")
        if table["name"] in names:
            raise ConfigError(f"{path}: two workers are named {table['name']!r}; names must be unique")
        names.add(table["name"])
        overlap = table.get("overlap", True)
        if not isinstance(overlap, bool):
            raise ConfigError(f"{path}: worker {k} ({table['name']}): overlap must be true or false")
        workers.append(
            WorkerProfile(table["name"], table["rollouts_per_s"], table["lease_s"], table["price_per_hour"], overlap)
        )
    return workers


def load_profile(path: Path) -> tuple[LearnerProfile, list[WorkerClass]]:
    """`echo-rl simulate --profile`: an optional [learner] table and [[workers]] tables (the fields of
    learner.plan.simulator.LearnerProfile and WorkerClass)."""
    doc = read_toml(path, "--profile")
    learner = LearnerProfile(**table_values(LearnerProfile, doc.get("learner", {}), "learner", path))
    tables = doc.get("workers", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path} needs at least one [[workers]] table (name, share, rollouts_per_s, ...)")
    classes = [WorkerClass(**table_values(WorkerClass, t, f"workers[{k}]", path)) for k, t in enumerate(tables, 1)]
    check_profile(learner, classes)
    return learner, classes


def check_figures(f: LearnerFigures) -> None:
    for name, value in (("--rollouts-per-step", f.rollouts_per_step), ("--train-step-s", f.train_step_s)):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if f.publish_every < 1 or f.staleness < 0 or f.bcast_s < 0 or f.margin < 0:
        raise ConfigError("--publish-every >= 1, --staleness >= 0, --bcast-s >= 0 and --margin >= 0 are required")


def render(workers: list[WorkerProfile], f: LearnerFigures, p: Plan) -> Table:
    table = Table(title="workers")
    for col in ("worker", "rollouts/s", "lease s", "$/h", "fresh rollouts/s", "decision"):
        table.add_column(col, justify="left" if col in ("worker", "decision") else "right")
    for w in workers:
        if w.name in p.active:
            decision = "[green]activate[/]"
        elif w.name in p.inactive:
            decision = f"inactive: {p.inactive[w.name]}"
        else:
            decision = f"[red]ineligible[/]: {p.ineligible[w.name]}"
        fresh = "-" if w.name in p.ineligible else f"{fresh_rate(w, f):.3g}"
        table.add_row(w.name, f"{w.rollouts_per_s:g}", f"{w.lease_s:g}", f"{w.price_per_hour:g}", fresh, decision)
    return table


def show_plan(workers_file: Path, f: LearnerFigures, as_json: bool) -> None:
    check_figures(f)
    workers = load_workers(workers_file)
    p = plan(workers, f)
    if as_json:
        print(json.dumps(dataclasses.asdict(p)))
        return
    console = Console()
    console.print(render(workers, f, p))
    console.print(
        f"activate {len(p.active)} of {len(workers)} workers: {p.supply:.3g} fresh rollouts/s for a demand of "
        f"{p.demand:.3g} (R / T_train plus {f.margin:.0%})\n"
        f"predicted learner utilisation {p.utilisation:.1%}\n"
        f"cost ${p.cost_per_hour:.4g}/h, ${p.cost_per_step:.4g} per step, "
        f"${p.cost_per_1k_rollouts:.4g} per 1,000 rollouts",
        highlight=False,
    )
    for note in p.notes:
        console.print(f"[yellow]note:[/] {note}")


def show_simulation(result: dict, learner: LearnerProfile, classes: list[WorkerClass]) -> Table:
    """`echo-rl simulate`'s result as a table: what was simulated, then what it predicts."""
    kinds = ", ".join(f"{c.name} ({c.share:g} share, {c.rollouts_per_s:g} rollouts/s, ${c.price_per_hour:g}/h)"
                      for c in classes)  # fmt: skip
    staleness = ", ".join(f"{k}: {v}" for k, v in result["staleness"].items()) or "-"
    rows = [
        ("swarm", f"{result['workers']} workers: {kinds}"),
        ("learner", f"{learner.prompts_per_step} x {learner.group_size} rollouts per step, T_train "
                    f"{learner.train_step_s:g}s, S = {learner.staleness}, kappa = {learner.publish_every}"),
        ("steps", f"{result['steps']} in {result['sim_seconds']:g} simulated seconds"),
        ("learner utilisation", f"{result['utilisation']:.1%}"),
        ("active workers", f"{result['active_workers_mean']:g} on average, {result['decisions']} decisions"),
        ("cost", f"${result['cost']:.4g} (${result['cost_per_step']:.4g} per step, "
                 f"${result['cost_per_1k_rollouts']:.4g} per 1,000 rollouts)"),
        ("staleness of trained groups", staleness),
        ("dropped as stale", f"{result['stale_dropped_groups']} groups"),
        ("leases expired", str(result["leases_expired"])),
        ("preemptions", str(result["preemptions"])),
        ("broadcast", f"{result['bcast_s_mean']:g}s mean, {result['bcast_s_p95']:g}s p95"),
    ]  # fmt: skip
    table = Table(title="simulated swarm", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    return table
