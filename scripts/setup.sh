#!/usr/bin/env bash
# Set up .venv with nexttoken and the torch build that fits this machine, then the given extras (e.g. "test").
# A bare `pip install torch` pulls several GB of CUDA libraries; on a machine without an NVIDIA GPU we take
# the CPU build instead: a local wheel when pip's find-links has one, else PyTorch's CPU package index.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
TORCH_SPEC="${NEXTTOKEN_TORCH:-torch==2.13.0}"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of $TORCH_SPEC"
    pip install "$TORCH_SPEC"
  elif pip download -q --no-deps --no-index "$TORCH_SPEC" -d "$(mktemp -d)" >/dev/null 2>&1; then
    echo "setup: no GPU: installing the local CPU wheel of $TORCH_SPEC"
    pip install "$TORCH_SPEC"
  else
    echo "setup: no GPU: installing $TORCH_SPEC from PyTorch's CPU index"
    pip install "$TORCH_SPEC" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  fi
fi
if [ -n "$extras" ]; then target=".[$extras]"; else target="."; fi
# The test extra drives a real headless browser (the explain page of traces): Debian's chromium, installed once
# when it is missing and this is root with apt-get; elsewhere those tests say what to install.
if [[ ",$extras," == *",test,"* ]] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  echo "setup: installing Debian's chromium (for the explain-page tests)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null || echo "setup: chromium could not be installed; the browser tests will fail until it is"
fi
pip install -q -e "$target"
# The tests convert tiny checkpoints with llama.cpp's own converter (the reference GGUF writer).
if [[ ",$extras," == *",test,"* ]]; then bash scripts/llama_cpp_converter.sh; fi
# Build the native decode kernels now (nexttoken/csrc/*.cpp, ~2 s); without a compiler nexttoken falls back to torch.
.venv/bin/python -c "from nexttoken.model import kernels; print('setup: native kernel', 'built' if kernels.available() else 'unavailable (torch fallback)')" || true
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
