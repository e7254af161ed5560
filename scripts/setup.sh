#!/usr/bin/env bash
# Create .venv and install Flare with its development tools.
# On a machine without an NVIDIA driver the CPU build of torch is installed first, so nothing
# later in the install can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ "$gpu" = 1 ]; then
    $PIP install -q torch
  else
    # ask the index what it would install before downloading anything: where it offers only
    # CUDA builds (torch's own "+cu" version, or nvidia-* runtime packages), stop and say so
    report=$(mktemp)
    trap 'rm -f "$report"' EXIT
    $PIP install -q --dry-run --ignore-installed --report "$report" "torch==2.13.0"
    .venv/bin/python scripts/cpu_torch_check.py "$report"
    $PIP install -q "torch==2.13.0"
  fi
fi
$PIP install -q -e ".[dev]"
# Without a GPU, Triton serves only the tests: its interpreter runs the kernels, and its compiler
# front end lowers every kernel for SM90, also under the oldest Triton Flare supports (torch 2.11's,
# kept apart in .venv/triton-oldest), since a newer front end accepts kernel code that the older
# fails to compile on the GPU. (That Triton's interpreter does not run under NumPy 2.)
OLDEST_TRITON=3.6.0
if [ "$gpu" = 0 ] && [ ! -d ".venv/triton-oldest/triton-$OLDEST_TRITON.dist-info" ]; then
  rm -rf .venv/triton-oldest
  $PIP install -q --no-deps --target .venv/triton-oldest "triton==$OLDEST_TRITON"
fi
