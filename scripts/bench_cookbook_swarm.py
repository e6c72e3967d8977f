"""tinker-cookbook's RL recipes, unmodified, against `echo-rl serve` with their samples drawn by `worker join`
processes.

    .venv/bin/python scripts/bench_cookbook_swarm.py --steps 30 [--recipe rl_loop|math_rl] [--workers 2]
        [--kill-worker-at 10] [--sample-seed 7] [--second-tenant] [--json]

In --work (default /tmp/echo-cookbook-swarm) it sets up what the recipe needs offline: tinker-cookbook 0.6.1 in its
own venv on top of this checkout's .venv (kept in ~/.cache/echo-rl/cookbook-venv), SmolLM2 (the bundled model)
linked as `meta-llama/Llama-3.2-1B` (rl_loop takes only models its model_info knows; that name picks the
role_colon renderer), and a local `openai/gsm8k` dataset folder of one-digit additions (rl_loop loads that
dataset by name, and `datasets` takes a local folder of that name first): the recipe's data, swapped through
its own loader. math_rl plays its own arithmetic environment (sums of two numbers up to 100, answered as a
number; SmolLM2 served as `HuggingFaceTB/SmolLM2-135M-Instruct`, the role_colon renderer named). Then it starts
`echo-rl serve --swarm-listen`, the workers (transformers engine) and the recipe, kills a worker once
--kill-worker-at steps are done, and prints the reward of every step and how many sample requests the workers
drew (the rest were drawn by serve itself).

--second-tenant runs a second copy of the recipe at the same time under another API key (twice the learning
rate: other adapters on the same base model); with --sample-seed (serve's) the first tenant's figures are then
the same as in a run without it (docs/benchmarks.md: every value of its 8 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ECHO = [sys.executable, "-m", "echo_cli"]
COOKBOOK = "tinker-cookbook==0.6.1"
COOKBOOK_IMPORTS = ["chz", "termcolor", "pylatexenc", "cloudpickle", "blobfile", "lxml", "pycryptodomex"]
DATASETS = "datasets==5.2.0"  # rl_loop's loader, with its dependencies (pyarrow, pandas, ...; torch is ours)
KEY = "tml-cookbook-swarm-bench-key"
KEY2 = "tml-cookbook-swarm-second-key"
ALIAS = "meta-llama/Llama-3.2-1B"  # rl_loop's model: a name its model_info knows
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # math_rl's (it takes any name with renderer_name)


def cookbook_python() -> Path:
    """A venv holding tinker-cookbook and what it imports, over this checkout's .venv (a .pth file)."""
    venv = Path("~/.cache/echo-rl/cookbook-venv").expanduser()
    python = venv / "bin" / "python"
    if not (venv / "ok").exists() or (venv / "ok").read_text() != DATASETS:  # (one made before datasets: again)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        Path(site, "zz_echo_rl.pth").write_text(ours + "\n")
        pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, COOKBOOK, *COOKBOOK_IMPORTS], check=True)
        subprocess.run([*pip[:-1], DATASETS], check=True)  # (with what it needs beyond our .venv: pyarrow, dill...)
        (venv / "ok").write_text(DATASETS)
    return python


def additions(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def prepare(work: Path) -> None:
    """The model alias and the local dataset folder, in `work` (the recipe's working directory)."""
    sys.path.insert(0, str(ROOT))
    from learner.train.models import load_policy

    load_policy("smollm2-135m", "~/.cache/echo-rl")  # makes the bundled model's HF folder if missing
    for name in (ALIAS, SMOLLM2):
        alias = work / name
        alias.parent.mkdir(parents=True, exist_ok=True)
        if not alias.exists():
            alias.symlink_to(Path("~/.cache/echo-rl/smollm2-135m").expanduser())
    data = work / "openai" / "gsm8k"
    (data / "main").mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 4096, 0), ("test", 256, 1)):
        (data / "main" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in additions(n, seed)))
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check, seconds: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if process.poll() is not None:
            raise SystemExit(f"{what}: the process exited with {process.returncode} (see its log)")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--recipe", choices=("rl_loop", "math_rl"), default="rl_loop")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-worker-at", type=int, default=0, help="steps done when the last worker is killed")
    parser.add_argument("--batch-size", type=int, default=8, help="rl_loop's prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--sample-seed", type=int, default=-1, help="serve's --sample-seed (-1: draws afresh)")
    parser.add_argument("--second-tenant", action="store_true", help="the recipe twice at once, two API keys")
    parser.add_argument("--work", default="/tmp/echo-cookbook-swarm")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    python = cookbook_python()
    prepare(work)
    (work / "keys").write_text(f"{KEY}\n{KEY2}\n")
    run = work / f"run-{int(time.time())}"
    port, swarm_dir = free_port(), work / "swarm"
    (swarm_dir / "learner.addr").unlink(missing_ok=True)
    env = {**os.environ, "COLUMNS": "160"}
    model = ALIAS if args.recipe == "rl_loop" else SMOLLM2
    serve_cmd = ECHO + ["serve", "--port", str(port), "--models", model, "--device", "cpu", "--api-key-file",
                        str(work / "keys"), "--checkpoint-dir", str(work / "checkpoints"), "--swarm-listen",
                        "/ip4/127.0.0.1/tcp/0", "--swarm-dir", str(swarm_dir), "--sampler-threads", "1",
                        "--sample-seed", str(args.sample_seed)]  # fmt: skip
    processes: list[subprocess.Popen] = []
    try:
        serve = subprocess.Popen(serve_cmd, cwd=work, stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT,
                                 env=env)  # fmt: skip
        processes.append(serve)
        wait_for(lambda: (swarm_dir / "learner.addr").exists(), 300, "serve's swarm address", serve)
        addr = (swarm_dir / "learner.addr").read_text().strip()
        workers = []
        for k in range(1, args.workers + 1):
            cmd = ECHO + ["worker", "join", "--learner", addr, "--engine", "transformers", "--threads", "1",
                          "--max-batch", "8", "--identity", str(work / f"w{k}.key"), "--work-dir", str(work / f"w{k}")]
            log = open(work / f"worker-{k}.log", "w")  # noqa: SIM115 - as long as the worker
            workers.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env))
        processes += workers
        for k, w in enumerate(workers, 1):
            wait_for(lambda k=k: "now on v0" in (work / f"worker-{k}.log").read_text(), 300, f"worker {k}", w)
        cookbook_env = {**env, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
                        "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / "hf_home")}

        def recipe(log_path: Path, learning_rate: float) -> list[str]:
            common = [f"model_name={model}", f"base_url=http://127.0.0.1:{port}", f"log_path={log_path}",
                      f"group_size={args.group_size}", f"max_tokens={args.max_tokens}", f"max_steps={args.steps}",
                      "lora_rank=16", f"learning_rate={learning_rate}", "loss_fn=importance_sampling"]  # fmt: skip
            if args.recipe == "rl_loop":
                return [str(python), "-m", "tinker_cookbook.recipes.rl_loop", *common, f"batch_size={args.batch_size}",
                        "save_every=0"]  # fmt: skip
            return [str(python), "-m", "tinker_cookbook.recipes.math_rl.train", *common, "env=arithmetic",
                    "renderer_name=role_colon", f"groups_per_batch={args.batch_size}",
                    "behavior_if_log_dir_exists=delete"]  # fmt: skip

        tick = time.monotonic()
        recipe_log = open(work / f"{args.recipe}.log", "w")  # noqa: SIM115 - as long as the recipe
        loop = subprocess.Popen(recipe(run, args.learning_rate), cwd=work, stdout=recipe_log, stderr=subprocess.STDOUT,
                                env=cookbook_env)  # fmt: skip
        processes.append(loop)
        second = None
        if args.second_tenant:
            second_log = open(work / f"{args.recipe}-second.log", "w")  # noqa: SIM115 - as long as the recipe
            second = subprocess.Popen(recipe(Path(f"{run}-second"), 2 * args.learning_rate), cwd=work,
                                      stdout=second_log, stderr=subprocess.STDOUT,
                                      env={**cookbook_env, "TINKER_API_KEY": KEY2})  # fmt: skip
            processes.append(second)
        killed = None
        while loop.poll() is None or (second is not None and second.poll() is None):
            done = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
            if args.kill_worker_at and killed is None and done >= args.kill_worker_at:
                workers[-1].send_signal(signal.SIGKILL)
                killed = done
                print(f"killed worker {len(workers)} after step {done}", file=sys.stderr)
            time.sleep(1.0)
        seconds = time.monotonic() - tick
        if loop.returncode != 0:
            raise SystemExit(f"{args.recipe} exited with {loop.returncode}: see {work / (args.recipe + '.log')}")
        if second is not None and second.returncode != 0:
            raise SystemExit(f"the second tenant's {args.recipe} exited with {second.returncode}: see "
                             f"{work / (args.recipe + '-second.log')}")  # fmt: skip
    finally:
        for p in reversed(processes):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(processes):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    key = "reward/total" if args.recipe == "rl_loop" else "env/all/reward/total"

    def rewards_of(log_path: Path, name: str = key) -> list:  # (grad_norm: None where a step has none)
        steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if key in s]  # (math_rl ends with a line of token counts alone)
        return [round(s[name], 4) if name in s else None for s in steps]

    rewards = rewards_of(run)
    served = [line for line in (work / "serve.log").read_text().splitlines() if "workers drew" in line]
    leases = [int(line.split("after ")[1].split()[0]) for k in range(1, args.workers + 1)
              for line in (work / f"worker-{k}.log").read_text().splitlines() if "worker left after" in line]
    fifth = max(1, len(rewards) // 5)
    out = {
        "recipe": args.recipe, "steps": len(rewards), "seconds": round(seconds, 1), "rewards": rewards,
        "first_fifth": round(sum(rewards[:fifth]) / fifth, 4), "last_fifth": round(sum(rewards[-fifth:]) / fifth, 4),
        "killed_after_step": killed, "worker_leases": leases, "serve": served[-1] if served else None, "run": str(run),
        "grad_norms": rewards_of(run, "grad_norm:mean"), "sample_seed": args.sample_seed,
        "second_rewards": rewards_of(Path(f"{run}-second")) if second else None,
    }  # fmt: skip
    if args.json:
        print(json.dumps(out))
        return
    for s, r in enumerate(rewards):
        theirs = (out["second_rewards"] or [])[s : s + 1]
        print(f"step {s:3d}  reward {r:.4f}" + (f"  second tenant {theirs[0]:.4f}" if theirs else ""))
    print(f"{len(rewards)} steps in {seconds:.0f} s; reward {out['first_fifth']:.3f} (first fifth of the steps) -> "
          f"{out['last_fifth']:.3f} (last fifth); leases per worker {leases}; {out['serve']}")  # fmt: skip


if __name__ == "__main__":
    main()
