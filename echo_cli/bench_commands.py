"""`echo-rl bench ...`: benchmarks that print measured figures (their work is in echo_cli.bench*)."""

from __future__ import annotations

import json

import typer

from echo_cli.help import EchoTyper
from echo_cli.terminal import console, fail, setup_logging, user_errors
from learner.swarm_config import SwarmConfig

bench_app = EchoTyper(no_args_is_help=True, help="Benchmarks that print measured figures.")


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
    quant: str = typer.Option("", "--quant", help="llama.cpp also on q8_0, q4_0, q4_k_m weights (commas)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:  # fmt: skip
    """Worker tokens/s per engine: llama.cpp on CPU and GPU, transformers on CPU and CUDA, same prompts."""
    setup_logging()
    from echo_cli.bench import run_engines_bench

    quants = quant_formats(quant)
    try:
        run_engines_bench(
            engines.split(","), model, prompts, group_size, max_new_tokens, threads, max_batch, cache_dir, json_out,
            quants,
        )  # fmt: skip
    except user_errors() as exc:
        raise fail(str(exc)) from None


def quant_formats(text: str) -> tuple[str, ...]:
    """--quant's comma-separated weight formats, each one worker.quantize knows."""
    from worker.quantize import QUANT_TYPES

    quants = tuple(q for q in text.split(",") if q)
    if unknown := [q for q in quants if q not in QUANT_TYPES]:
        raise fail(f"--quant {','.join(unknown)}: choose from {', '.join(QUANT_TYPES)}")
    return quants


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
    draw_tolerance: float = typer.Option(
        SwarmConfig.verify_draw_tolerance, "--draw-tolerance", help="Draw miss m that flags a worker."
    ),
    off_draw: float = typer.Option(
        SwarmConfig.verify_off_draw, "--off-draw", help="Share of tokens off their draws that flags a worker."
    ),
    quant: str = typer.Option("", "--quant", help="Also quantized workers: q8_0, q4_0, q4_k_m (commas)."),
    steered: bool = typer.Option(True, "--steered/--no-steered", help="Steered forgeries (slow: hours)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Calibrate rollout verification: honest llama.cpp rollouts against forged logprobs, unsampled and
    steered text; with --quant, workers running llama.cpp's quantized weights."""
    setup_logging()
    from echo_cli.bench_verify import run_verify_bench

    if wire_dtype not in ("f16", "bf16") or not 0 < top_p <= 1:
        raise fail("--wire-dtype must be f16 or bf16 and --top-p in (0, 1]")
    try:
        temps = [float(t) for t in temperatures.split(",")]
    except ValueError:
        raise fail(f"--temperatures must be numbers separated by commas, got {temperatures!r}") from None
    if not temps or min(temps) <= 0:
        raise fail(f"--temperatures must all be > 0, got {temperatures!r}")
    quants = quant_formats(quant)
    try:
        run_verify_bench(
            model, prompts, group_size, max_new_tokens, top_p, wire_dtype, threads, cache_dir, json_out, temps,
            SwarmConfig.verify_tolerance, draw_tolerance, off_draw, quants, steered,
        )  # fmt: skip
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
    rtt: str = typer.Option("", "--rtt", help="LO-HI ms to the learner: run on emulated links (root)."),
    nat: int = typer.Option(0, "--nat", help="With --rtt: peers behind NAT routers."),
    loss: float = typer.Option(0.0, "--loss", help="With --rtt: share of packets lost on each link."),
    versions: int = typer.Option(0, "--versions", help="Then time this many more versions one by one."),
    every: float = typer.Option(2.0, "--every", help="Seconds between those versions."),
    idle_restart: bool = typer.Option(
        True, "--idle-restart/--no-idle-restart", help="With --rtt: Linux's TCP slow start after idle, on all sites."
    ),
    tcp: str = typer.Option(
        "", "--tcp", help="With --rtt: TCP congestion control on all sites, e.g. reno (default: the machine's)."
    ),
    peer_pace: float = typer.Option(
        0.0, "--peer-pace", help="With --rtt: peers pace their own uploads at this share of --peer-up (0: off)."
    ),
    learner_pace: float = typer.Option(
        0.0, "--learner-pace", help="With --rtt: the learner paces its uploads at this share of --learner-up."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Seconds until N peer processes hold a verified version, against star and the bound T_min.

    With --rtt the learner and each peer run in network namespaces, on links with those round trips and
    the rate caps (echo_cli/netlab.py); else on 127.0.0.1 with token buckets."""
    from echo_cli.bench_broadcast import BedError, run_broadcast_bench

    if mode not in ("swarm", "star"):
        raise fail(f"--mode must be swarm or star, got {mode!r}")
    if peers < 1 or size <= 0 or learner_up <= 0 or peer_up <= 0:
        raise fail("--peers >= 1, --size > 0, --learner-up > 0 and --peer-up > 0 are required")
    if chunk_mib and not 0.25 <= chunk_mib <= 4:
        raise fail(f"--chunk-mib must be 0 (the learner's own) or 0.25 to 4, got {chunk_mib}")
    if upload_slots is not None and upload_slots < 0:
        raise fail(f"--upload-slots must be >= 0 (0: all at once), got {upload_slots}")
    span = None
    if rtt:
        from echo_cli.netlab import missing

        try:
            span = tuple(float(x) for x in rtt.split("-"))
        except ValueError:
            span = ()
        if len(span) != 2 or not 0 <= span[0] <= span[1] <= 2000:
            raise fail(f"--rtt must be LO-HI milliseconds, e.g. 40-160, got {rtt!r}")
        if why := missing():
            raise fail(f"--rtt needs network namespaces: {why}")
    if not 0 <= nat <= peers or (nat and not rtt):
        raise fail(f"--nat must be 0 to --peers ({peers}), and needs --rtt")
    if not 0 <= loss < 0.5 or (loss and not rtt):
        raise fail(f"--loss must be in [0, 0.5), and needs --rtt, got {loss}")
    if not idle_restart and not rtt:
        raise fail("--no-idle-restart needs --rtt (it is set in the test bed's namespaces)")
    if tcp and (not rtt or not tcp.isalnum()):
        raise fail(f"--tcp needs --rtt and a congestion control's name (reno, cubic, bbr), got {tcp!r}")
    for name, pace in (("--peer-pace", peer_pace), ("--learner-pace", learner_pace)):
        if pace and (not rtt or not 0.1 <= pace <= 1.5):
            raise fail(f"{name} must be 0 (off) or 0.1 to 1.5, and needs --rtt, got {pace}")
    if not 0 <= versions <= 1000 or not 0.1 <= every <= 60:
        raise fail(f"--versions must be 0 to 1000 and --every 0.1 to 60 s, got {versions} and {every}")
    try:
        result = run_broadcast_bench(
            peers, size, learner_up, peer_up, peer_down or None, mode, chunk_mib, upload_slots, span, nat, loss,
            versions, every, idle_restart, tcp, peer_pace, learner_pace,
        )  # fmt: skip
    except BedError as exc:  # the test bed refused a setting (--tcp NAME this kernel does not allow)
        raise fail(str(exc)) from None
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
    quant: str = typer.Option("", "--quant", help="Also as the learner would publish q8_0, q4_0, q4_k_m (commas)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Bytes on the wire for bf16 XOR-delta versions after real GRPO steps, and codec seconds; with --quant,
    each version also quantized by llama.cpp and delta-coded as a learner publishing that format would."""
    setup_logging()
    from echo_cli.bench import run_codec_bench

    quants = quant_formats(quant)
    try:
        rates = [float(x) for x in lrs.split(",") if x.strip()]
    except ValueError:
        raise fail(f"--lrs must be comma-separated numbers, got {lrs!r}") from None
    if not rates or steps < 1:
        raise fail("--lrs needs at least one rate and --steps must be >= 1")
    try:
        run_codec_bench(model, rates, steps, cache_dir, json_out, quants)
    except user_errors() as exc:
        raise fail(str(exc)) from None
