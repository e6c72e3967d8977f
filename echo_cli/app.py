"""The `echo-rl` command: `learner start`, `worker join`, `status`, `report`, `eval`, `export`, `bench ...`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import typer
from typer.core import TyperGroup

from echo_cli.bench_commands import bench_app
from echo_cli.config import load_config, with_config_flags
from echo_cli.help import EchoTyper
from echo_cli.live import show_learner, show_worker
from echo_cli.research import eval_command, export_command
from echo_cli.terminal import console, fail, setup_logging, user_errors
from learner.config import LearnerConfig
from learner.serve.config import ServeRootConfig
from p2p.config import ConfigError
from worker.config import WorkerRootConfig

if TYPE_CHECKING:  # (the swarm side loads libp2p: not for every command)
    from learner.orchestrate.verify_quantized import QuantEngines


class CommandsInOrder(TyperGroup):
    """`echo-rl --help` lists commands in the order a user meets them, not alphabetically."""

    ORDER = ("learner", "worker", "serve", "status", "report", "eval", "export", "plan", "fit", "simulate", "bench",
             "secret")  # fmt: skip

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: self.ORDER.index(n) if n in self.ORDER else len(self.ORDER))


app = EchoTyper(
    cls=CommandsInOrder,
    no_args_is_help=True,
    add_completion=False,
    help="Distributed GRPO post-training with a rollout swarm.",
)
learner_app = EchoTyper(no_args_is_help=True, help="The training node.")
worker_app = EchoTyper(no_args_is_help=True, help="A rollout worker for a learner's swarm.")
app.add_typer(learner_app, name="learner")
app.add_typer(worker_app, name="worker")
app.add_typer(bench_app, name="bench")
app.command("eval")(eval_command)
app.command("export")(export_command)


@learner_app.command("start")
@with_config_flags(LearnerConfig)
def learner_start(
    overrides: dict,
    config: Path | None = typer.Option(
        None,
        "--config",
        help=r"TOML file with \[run] \[model] \[task] \[env] \[grpo] \[sampler] \[swarm] \[eval] tables.",
    ),
    colocated: bool = typer.Option(False, "--colocated", help="Generate, train and reload in this one process."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest checkpoint."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Train a policy with GRPO: on rollouts from swarm workers, or --colocated in this one process."""
    setup_logging(verbose)
    from learner.train.data_parallel import exit_rank, started_by_torchrun

    try:
        cfg = load_config(LearnerConfig, config, overrides)
        if colocated and started_by_torchrun():
            raise ConfigError("--colocated runs in one process: start it without torchrun")
        if colocated:
            from learner.colocated_loop import train_colocated
            from worker.engines import sampler_engine

            sampler = sampler_engine(cfg.sampler, cfg.model.device, Path(cfg.run.run_dir) / "sampler")
            steps = train_colocated(cfg, sampler, resume=resume)
        else:
            from learner.swarm_loop import train_distributed

            steps = train_distributed(cfg, resume=resume, probe=llamacpp_probe(cfg), quant=quant_engines(cfg))
        show_learner(steps, cfg.run.steps, console)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if started_by_torchrun():  # the run is complete: checkpoint written, process group left
        exit_rank()


def llamacpp_probe(cfg: LearnerConfig) -> object:
    """What builds a llama.cpp engine on the learner's machine for a spec whose family llama.cpp runs through its
    converter's recipe (None for one echo-rl's own llama layout writes), with which the learner checks once that
    llama.cpp samples the model as it scores it (learner.swarm_side.refuse_departing_llamacpp). None where
    llama-cpp-python is not installed (a learner-only install): the check is then skipped, said in the log."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        logging.getLogger("echo_cli").info("llama-cpp-python is not installed here: llama.cpp's agreement with "
                                           "the learner is not checked before workers join")  # fmt: skip
        return None
    from worker.engines import make_engine
    from worker.gguf_writer import unsupported_by_llama_layout

    def probe(spec: object) -> object:
        if unsupported_by_llama_layout(spec) is None:
            return None
        return make_engine("llamacpp", Path(cfg.run.run_dir) / "llamacpp-check", cfg.sampler.threads, 8,
                           cfg.sampler.gpu_layers)  # fmt: skip

    return probe


def quant_engines(cfg: LearnerConfig) -> QuantEngines | None:
    """llama.cpp engines on the learner's machine that replay quantized workers (`worker join --quant`) exactly,
    on this machine's llama.cpp build, on its CPU (learner.orchestrate.verify_quantized); None where
    llama-cpp-python is not installed: quantized workers are then refused at join."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from learner.orchestrate.verify_quantized import QuantEngines
    from worker.engines import make_engine
    from worker.gguf_writer import unsupported_by_writer
    from worker.quantize import llamacpp_build

    def make(fmt: str) -> Any:  # a group is one wave of G sequences
        return make_engine("llamacpp", Path(cfg.run.run_dir) / f"verify-{fmt}", cfg.sampler.threads,
                           cfg.grpo.group_size, gpu_layers=0, quant=fmt)  # fmt: skip

    return QuantEngines(make, llamacpp_build(), unsupported_by_writer)


@worker_app.command("join")
@with_config_flags(WorkerRootConfig)
def worker_join(
    overrides: dict,
    config: Path | None = typer.Option(None, "--config", help=r"TOML file with a \[worker] table."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Join a learner's swarm: fetch policy versions, generate rollouts, push them back."""
    setup_logging(verbose)
    try:
        cfg = load_config(WorkerRootConfig, config, overrides).worker
    except user_errors() as exc:
        raise fail(str(exc)) from None
    from worker.daemon import WorkerDaemon

    try:
        daemon = WorkerDaemon(cfg)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    daemon.install_signal_handlers()
    try:
        show_worker(daemon, console)
    except user_errors() as exc:  # e.g. a --max-batch below the learner's group size, found on joining
        raise fail(str(exc)) from None


@app.command("serve")
@with_config_flags(ServeRootConfig)
def serve(
    overrides: dict,
    config: Path | None = typer.Option(None, "--config", help=r"TOML file with a \[serve] table."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Serve the Tinker API to the `tinker` SDK, samples drawn by swarm workers (docs/tinker.md)."""
    from echo_cli.serve import run_server

    setup_logging(verbose)
    try:
        run_server(load_config(ServeRootConfig, config, overrides).serve)
    except user_errors() as exc:
        raise fail(str(exc)) from None


@app.command("secret")
def secret() -> None:
    """Print a new random swarm secret: `echo-rl secret > swarm.secret`, then pass --secret-file to all."""
    import secrets as random_tokens

    print(random_tokens.token_urlsafe(32))


@app.command("status")
def status(
    learner: str | None = typer.Option(None, "--learner", help="The learner's multiaddr."),
    run_dir: str | None = typer.Option(None, "--run-dir", help="Read the learner's address from RUN_DIR/learner.addr."),
    json_out: bool = typer.Option(False, "--json", help="One JSON document (schema in docs/status.md)."),
    watch: bool = typer.Option(False, "--watch", help="Refresh in place every --interval seconds."),
    timeout: float = typer.Option(5.0, "--timeout", help="Seconds to wait for the learner."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes with --watch."),
) -> None:
    """Show the swarm: the learner's step, mode, utilisation and buffer, and every worker."""
    from echo_cli.status import StatusError, learner_address, show_status

    setup_logging()
    try:
        show_status(learner_address(learner, run_dir), json_out, watch, timeout, interval)
    except StatusError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        pass


@app.command("report")
def report(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories (each holds metrics.jsonl); several: compared."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the PNGs (default RUN_DIR/report)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary and file list as one JSON object."),
) -> None:
    """Plot a run (reward, held-out evaluation, utilisation, staleness, version lag, broadcast times) and
    summarize it; with several runs, overlay their curves and put their summaries side by side."""
    from echo_cli.report import ReportError, compare
    from echo_cli.report import report as write_report

    try:
        if len(run_dirs) > 1:
            compare(run_dirs, out, json_out)
        else:
            write_report(run_dirs[0], out, json_out)
    except ReportError as exc:
        raise fail(str(exc)) from None
    except ImportError as exc:
        raise fail(f"{exc.name} is not installed: pip install 'echo-rl[learner]'") from None


@app.command("plan")
def plan_command(
    rollouts_per_step: float = typer.Option(..., "--rollouts-per-step", help="R: rollouts trained on per step."),
    train_step_s: float = typer.Option(..., "--train-step-s", help="T_train: seconds of one optimizer step."),
    publish_every: int = typer.Option(1, "--publish-every", help="kappa: steps between published versions."),
    staleness: int = typer.Option(2, "--staleness", help="S: the staleness bound."),
    bcast_s: float = typer.Option(..., "--bcast-s", help="T_bcast: seconds until a worker holds a new version."),
    workers: Path = typer.Option(..., "--workers", help=r"TOML file of \[\[workers]] tables."),
    margin: float = typer.Option(0.1, "--margin", help="Provision this fraction above the demand."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Which workers to activate for a learner, the predicted utilisation and the cost (docs/capacity-model.md)."""
    from echo_cli.plan import show_plan
    from learner.plan.capacity import LearnerFigures

    figures = LearnerFigures(rollouts_per_step, train_step_s, publish_every, staleness, bcast_s, margin)
    try:
        show_plan(workers, figures, json_out)
    except ConfigError as exc:
        raise fail(str(exc)) from None


@app.command("fit")
@with_config_flags(LearnerConfig)
def fit_command(
    overrides: dict,
    config: Path | None = typer.Option(None, "--config", help="The learner's TOML file, as for learner start."),
    colocated: bool = typer.Option(False, "--colocated", help="Size a co-located run (sampler, no verifier)."),
    memory_gib: float | None = typer.Option(
        None, "--memory-gib", help="Check against this much memory (default: the --device's, or this RAM)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Will a run fit? The learner's memory per component and a worker's model file per quantisation, from
    the model's config alone (no weights are loaded). Exits 1 when the learner does not fit."""
    setup_logging(False)
    from echo_cli.fit import show_fit

    try:
        fits = show_fit(load_config(LearnerConfig, config, overrides), colocated, memory_gib, json_out)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if not fits:
        raise typer.Exit(1)


@app.command("simulate")
def simulate_command(
    workers: int = typer.Option(100, "--workers", help="Simulated workers, split among the profile's classes."),
    profile: Path | None = typer.Option(
        None, "--profile", help=r"TOML: \[learner] and \[\[workers]] classes (default: the local SmolLM2 swarm)."
    ),
    steps: int = typer.Option(200, "--steps", help="Learner steps to simulate."),
    seed: int = typer.Option(0, "--seed", help="Seed of jitter and preemptions: equal seeds, equal results."),
    all_active: bool = typer.Option(False, "--all-active", help="Every connected worker generates (no autoscale)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Simulate a swarm with the learner's own scheduler: utilisation, cost, staleness, broadcast times."""
    import dataclasses

    from echo_cli.plan import load_profile, show_simulation
    from learner.plan.simulator import LearnerProfile, WorkerClass, simulate

    if workers < 1 or steps < 1:
        raise fail("--workers and --steps must be >= 1")
    try:
        learner, classes = load_profile(profile) if profile else (LearnerProfile(), [WorkerClass()])
    except ConfigError as exc:
        raise fail(str(exc)) from None
    result = dataclasses.asdict(simulate(learner, classes, workers, steps, seed, autoscale=not all_active))
    if json_out:
        print(json.dumps(result))
        return
    console.print(show_simulation(result, learner, classes))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
