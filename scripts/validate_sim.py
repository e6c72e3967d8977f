"""Predict a measured swarm run with the simulator and compare utilisation and staleness.

    .venv/bin/python scripts/validate_sim.py runs/b --fit runs/a     # out of sample: fitted on a, checked on b

The simulator's parameters are fitted on the run given by --fit (default: the checked run itself, which
is in sample and flattering): from its RUN_DIR/config.json and metrics.jsonl, T_train (mean and spread of
seconds.train), the bytes of each version, the broadcast time (bcast_s: the end of the step that made
the version until a worker held it, encoding included; runs before 2026-11-23 counted from publication),
and per worker its generation rate (the scheduler's estimate, or tokens/s
over mean completion length). The learner's own settings (batch, staleness, kappa) come from the
checked run. The simulation runs as many steps as the checked run and prints measured and predicted
learner utilisation and staleness side by side.
"""

import argparse
import json
import statistics
from pathlib import Path

from echo_cli.report import by_version, load_metrics, summarize
from learner.plan.simulator import LearnerProfile, WorkerClass, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run whose utilisation and staleness are predicted")
    parser.add_argument("--fit", type=Path, help="the run the parameters are measured on (default: run_dir)")
    parser.add_argument("--encode-s", type=float, default=1.0, help="seconds to encode a version (codec bench)")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    cfg = json.loads((args.run_dir / "config.json").read_text())
    measured_rows = load_metrics(args.run_dir)
    measured = summarize(measured_rows)
    fit = args.fit or args.run_dir
    rows = load_metrics(fit)
    trained = [r["seconds"]["train"] for r in rows if r["trained_tokens"] > 0]
    t_train = statistics.mean(trained)
    spread = min(0.9, statistics.pstdev(trained) / t_train * 3**0.5)  # a uniform with the same spread
    sizes = by_version(rows, "version_bytes")
    bcast = list(by_version(rows, "bcast_s").values())
    g, swarm = cfg["grpo"]["group_size"], cfg["swarm"]
    completion = statistics.mean(r["completion_len_mean"] for r in rows)
    classes = []
    for name, w in rows[-1]["workers"].items():
        rate = (
            w.get("rollouts_per_s")
            or statistics.mean(r["workers"][name]["tokens_per_s"] for r in rows if name in r["workers"]) / completion
        )
        classes.append(WorkerClass(name=name, share=1.0, rollouts_per_s=rate, jitter=0.2, rtt_s=0.01,
                                   uplink_mbps=1e5, downlink_mbps=1e5,
                                   load_s=max(0.0, statistics.mean(bcast) - args.encode_s)))  # fmt: skip
    dynamic = cfg["grpo"].get("dynamic_sampling", False)  # the share of groups with signal, measured
    signal = sum(r["groups"] - r["equal_reward_groups"] for r in rows) / sum(r["groups"] for r in rows)
    learner = LearnerProfile(
        signal_share=signal if dynamic else 1.0,
        sampling_rounds=cfg["grpo"].get("sampling_rounds", 4),
        prompts_per_step=cfg["grpo"]["prompts_per_step"],
        group_size=g,
        train_step_s=t_train,
        train_jitter=spread,
        publish_every=swarm["publish_every"],
        staleness=swarm["staleness"],
        prefetch_batches=swarm["prefetch_batches"],
        groups_per_lease=swarm["groups_per_lease"],
        version_mb=statistics.mean(list(sizes.values())[1:]) / 1e6,
        full_mb=sizes.get(0, 0) / 1e6,
        encode_s=args.encode_s,
        uplink_mbps=1e5,  # loopback: the transfer is part of the measured broadcast time
    )
    runs = [simulate(learner, classes, len(classes), len(measured_rows), seed) for seed in range(args.seeds)]
    predicted = statistics.mean(r.utilisation for r in runs)
    print(json.dumps({
        "run": str(args.run_dir), "fitted_on": str(fit), "in_sample": fit.resolve() == args.run_dir.resolve(),
        "t_train_s": round(t_train, 2), "bcast_s": round(statistics.mean(bcast), 2),
        "signal_share": round(learner.signal_share, 3),
        "workers_rollouts_per_s": [round(c.rollouts_per_s, 2) for c in classes],
        "measured_utilisation": measured["utilisation"],
        "predicted_utilisation": round(predicted, 3),
        "predicted_range": [round(min(r.utilisation for r in runs), 3), round(max(r.utilisation for r in runs), 3)],
        "relative_error": round(abs(predicted - measured["utilisation"]) / measured["utilisation"], 3),
        "measured_staleness": measured.get("staleness"), "predicted_staleness": runs[0].staleness,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
