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
# Without a GPU, Triton serves only the tests (its interpreter, and its compiler front end lowering
# every kernel for SM90): they get the oldest Triton Flare supports (torch 2.11's), since a newer
# one accepts kernel code that the older fails to compile on the GPU.
CPU_TRITON=3.6.0
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
    $PIP install -q --dry-run --ignore-installed --report "$report" "torch==2.13.0" "triton==$CPU_TRITON"
    .venv/bin/python scripts/cpu_torch_check.py "$report"
    $PIP install -q "torch==2.13.0" "triton==$CPU_TRITON"
  fi
fi
$PIP install -q -e ".[dev]"
if [ "$gpu" = 0 ] && ! .venv/bin/python -c "import sys, triton; sys.exit(triton.__version__ != '$CPU_TRITON')" 2>/dev/null; then
  $PIP install -q "triton==$CPU_TRITON"
fi
