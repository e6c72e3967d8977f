#!/usr/bin/env bash
# A GPU check for a machine with CUDA torch but no package registry and little that travels to it (the
# `device` tool's machines): the tool warm start on cuda, the tiny model co-located on cuda (bf16, fp32) and
# on the CPU, and #33's serve paths on cuda (scripts/gpu_serve_check.py). echo-rl's other Python deps travel
# as wheels in .gpuwheels/ (ignored by git; pass it in the device tool's carry):
#     pip download -d .gpuwheels --python-version 3.12 --only-binary=:all: --no-deps \
#         zstandard gguf sniffio tinker==0.38.0 pyqwest httpx2 httpcore2 h2 hpack hyperframe orjson pydantic \
#         pydantic-core annotated-types typing-inspection distro truststore opentelemetry-api annotated-doc \
#         transformers==5.24.0
# Run there as `bash scripts/gpu_check_tiny.sh` with OUT set; the full check is scripts/gpu_check.sh.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
B=/opt/torch/.venv/bin/python3; ls -la $B || B=$(ls /opt/*/.venv/bin/python3 | head -1)
$B -m pip install -q --no-index --no-deps --target /tmp/extra .gpuwheels/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/extra; P=$B
$P -c "import torch, transformers, tinker, zstandard; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
echo "== warm start (scripts/warm_start_tools.py) on cuda"
timeout 120 $P scripts/warm_start_tools.py --model tiny --device cuda --out $OUT/warm --episodes 8 --batch 4 --lr 3e-3 \
  --max-new-tokens 128 --max-episode-tokens 512 2>&1 | grep -E "loss|out|rror" | tail -4
for spec in "cuda bf16" "cuda fp32" "cpu fp32"; do set -- $spec
  timeout 150 $P -m echo_cli learner start --colocated --model tiny --engine transformers --steps 8 --device $1 --precision $2 --run-dir $OUT/colo-$1-$2 > $OUT/colo-$1-$2.log 2>&1
  echo "== colocated $1 $2 rc=$?"; grep -E "training on|step [0-9]+/8|Error|error" $OUT/colo-$1-$2.log | tail -4
done
echo "== serve paths on cuda"; timeout 150 $P scripts/gpu_serve_check.py 2>&1 | grep -v Warning | tail -12
