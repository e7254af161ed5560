"""Run a Triton kernel script on CPU through Triton's interpreter, in a fresh interpreter
process (the interpreter mode is read when triton is first imported). The script first imports
`interpreter_speedup`, which skips the interpreter's redundant re-patching of the language
(what the kernels compute is unchanged; `FLARE_TEST_PLAIN_INTERPRETER=1` turns it off)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PRELUDE = (
    f"import sys; sys.path.insert(0, {str(HERE)!r}); import interpreter_speedup; del sys.path[0]\n"
)


def run_interpreted(script: str, timeout_s: float = 300) -> None:
    """Run `script`; it must print "ok" last. Skips where triton is not installed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
