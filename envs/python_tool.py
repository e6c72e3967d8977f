"""A code tool: the model runs Python in a sandbox to answer number questions (`--env python`).

The sandbox is bubblewrap (`bwrap`, the sandbox Flatpak runs applications in), not code of ours: every
namespace it supports is new (no network at all, its own process tree, which dies with the tool's call), the
host's filesystem is mounted read-only, /tmp is a fresh tmpfs of TMP_BYTES (the only place it can write), the
environment variables are cleared, and the interpreter runs isolated (`python -I`). Resource limits are set
by util-linux's `prlimit` before bwrap starts: CPU seconds, address space (`memory_mb`), written file size,
open files and processes (sandbox_command); a wall-clock timeout (`timeout_s`) kills the whole tree. What
the program prints (stdout, then stderr) comes back, cut at MAX_OUTPUT characters.

A time limit is not reproducible (a program near it finishes on one machine and not on another), so this
environment cannot be replayed: it trains hosted by the learner only (`--env python --env-host learner`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass

from envs import EnvError, Step
from envs.calculator import last_integer
from envs.tools import ToolEnv

MAX_OUTPUT = 2000  # characters of a run's output shown to the model
MAX_CODE = 8000  # characters of a program
TMP_BYTES = 16 << 20  # the sandbox's writable /tmp


NOBODY = 65534  # the user a root learner's sandbox runs as
MAX_PROCESSES = 32  # processes and threads a program may add


def sandbox_command(timeout_s: float, memory_mb: int) -> list[str]:
    """The command up to the program: util-linux's prlimit sets the limits (not a preexec_fn: the learner that
    hosts this runs threads) and execs bwrap, whose sandboxed interpreter inherits them. Root's processes are
    not counted against a process limit, so a root learner's sandbox runs as nobody (setpriv), with the system
    interpreter (one nobody can read); another user's runs as that user with MAX_PROCESSES beyond the tasks
    it runs already."""
    root = os.geteuid() == 0
    tasks = MAX_PROCESSES + (0 if root else _tasks_of(os.getuid()))
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if root else []
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") if root else sys.executable
    limits = ["prlimit", f"--cpu={math.ceil(timeout_s)}", f"--as={memory_mb << 20}", f"--fsize={1 << 20}",
              "--nofile=64", f"--nproc={tasks}"]  # fmt: skip
    return [*drop, *limits, "bwrap", "--ro-bind", "/", "/", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
            "--proc", "/proc", "--dev", "/dev", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--chdir", "/tmp", str(python), "-I", "-c"]  # fmt: skip


def _tasks_of(uid: int) -> int:
    """Processes and threads that `uid` runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def run_sandboxed(code: str, timeout_s: float, memory_mb: int) -> str:
    """Run Python `code` in the sandbox; its output, or why it stopped."""
    if len(code) > MAX_CODE:
        return f"error: a program may have at most {MAX_CODE} characters"
    try:
        done = subprocess.run([*sandbox_command(timeout_s, memory_mb), code], capture_output=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"error: the program ran past its {timeout_s:g} s and was stopped"
    out = (done.stdout + done.stderr).decode("utf-8", "replace")
    if done.returncode < 0:
        out += f"\n(stopped by signal {-done.returncode}: past a limit of time or memory)"
    return out[-MAX_OUTPUT:] if out.strip() else "(the program printed nothing: print the result)"


@dataclass
class PythonToolEnv(ToolEnv):
    """Number questions (a power's digit sum, primes below a bound, a big power modulo m) too long to work out
    in one's head, with a Python tool, `run_python(code)`. A turn without a call is the final answer: reward
    1 if its last integer is right, else 0. `call_cost` is subtracted per call."""

    timeout_s: float = 2.0
    memory_mb: int = 256
    call_cost: float = 0.0
    replayable = False  # a time limit is not reproducible: hosted by the learner only

    def __post_init__(self) -> None:
        if not all(shutil.which(tool) for tool in ("bwrap", "prlimit", "setpriv")):
            raise EnvError("environment python runs code in bubblewrap under prlimit: install them (apt-get install "
                           "bubblewrap util-linux)")
        if not 0.1 <= self.timeout_s <= 60 or not 32 <= self.memory_mb <= 4096:
            raise EnvError("python: timeout_s must be in [0.1, 60] and memory_mb in [32, 4096]")
        if (probe := _sandbox_probe()).strip() != "42":
            raise EnvError(f"environment python: the sandbox does not run here: {probe.strip()[:200]}")
        self.answer = 0

        def run_python(code: str) -> str:
            """Run a Python program in a sandbox (no network, no files outside /tmp) and return what it prints.

            Args:
                code: the program; print the values you need
            """
            return run_sandboxed(code, self.timeout_s, self.memory_mb)

        self.tools = (run_python,)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        kind = rng.randrange(3)
        if kind == 0:
            n = rng.randint(50, 400)
            self.answer, question = sum(map(int, str(2**n))), f"What is the sum of the digits of 2**{n}?"
        elif kind == 1:
            n = rng.randint(1000, 20000)
            self.answer, question = _primes_below(n), f"How many primes are there below {n}?"
        else:
            a, b, m = rng.randint(2, 999), rng.randint(100, 10**6), rng.randint(1000, 10**6)
            self.answer, question = pow(a, b, m), f"What is {a}**{b} modulo {m}?"
        return f"{question} Use the run_python tool to compute it, then reply with the number."

    def step(self, action: str) -> Step:
        return Step(reward=1.0 if last_integer(action) == self.answer else 0.0, done=True)


@functools.cache
def _sandbox_probe() -> str:
    """What a sandboxed `print(6 * 7)` prints: "42" where bwrap, prlimit and the interpreter work together."""
    return run_sandboxed("print(6 * 7)", 10.0, 256)


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for p in range(2, math.isqrt(n - 1) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)
