"""A worker that plays its episodes honestly, then alters them before submitting (the replay tests), or one that
lies about its weights (tests/test_quantized_workers.py):

    python -m tests.forging_worker observation|reward|truncate|format|build --learner ADDR --identity KEY --work-dir DIR

`observation` changes one token of an episode's first observation, `reward` claims a return one higher,
`truncate` cuts a single-turn group's first completion a token short;
`format` declares q8_0 weights and runs q4_0 ones, `build` declares q8_0 on a llama.cpp build that is not this
one. Everything else is the real daemon (worker.daemon.WorkerDaemon).
"""

import dataclasses
import sys

from echo_cli.terminal import setup_logging
from p2p.config import ConfigError
from worker import daemon
from worker.config import WorkerConfig

honest_play = daemon.generate_rollouts


def forged_play(generate, requests, params, rules=None, remote=None):
    groups = honest_play(generate, requests, params, rules, remote)
    for group in groups:
        if FORGE == "truncate":  # its text cut a token short: a choice of where to stop, not a sample
            c = group[0]
            if len(c.tokens) > 1:
                group[0] = dataclasses.replace(c, tokens=c.tokens[:-1], logprobs=c.logprobs[:-1])
            continue
        if FORGE == "reward":
            group[0] = dataclasses.replace(group[0], reward=group[0].reward + 1.0)
            continue
        # An observation to change: the group's first episode that has one (an episode can end after its first
        # turn; forging only the group's first member left whole runs unforged now and then).
        i = next((i for i, episode in enumerate(group) if len(episode.spans) > 1), None)
        if i is not None:
            tokens = list(group[i].tokens)
            tokens[group[i].spans[0]] = (tokens[group[i].spans[0]] + 1) % 200
            group[i] = dataclasses.replace(group[i], tokens=tokens)
    return groups


honest_engine = daemon.make_engine


def lying_engine(*args):
    """The daemon's engine, running q4_0 weights where it declares q8_0 (`format`), or declaring another build."""
    engine = honest_engine(*args[:-1], "q4_0" if FORGE == "format" else args[-1])
    declared = engine.backend
    lie = {"weights": "q8_0"} if FORGE == "format" else {"build": "0.3.36-cpu-00000000"}
    engine.backend = lambda: declared() | lie
    return engine


if __name__ == "__main__":
    FORGE = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2], strict=True))
    setup_logging(False)
    weights = FORGE in ("format", "build")
    if weights:
        daemon.make_engine = lying_engine
    else:
        daemon.generate_rollouts = forged_play
    cfg = WorkerConfig(learner=args["--learner"], identity=args["--identity"], work_dir=args["--work-dir"],
                       listen="/ip4/127.0.0.1/tcp/0", quant="q8_0" if weights else "f16")  # fmt: skip
    try:
        daemon.WorkerDaemon(cfg).run()
    except ConfigError as exc:  # as `echo-rl worker join` ends: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
