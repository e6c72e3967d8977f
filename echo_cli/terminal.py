"""What every command shares: the stderr console, logging through rich, and one-line user errors."""

from __future__ import annotations

import logging

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from envs import EnvError
from p2p.config import ConfigError
from p2p.logs import DemoteLibp2p

console = Console(stderr=True)
log = logging.getLogger("echo_rl")


def setup_logging(verbose: bool = False) -> None:
    """Rich log lines; --verbose shows echo-rl's own debug messages (not those of its libraries)."""
    handler = RichHandler(console=console, show_path=False, rich_tracebacks=True)
    handler.addFilter(DemoteLibp2p(keep_debug=verbose))  # its expected dial failures are ERROR records
    logging.basicConfig(level=logging.INFO, format="%(message)s", datefmt="[%X]", handlers=[handler], force=True)
    noisy_libraries = ("transformers", "accelerate", "urllib3", "filelock", "gguf", "libp2p", "multiaddr", "verifiers",
                       "openenv", "mcp", "httpx")  # fmt: skip
    for noisy in noisy_libraries:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for ours in ("echo_rl", "learner", "worker", "envs", "p2p"):
        logging.getLogger(ours).setLevel(logging.DEBUG if verbose else logging.INFO)


def fail(message: str) -> typer.Exit:
    # one line, never wrapped; escaped, since messages quote user input such as [[workers]]
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions whose message is a complete one-line explanation for the user."""
    errors: list[type[Exception]] = [ConfigError, EnvError]
    try:
        from learner.tasks import TaskError
        from learner.train.checkpoint import CheckpointError
        from learner.train.models import ModelError

        errors += [ModelError, TaskError, CheckpointError]
    except ImportError:  # a worker-only install has no torch
        pass
    return tuple(errors)
