"""Run a Triton kernel script on CPU through Triton's interpreter, in a fresh interpreter
process (the interpreter mode is read when triton is first imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, timeout_s: float = 300) -> None:
    """Run `script`; it must print "ok" last. Skips where triton is not installed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
