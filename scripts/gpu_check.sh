#!/usr/bin/env bash
# What a GPU owner runs to see echo-rl work on a CUDA GPU, and the figures docs/benchmarks.md asks for.
#
#     ECHO_RL_GPU=cuda ./scripts/setup.sh && ./scripts/gpu_check.sh [OUT]      (OUT: runs/gpu-check)
#
# 1. a co-located SmolLM2 run on CUDA in bf16, 20 steps: the reward must rise
# 2. a swarm run: a CUDA learner and one worker whose llama.cpp offloads every layer to the GPU
# 3. a one-GPU torchrun run: the learner under FSDP2 (sharded over one rank, nccl) with that worker
# 4. figures: learner step time and peak memory (CPU fp32, CPU bf16, CUDA fp32, CUDA bf16) and worker
#    tokens/s (llama.cpp CPU, llama.cpp CUDA, transformers CPU, transformers CUDA)
# Everything it prints also lands in OUT/*.log and OUT/*.json. Exits non-zero at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-check}
PY=.venv/bin/python
ECHO="$PY -m echo_cli"
rm -rf "$OUT" && mkdir -p "$OUT"

say() { printf '\n== %s\n' "$*"; }
reward_rises() {  # mean reward of the last 5 steps above that of the first 5
    $PY - "$1" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
first, last = [r["reward_mean"] for r in rows[:5]], [r["reward_mean"] for r in rows[-5:]]
a, b = sum(first) / len(first), sum(last) / len(last)
print(f"reward: first 5 steps {a:.3f}, last 5 steps {b:.3f} ({len(rows)} steps)")
sys.exit(0 if b > a else 1)
PY
}
swarm_run() {  # swarm_run NAME LEARNER-COMMAND...: the learner plus one GPU worker, until the learner ends
    local name=$1; shift
    local run_dir="$OUT/$name"
    "$@" --config configs/demo.toml --run-dir "$run_dir" --steps 10 --device cuda --precision bf16 \
        > "$OUT/$name.log" 2>&1 &
    local learner=$!
    for _ in $(seq 600); do [ -s "$run_dir/learner.addr" ] && break; sleep 0.5; done
    [ -s "$run_dir/learner.addr" ] || { echo "learner of $name did not start: see $OUT/$name.log"; exit 1; }
    $ECHO worker join --learner "$(cat "$run_dir/learner.addr")" --work-dir "$OUT/$name-worker" \
        --identity "$OUT/worker.key" --gpu-layers -1 > "$OUT/$name-worker.log" 2>&1 &
    local worker=$!
    wait "$learner"
    kill "$worker" 2>/dev/null || true
    wait "$worker" 2>/dev/null || true
    grep -h "on cuda\|engine llamacpp on" "$OUT/$name-worker.log" | head -1
    $PY -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(len(r), 'steps; last:', \
        {k: r[-1][k] for k in ('reward_mean', 'utilisation', 'memory_gib')})" "$run_dir/metrics.jsonl"
}

say "the machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY - <<'PY'
import torch
from worker.engines.llamacpp import gpu_backend, llamacpp_backends
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name(0)}")
print(f"llama.cpp backends: {', '.join(llamacpp_backends())}; offload: {gpu_backend() or 'none'}")
assert torch.cuda.is_available(), "torch sees no GPU: install a CUDA build of torch"
assert gpu_backend(), "llama.cpp was built for the CPU: ECHO_RL_GPU=cuda ./scripts/setup.sh"
PY

say "1. co-located SmolLM2 on CUDA, bf16, 20 steps"
$ECHO learner start --colocated --config configs/demo.toml --run-dir "$OUT/colocated" --steps 20 \
    --device cuda --precision bf16 > "$OUT/colocated.log" 2>&1
reward_rises "$OUT/colocated/metrics.jsonl"

say "2. swarm: CUDA learner, one worker with llama.cpp on the GPU"
swarm_run swarm $ECHO learner start

say "3. torchrun, one GPU: the learner under FSDP2 on nccl, with the GPU worker"
swarm_run torchrun $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m echo_cli learner start

say "4a. learner step time and peak memory"
$PY scripts/bench_memory.py --steps 4 --out "$OUT/memory" --only colocated-fp32,colocated-bf16 \
    --extra=--device=cpu | tee "$OUT/memory-cpu.json"
$PY scripts/bench_memory.py --steps 4 --out "$OUT/memory" --only colocated-fp32,colocated-bf16 \
    --extra=--device=cuda | tee "$OUT/memory-cuda.json"

say "4b. worker tokens/s per engine"
$ECHO bench engines --threads "$(nproc)" --json | tee "$OUT/engines.json"
say "gpu_check: all passed ($OUT)"
