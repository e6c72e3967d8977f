"""How long `echo-rl serve` takes to draw N single-sample requests sent at once (as tinker-cookbook's math_rl
sends one per trajectory), against the same N sent one after another: the batching of queued requests.

    python scripts/bench_serve_sampling.py --model smollm2-135m --requests 16 --max-tokens 8

Prints both wall times and their ratio, measured side by side in one process (the server runs in a thread).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
import uvicorn  # noqa: E402
from tinker import types  # noqa: E402

from learner.serve.service import ServeOptions, make_app  # noqa: E402
from worker.engines import make_engine  # noqa: E402

KEY = "tml-bench-key-000000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="echo-bench-serve-")
    options = ServeOptions((args.model,), "~/.cache/echo-rl", "cpu", frozenset({KEY}), f"{work}/checkpoints")
    app = make_app(options, lambda: make_engine("transformers", work, args.threads, 32, device="cpu"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", api_key=KEY)
    sampler = sc.create_sampling_client(base_model=args.model).result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    prompts = [types.ModelInput.from_ints([1, 2 + i % 50, 3, 4 + i % 7]) for i in range(args.requests)]
    sampler.sample(prompts[0], 1, params).result()  # warm: the engine loads the model
    start = time.perf_counter()
    for prompt in prompts:
        sampler.sample(prompt, 1, params).result()
    one_by_one = time.perf_counter() - start
    start = time.perf_counter()
    futures = [sampler.sample(prompt, 1, params) for prompt in prompts]
    for future in futures:
        future.result()
    at_once = time.perf_counter() - start
    print(f"{args.requests} requests of 1 x {args.max_tokens} tokens on {args.model}: one after another "
          f"{one_by_one:.2f} s, sent at once {at_once:.2f} s, ratio {one_by_one / at_once:.2f}")
    server.should_exit = True


if __name__ == "__main__":
    main()
