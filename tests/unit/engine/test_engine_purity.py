"""House rule 1: the engine is pure CPU; importing it must not load torch or numpy."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CODE = """
import pkgutil, sys
import flared.engine.scheduler
import flared.engine
for info in pkgutil.iter_modules(flared.engine.__path__, "flared.engine."):
    __import__(info.name)
assert "torch" not in sys.modules, "torch was imported"
assert "numpy" not in sys.modules, "numpy was imported"
"""


def test_engine_imports_neither_torch_nor_numpy() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
