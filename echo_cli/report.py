"""`echo-rl report RUN_DIR [RUN_DIR ...]`: PNG plots and a summary table from runs' metrics.jsonl.

Works on finished and running runs alike, co-located or swarm: plots whose metrics a run does not
have (staleness, version lag and broadcast times exist only in swarm runs, held-out evaluation only with
--eval-every, turns and tokens per episode only with --env) are skipped and named. Several runs: their
curves overlaid and their summaries side by side.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


class ReportError(Exception):
    """The run directory cannot be reported on; the message says why and what to do."""


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of RUN_DIR/metrics.jsonl; a torn last line (a crash mid-write) is ignored."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: pass the --run-dir of a learner run")
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as exc:
            if number == len(lines):
                break  # written while the learner died; --resume trims it too
            raise ReportError(f"{path}:{number} is not a step record ({exc}); delete that line") from None
        rows.append(row)
    if not rows:
        raise ReportError(f"{path} holds no steps yet: wait for the first step to finish")
    return rows


def utilisation(row: dict[str, Any]) -> float:
    """Training seconds / step seconds (older co-located records lack the field)."""
    if "utilisation" in row:
        return float(row["utilisation"])
    total = sum(row["seconds"].values())
    return row["seconds"].get("train", 0.0) / total if total > 0 else 0.0


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of a run that docs/benchmarks.md quotes."""
    wall = rows[-1]["wall_s"]
    train = sum(r["seconds"].get("train", 0.0) for r in rows)
    rewards = [r["reward_mean"] for r in rows]
    stale: Counter[int] = Counter()
    for r in rows:
        stale.update({int(k): v for k, v in r.get("staleness", {}).items()})
    bcast = by_version(rows, "bcast_s")
    sizes = by_version(rows, "version_bytes")
    last = rows[-1]
    summary: dict[str, Any] = {
        "steps": len(rows),
        "last_step": last["step"],
        "mode": "swarm" if "workers" in last else "colocated",
        "wall_min": round(wall / 60, 2),
        "utilisation": round(train / wall, 3) if wall > 0 else None,
        "reward_mean": round(mean(rewards), 3),
        "reward_first10": round(mean(rewards[:10]), 3),
        "reward_last10": round(mean(rewards[-10:]), 3),
        "reward_gain_per_min": round((mean(rewards[-10:]) - mean(rewards[:10])) / (wall / 60), 4) if wall else None,
        "accuracy_last10": round(mean([r["accuracy"] for r in rows[-10:]]), 3),
        "completion_len_last10": round(mean([r["completion_len_mean"] for r in rows[-10:]]), 1),
    }
    episodes = [r for r in rows[-10:] if "turns_per_episode" in r]
    if episodes:
        summary |= {
            "turns_per_episode_last10": round(mean([r["turns_per_episode"] for r in episodes]), 2),
            "tokens_per_episode_last10": round(mean([r["tokens_per_episode"] for r in episodes]), 1),
        }
    evals = evaluations(rows)
    if evals:
        summary |= {
            "eval_task": evals[-1][1]["task"],
            "eval_accuracy_first": round(evals[0][1]["accuracy"], 3),
            "eval_accuracy_last": round(evals[-1][1]["accuracy"], 3),
            f"eval_pass@{evals[-1][1]['k']}_last": round(evals[-1][1]["pass_at_k"], 3),
        }
    if summary["mode"] == "swarm":
        summary |= {
            "staleness": {str(k): stale[k] for k in sorted(stale)},
            "stale_dropped": last.get("stale_dropped", 0),
            "leases": last.get("leases", {}),
            "workers": len(last.get("workers", {})),
            "bcast_s_mean": round(mean(list(bcast.values())), 2) if bcast else None,
            "version_mb_mean": round(mean(list(sizes.values())) / 1e6, 2) if sizes else None,
        }
    return summary


def evaluations(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(version, held-out evaluation) of a run in order; the initial policy's is version 0. Co-located, a
    step's evaluation is of its own version; in a swarm, of the version the evaluating workers held. A swarm's
    figure revoked later (an evaluator was flagged: learner.orchestrate.evaluations) is left out. Figure ids
    count again from 1 at each start of the learner, and a revocation names a figure of its own start: the
    newest figure with that id."""
    recorded: list[tuple[bool, int, dict[str, Any]]] = []  # (initial policy's?, version, figure), in order
    newest: dict[Any, int] = {}  # figure id -> index in `recorded` of the newest figure with that id
    revoked: set[int] = set()
    for r in rows:
        initial = [(True, 0, r["eval_initial"])] if "eval_initial" in r else []
        later = [*r.get("eval_earlier", []), *([r["eval"]] if "eval" in r else [])]
        for entry in [*initial, *((False, e.get("version", r["step"]), e) for e in later)]:
            if "figure" in entry[2]:
                newest[entry[2]["figure"]] = len(recorded)
            recorded.append(entry)
        revoked |= {newest[e.get("figure")] for e in r.get("eval_revoked", []) if e.get("figure") in newest}
    kept = [entry for i, entry in enumerate(recorded) if i not in revoked]
    return [(0, e) for first, _, e in kept if first][:1] + [(v, e) for first, v, e in kept if not first]


def by_version(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    """Version -> value of a per-version metric (each step record holds it for the newest few versions)."""
    values: dict[int, float] = {}
    for r in rows:
        per_version = r.get(key)
        if isinstance(per_version, dict):
            values |= {int(v): x for v, x in per_version.items()}
        elif per_version:  # records before the background publisher: a number for this step's version
            values[r["step"]] = per_version
    return dict(sorted(values.items()))


def write_plots(rows: list[dict[str, Any]], out: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs into `out`; returns (files written, plots skipped with the reason)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    skipped: list[str] = []
    steps = [r["step"] for r in rows]
    minutes = [r["wall_s"] / 60 for r in rows]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    rewards = [r["reward_mean"] for r in rows]
    smooth = [mean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]  # trailing 5-step mean
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in ((by_step, steps, "optimizer step"), (by_time, minutes, "wall-clock minutes")):
        ax.plot(x, rewards, label="reward", color="tab:blue", alpha=0.35)
        ax.plot(x, smooth, label="reward, 5-step mean", color="tab:blue")
        ax.plot(x, [r["accuracy"] for r in rows], label="accuracy", color="tab:green", linestyle=":")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    by_step.set_ylabel("mean over the step's rollouts")
    by_step.legend()
    save(fig, "reward.png")

    evals = evaluations(rows)
    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        eval_steps = [step for step, _ in evals]
        ax.plot(eval_steps, [e["accuracy"] for _, e in evals], marker="o", label="greedy accuracy")
        ax.plot(eval_steps, [e["pass_at_k"] for _, e in evals], marker=".", label=f"pass@{evals[-1][1]['k']}")
        ax.plot(eval_steps, [e["reward_mean"] for _, e in evals], linestyle=":", label="mean sampled reward")
        ax.set(
            xlabel="policy version (step)",
            ylabel=f"held-out {evals[-1][1]['task']} ({evals[-1][1]['prompts']} prompts)",
        )
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "eval.png")
    else:
        skipped.append("eval.png: no held-out evaluation in this run (--eval-every)")

    episodes = [r for r in rows if "turns_per_episode" in r]
    if episodes:
        fig, (turns, tokens) = plt.subplots(1, 2, figsize=(11, 4))
        x = [r["step"] for r in episodes]
        turns.plot(x, [r["turns_per_episode"] for r in episodes], color="tab:cyan")
        turns.set(xlabel="optimizer step", ylabel="model turns per episode", ylim=(0, None))
        tokens.plot(x, [r["tokens_per_episode"] for r in episodes], label="all (turns and observations)")
        tokens.plot(x, [r["model_tokens_per_episode"] for r in episodes], label="sampled by the model")
        tokens.set(xlabel="optimizer step", ylabel="tokens per episode", ylim=(0, None))
        tokens.legend()
        for ax in (turns, tokens):
            ax.grid(alpha=0.3)
        save(fig, "episodes.png")
    else:
        skipped.append("episodes.png: no multi-turn environment in this run (--env)")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [100 * utilisation(r) for r in rows], color="tab:purple")
    ax.set(xlabel="optimizer step", ylabel="learner utilisation (%)", ylim=(0, 105))
    ax.grid(alpha=0.3)
    save(fig, "utilisation.png")

    stale: Counter[int] = Counter()
    for r in rows:
        stale.update({int(k): v for k, v in r.get("staleness", {}).items()})
    if stale:
        fig, ax = plt.subplots(figsize=(6, 4))
        keys = sorted(stale)
        ax.bar([str(k) for k in keys], [stale[k] for k in keys], color="tab:orange")
        ax.set(xlabel="staleness t - x of trained groups (versions)", ylabel="prompt groups")
        save(fig, "staleness.png")
    else:
        skipped.append("staleness.png: no staleness in this run (co-located runs are on-policy)")

    lags: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        for worker, w in r.get("workers", {}).items():
            if w.get("version_lag") is not None:
                lags.setdefault(worker, []).append((r["step"], w["version_lag"]))
    if lags:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (worker, points) in enumerate(sorted(lags.items())):
            offset = 0.04 * (i - (len(lags) - 1) / 2)  # keep equal lines of different workers apart
            ax.step([p[0] for p in points], [p[1] + offset for p in points], where="post", label=worker, alpha=0.8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="optimizer step", ylabel="versions behind the learner\n(at the end of each step)")
        ax.legend(title="worker", fontsize="small")
        ax.grid(alpha=0.3)
        save(fig, "version_lag.png")
    else:
        skipped.append("version_lag.png: no workers in this run")

    bcast = by_version(rows, "bcast_s")
    if bcast:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(list(bcast), list(bcast.values()), marker=".", color="tab:red")
        ax.set(xlabel="policy version", ylabel="seconds until a worker held it", ylim=(0, None))
        ax.grid(alpha=0.3)
        save(fig, "broadcast.png")
    else:
        skipped.append("broadcast.png: no versions were broadcast in this run")
    return written, skipped


def write_comparison(runs: dict[str, list[dict[str, Any]]], out: Path) -> list[Path]:
    """Curves of several runs overlaid: reward by step and by wall time, held-out accuracy where evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, rows in runs.items():
        rewards = [r["reward_mean"] for r in rows]
        smooth = [mean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]  # trailing 5-step mean
        by_step.plot([r["step"] for r in rows], smooth, label=name)
        by_time.plot([r["wall_s"] / 60 for r in rows], smooth, label=name)
    by_step.set(xlabel="optimizer step", ylabel="reward, 5-step mean")
    by_time.set(xlabel="wall-clock minutes")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.tight_layout()
    written = [out / "compare_reward.png"]
    fig.savefig(written[0], dpi=110)
    plt.close(fig)
    evaluated = {name: evaluations(rows) for name, rows in runs.items() if evaluations(rows)}
    if evaluated:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, evals in evaluated.items():
            ax.plot([step for step, _ in evals], [e["accuracy"] for _, e in evals], marker="o", label=name)
        ax.set(xlabel="optimizer step", ylabel="held-out greedy accuracy", ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        written.append(out / "compare_eval.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def summary_table(run_dir: Path, summary: dict[str, Any]) -> Table:
    table = Table(title=f"run {run_dir}", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.1%}" if key == "utilisation" else f"{value:g}"
        elif isinstance(value, dict):  # e.g. refused reasons inside leases: their total
            value = ", ".join(f"{k}: {sum(v.values()) if isinstance(v, dict) else v}" for k, v in value.items()) or "-"
        table.add_row(key.replace("_", " "), "-" if value is None else str(value))
    return table


def compare(run_dirs: list[Path], out: Path | None, as_json: bool) -> None:
    """`echo-rl report RUN_A RUN_B ...`: curves overlaid in `out` (default RUN_A/report/compare), summaries side
    by side."""
    names = [str(d) for d in run_dirs]
    if len(set(names)) < len(names):
        raise ReportError("a run directory is named twice: pass each run once")
    runs = {name: load_metrics(d) for name, d in zip(names, run_dirs, strict=True)}
    summaries = {name: summarize(rows) for name, rows in runs.items()}
    written = write_comparison(runs, out or run_dirs[0] / "report" / "compare")
    if as_json:
        print(json.dumps({"runs": summaries, "plots": [str(p) for p in written]}))
        return
    table = Table(title="runs compared")
    table.add_column("")
    for name in names:
        table.add_column(name, overflow="fold")
    keys = list(dict.fromkeys(k for s in summaries.values() for k in s if not isinstance(s[k], dict)))
    for key in keys:
        cells = [summaries[name].get(key) for name in names]
        table.add_row(
            key.replace("_", " "), *("-" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in cells)
        )
    console = Console()
    console.print(table)
    for path in written:
        console.print(f"wrote {path}")


def report(run_dir: Path, out: Path | None, as_json: bool) -> None:
    rows = load_metrics(run_dir)
    summary = summarize(rows)
    written, skipped = write_plots(rows, out or run_dir / "report")
    if as_json:
        print(json.dumps({"summary": summary, "plots": [str(p) for p in written], "skipped": skipped}))
        return
    console = Console()
    console.print(summary_table(run_dir, summary))
    for path in written:
        console.print(f"wrote {path}")
    for reason in skipped:
        console.print(f"[dim]skipped {reason}[/]")
