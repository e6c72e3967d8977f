"""A code tool: the model runs Python in a sandbox to answer number questions (`--env python`).

The sandbox is bubblewrap (`bwrap`, the sandbox Flatpak runs applications in), not code of ours: every
namespace it supports is new (no network at all, its own process tree, which dies with the tool's call; no
user namespaces inside it), only the system's /usr, /lib, /bin and the interpreter's prefixes are mounted,
read-only (no home, no run directory, no /run sockets), /dev is read-only, /tmp is a fresh tmpfs of TMP_BYTES
(the only place it can write), and the interpreter runs isolated (`python -I`) as the namespace's first
process (no bwrap init to outlive the call as a zombie) in an empty environment (bwrap starts with one too).
util-linux's `prlimit` sets CPU seconds, address space (`memory_mb`, per process), written file size, open
files and processes (sandbox_command); `choom` makes the sandbox what the kernel kills first when memory runs
out; a wall-clock timeout (`timeout_s`) kills the whole tree. What the program prints (stdout, then stderr)
goes to a file under the same size limit and comes back, cut at MAX_OUTPUT characters.

A time limit is not reproducible (a program near it finishes on one machine and not on another), so this
environment cannot be replayed: it trains hosted by the learner only (`--env python --env-host learner`).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from envs import EnvError, Step
from envs.calculator import last_integer
from envs.tools import ToolEnv

MAX_OUTPUT = 2000  # characters of a run's output shown to the model
MAX_CODE = 8000  # characters of a program
TMP_BYTES = 16 << 20  # the sandbox's writable /tmp
MAX_FILE = 1 << 20  # bytes of one file the program writes, its output included


NOBODY = 65534  # the user a root learner's sandbox runs as
MAX_PROCESSES = 8  # processes and threads a program may add (a root learner's: all its sandboxes together)
CLEAN_ENV = {"PATH": "/usr/bin:/bin"}  # bwrap's own init process keeps the environment it was started with


def sandbox_command(timeout_s: float, memory_mb: int) -> list[str]:
    """The command up to the program (module docstring). util-linux's choom makes the sandbox the first the
    kernel kills when memory runs out, and its prlimit sets the limits (not a preexec_fn: the learner that
    hosts this runs threads) and execs bwrap, whose interpreter inherits them. Root's processes are not
    counted against a process limit, so a root learner's sandbox runs as nobody (setpriv) with the system
    interpreter; another user's runs as that user with MAX_PROCESSES beyond the tasks it runs already. Only
    the system's /usr (and /lib, /bin) and the interpreter's own prefixes are mounted, read-only: no home,
    no run directory, no /run sockets."""
    root = os.geteuid() == 0
    tasks = MAX_PROCESSES + (0 if root else _tasks_of(os.getuid()))
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if root else []
    python = shutil.which("python3", path="/usr/bin:/bin") if root else os.path.realpath(sys.executable)
    if python is None:
        raise EnvError("environment python needs the system's python3 (/usr/bin/python3) for its sandbox")
    prefixes = {"/usr"} if root else {"/usr", sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(python))}
    binds = [arg for p in sorted(prefixes) for arg in ("--ro-bind-try", p, p)]
    binds += [arg for p in ("/lib", "/lib64", "/bin") for arg in ("--ro-bind-try", p, p)]  # merged /usr or not
    limits = ["prlimit", f"--cpu={math.ceil(timeout_s)}", f"--as={memory_mb << 20}", f"--fsize={MAX_FILE}",
              "--nofile=64", f"--nproc={tasks}"]  # fmt: skip
    return ["choom", "-n", "1000", "--", *drop, *limits, "bwrap", *binds, "--size", str(TMP_BYTES), "--tmpfs",
            "/tmp", "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--unshare-all", "--unshare-user",
            "--disable-userns", "--assert-userns-disabled", "--as-pid-1", "--die-with-parent", "--new-session",
            "--clearenv", "--chdir", "/tmp", python, "-I", "-c"]  # fmt: skip


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
    if "\0" in code or any(0xD800 <= ord(c) < 0xE000 for c in code):
        return "error: a program cannot hold NUL characters or lone surrogates"
    # the output goes to a file, where the 1 MB file-size limit bounds it too (a pipe read into memory would not)
    with tempfile.TemporaryFile() as output:
        try:
            done = subprocess.run([*sandbox_command(timeout_s, memory_mb), code], stdout=output, stderr=output,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL, env=CLEAN_ENV, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"error: the program ran past its {timeout_s:g} s and was stopped"
        size = output.seek(0, os.SEEK_END)
        output.seek(max(size - 4 * MAX_OUTPUT, 0))
        out = output.read().decode("utf-8", "replace")
    if size >= MAX_FILE:
        out += "\n(the output was cut at 1 MB)"
    if done.returncode < 0 or done.returncode > 128:  # killed (bwrap reports its program's signal as 128 + n)
        code_ = abs(done.returncode)
        out += f"\n(exit status {code_}: probably stopped by signal {code_ % 128}, past a limit of time or memory)"
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
        if not all(shutil.which(tool) for tool in ("bwrap", "prlimit", "setpriv", "choom")):
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


_SANDBOX_WORKS: list[bool] = []  # set once a probe printed 42 (a failure is tried again next time)


def _sandbox_probe() -> str:
    """What a sandboxed `print(6 * 7)` prints: "42" where bwrap, prlimit and the interpreter work together."""
    if _SANDBOX_WORKS:
        return "42"
    out = run_sandboxed("print(6 * 7)", 10.0, 256)
    if out.strip() == "42":
        _SANDBOX_WORKS.append(True)
    return out


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for p in range(2, math.isqrt(n - 1) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)
