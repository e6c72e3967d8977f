#!/usr/bin/env bash
# Set up everything (idempotent), then train SmolLM2-135M-Instruct with GRPO on arithmetic as a real
# local swarm: a learner and 2 rollout workers as separate processes on 127.0.0.1 (libp2p, signed
# weight deltas, peer-assisted broadcast, async push-pull with staleness 2). Shows the swarm while it
# trains and, at the end, how the reward moved (`echo-rl report`: a table and PNG plots).
# Extra arguments go to `echo-rl learner start` (e.g. --steps 20, or --sync-mode pull).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
echo "demo: a learner and 2 workers on this machine, run dir $RUN_DIR (40 steps: ~17 min on 2 CPU cores)"
.venv/bin/python scripts/local_swarm.py --workers 2 --worker-threads 1 --status-every 120 -- \
    --config configs/demo.toml --run-dir "$RUN_DIR" "$@"
# how the run went: a summary table, and plots in $RUN_DIR/report/
.venv/bin/echo-rl report "$RUN_DIR"
