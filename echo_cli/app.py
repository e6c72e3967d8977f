"""The `echo-rl` command: `learner start`, `worker join`, `status`, `report`, `bench ...`."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from typer.core import TyperGroup

from echo_cli.config import load_config, with_config_flags
from echo_cli.live import show_learner, show_worker
from learner.config import LearnerConfig
from p2p.config import ConfigError
from p2p.logs import DemoteLibp2p
from worker.config import WorkerRootConfig


class CommandsInOrder(TyperGroup):
    """`echo-rl --help` lists commands in the order a user meets them, not alphabetically."""

    ORDER = ("learner", "worker", "status", "report", "plan", "simulate", "bench", "secret")

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: self.ORDER.index(n) if n in self.ORDER else len(self.ORDER))


app = typer.Typer(
    cls=CommandsInOrder,
    no_args_is_help=True,
    add_completion=False,
    help="Distributed GRPO post-training with a rollout swarm.",
)
learner_app = typer.Typer(no_args_is_help=True, help="The training node.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print measured figures.")
worker_app = typer.Typer(no_args_is_help=True, help="A rollout worker for a learner's swarm.")
app.add_typer(learner_app, name="learner")
app.add_typer(worker_app, name="worker")
app.add_typer(bench_app, name="bench")

console = Console(stderr=True)
log = logging.getLogger("echo_rl")


def setup_logging(verbose: bool = False) -> None:
    """Rich log lines; --verbose shows echo-rl's own debug messages (not those of its libraries)."""
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=True)
    handler.addFilter(DemoteLibp2p(keep_debug=verbose))  # its expected dial failures are ERROR records
    logging.basicConfig(level=logging.INFO, format="%(message)s", datefmt="[%X]", handlers=[handler], force=True)
    for noisy in ("transformers", "accelerate", "urllib3", "filelock", "gguf", "libp2p", "multiaddr"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for ours in ("echo_rl", "learner", "worker", "p2p"):
        logging.getLogger(ours).setLevel(logging.DEBUG if verbose else logging.INFO)


def fail(message: str) -> typer.Exit:
    # one line, never wrapped; escaped, since messages quote user input such as [[workers]]
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions whose message is a complete one-line explanation for the user."""
    errors: list[type[Exception]] = [ConfigError]
    try:
        from learner.tasks import TaskError
        from learner.train.checkpoint import CheckpointError
        from learner.train.models import ModelError

        errors += [ModelError, TaskError, CheckpointError]
    except ImportError:  # a worker-only install has no torch
        pass
    return tuple(errors)


@learner_app.command("start")
@with_config_flags(LearnerConfig)
def learner_start(
    overrides: dict,
    config: Path | None = typer.Option(
        None, "--config", help=r"TOML file with \[run] \[model] \[task] \[grpo] \[sampler] \[swarm] tables."
    ),
    colocated: bool = typer.Option(False, "--colocated", help="Generate, train and reload in this one process."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest checkpoint."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Train a policy with GRPO: on rollouts from swarm workers, or --colocated in this one process."""
    setup_logging(verbose)
    from learner.train.data_parallel import started_by_torchrun

    try:
        cfg = load_config(LearnerConfig, config, overrides)
        if colocated and started_by_torchrun():
            raise ConfigError("--colocated runs in one process: start it without torchrun")
        if colocated:
            from learner.colocated_loop import train_colocated
            from worker.engines import make_engine

            sampler = cfg.sampler
            # the sampler on the learner's GPU too: llama.cpp offloads its layers, transformers runs on --device
            engine = make_engine(
                sampler.engine, Path(cfg.run.run_dir) / "sampler", sampler.threads, sampler.max_batch,
                sampler.gpu_layers, cfg.model.device,
            )  # fmt: skip
            steps = train_colocated(cfg, engine, resume=resume)
        else:
            from learner.swarm_loop import train_distributed

            steps = train_distributed(cfg, resume=resume)
        show_learner(steps, cfg.run.steps, console)
    except user_errors() as exc:
        raise fail(str(exc)) from None
    if started_by_torchrun():
        # torchrun ranks: the run is complete (checkpoint written, process group left), but a rank's
        # static destructors sometimes abort in a torch.distributed thread ("terminate called without
        # an active exception"), which torchrun reports as a failed run; skip them
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the PNGs (default RUN_DIR/report)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary and file list as one JSON object."),
) -> None:
    """Plot a run (reward, utilisation, staleness, version lag, broadcast times) and summarize it."""
    from echo_cli.report import ReportError
    from echo_cli.report import report as write_report

    try:
        write_report(run_dir, out, json_out)
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


@bench_app.command("sampler")
def bench_sampler(
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or path (as for learner start)."),
    prompts: int = typer.Option(8, "--prompts", help="Distinct prompts."),
    group_size: int = typer.Option(4, "--group-size", help="Completions per prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Completion length limit."),
    threads: int = typer.Option(2, "--threads", help="CPU threads for both samplers."),
    max_batch: int = typer.Option(32, "--max-batch", help="Sequences our sampler decodes together."),
    cache_dir: str = typer.Option("~/.cache/echo-rl", "--cache-dir", help="Model cache."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Our batched llama.cpp sampler (with logprobs) vs llama-cpp-python's create_completion (without)."""
    setup_logging()
    from echo_cli.bench import run_sampler_bench

    try:
        run_sampler_bench(model, prompts, group_size, max_new_tokens, threads, max_batch, cache_dir, json_out)
    except user_errors() as exc:
        raise fail(str(exc)) from None


@bench_app.command("engines")
def bench_engines(
    engines: str = typer.Option(
        "llamacpp-cpu,llamacpp-gpu,transformers-cpu,transformers-cuda", "--engines",
        help="Comma-separated: llamacpp-cpu, llamacpp-gpu, transformers-cpu, transformers-cuda.",
    ),
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or path (as for learner start)."),
    prompts: int = typer.Option(8, "--prompts", help="Distinct prompts."),
    group_size: int = typer.Option(8, "--group-size", help="Completions per prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Completion length limit."),
    threads: int = typer.Option(2, "--threads", help="CPU threads."),
    max_batch: int = typer.Option(32, "--max-batch", help="Sequences decoded together."),
    cache_dir: str = typer.Option("~/.cache/echo-rl", "--cache-dir", help="Model cache."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:  # fmt: skip
    """Worker tokens/s per engine: llama.cpp on CPU and GPU, transformers on CPU and CUDA, same prompts."""
    setup_logging()
    from echo_cli.bench import run_engines_bench

    try:
        run_engines_bench(
            engines.split(","), model, prompts, group_size, max_new_tokens, threads, max_batch, cache_dir, json_out
        )
    except user_errors() as exc:
        raise fail(str(exc)) from None


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


@bench_app.command("verify")
def bench_verify(
    model: str = typer.Option("smollm2-135m", "--model", help="smollm2-135m, tiny, or a local model."),
    prompts: int = typer.Option(16, "--prompts", help="Prompt groups."),
    group_size: int = typer.Option(8, "--group-size", help="Completions per prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Token budget per completion."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    wire_dtype: str = typer.Option("f16", "--wire-dtype", help="f16 or bf16 published weights."),
    threads: int = typer.Option(2, "--threads", help="CPU threads."),
    cache_dir: str = typer.Option("~/.cache/echo-rl", "--cache-dir", help="Model cache."),
    temperatures: str = typer.Option("1.0", "--temperatures", help="Comma-separated sampling temperatures."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Calibrate rollout verification: honest llama.cpp rollouts against forged logprobs and unsampled text."""
    setup_logging()
    from echo_cli.bench import run_verify_bench

    if wire_dtype not in ("f16", "bf16") or not 0 < top_p <= 1:
        raise fail("--wire-dtype must be f16 or bf16 and --top-p in (0, 1]")
    try:
        temps = [float(t) for t in temperatures.split(",")]
    except ValueError:
        raise fail(f"--temperatures must be numbers separated by commas, got {temperatures!r}") from None
    if not temps or min(temps) <= 0:
        raise fail(f"--temperatures must all be > 0, got {temperatures!r}")
    try:
        run_verify_bench(
            model, prompts, group_size, max_new_tokens, top_p, wire_dtype, threads, cache_dir, json_out, temps
        )
    except user_errors() as exc:
        raise fail(str(exc)) from None


@bench_app.command("broadcast")
def bench_broadcast(
    peers: int = typer.Option(8, "--peers", help="Peer processes besides the learner."),
    size: float = typer.Option(64, "--size", help="Version size in MB (random bits, so incompressible)."),
    learner_up: float = typer.Option(20, "--learner-up", help="Learner upload cap, Mbit/s."),
    peer_up: float = typer.Option(20, "--peer-up", help="Peer upload cap, Mbit/s."),
    peer_down: float = typer.Option(0, "--peer-down", help="Peer download cap, Mbit/s (0 = none)."),
    mode: str = typer.Option("swarm", "--mode", help="swarm (peer-assisted) or star (learner to each peer)."),
    chunk_mib: float = typer.Option(0.0, "--chunk-mib", help="Chunk MiB, 0.25 to 4 (0: the learner's own)."),
    upload_slots: int | None = typer.Option(None, "--upload-slots", help="Chunk replies sent at once (0: all)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Seconds until N peer processes hold a verified version, against star and the bound T_min."""
    from echo_cli.bench_broadcast import run_broadcast_bench

    if mode not in ("swarm", "star"):
        raise fail(f"--mode must be swarm or star, got {mode!r}")
    if peers < 1 or size <= 0 or learner_up <= 0 or peer_up <= 0:
        raise fail("--peers >= 1, --size > 0, --learner-up > 0 and --peer-up > 0 are required")
    if chunk_mib and not 0.25 <= chunk_mib <= 4:
        raise fail(f"--chunk-mib must be 0 (the learner's own) or 0.25 to 4, got {chunk_mib}")
    if upload_slots is not None and upload_slots < 0:
        raise fail(f"--upload-slots must be >= 0 (0: all at once), got {upload_slots}")
    result = run_broadcast_bench(peers, size, learner_up, peer_up, peer_down or None, mode, chunk_mib, upload_slots)
    if json_out:
        print(json.dumps(result))
        return
    for key, value in result.items():
        console.print(f"{key:>26}: {value}")


@bench_app.command("codec")
def bench_codec(
    model: str = typer.Option("smollm2-135m", "--model", help="Model name or path."),
    lrs: str = typer.Option("1e-6,1e-5", "--lrs", help="Comma-separated learning rates."),
    steps: int = typer.Option(10, "--steps", help="GRPO steps per learning rate."),
    cache_dir: str = typer.Option("~/.cache/echo-rl", "--cache-dir", help="Model cache."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Bytes on the wire for bf16 XOR-delta versions after real GRPO steps, and codec seconds."""
    setup_logging()
    from echo_cli.bench import run_codec_bench

    try:
        rates = [float(x) for x in lrs.split(",") if x.strip()]
    except ValueError:
        raise fail(f"--lrs must be comma-separated numbers, got {lrs!r}") from None
    if not rates or steps < 1:
        raise fail("--lrs needs at least one rate and --steps must be >= 1")
    try:
        run_codec_bench(model, rates, steps, cache_dir, json_out)
    except user_errors() as exc:
        raise fail(str(exc)) from None
