#!/usr/bin/env bash
# Set up everything (idempotent), then train SmolLM2-135M-Instruct with GRPO on arithmetic on this
# machine's CPU, and show how the reward moved. Extra arguments go to `echo-rl learner start`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
echo "demo: training in $RUN_DIR (co-located learner and llama.cpp sampler; ~10 min on 2 cores)"
.venv/bin/echo-rl learner start --colocated --config configs/demo.toml --run-dir "$RUN_DIR" "$@"
.venv/bin/python scripts/reward_summary.py "$RUN_DIR" 10
