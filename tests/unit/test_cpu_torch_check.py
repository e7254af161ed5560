"""setup.sh's guard against a CUDA torch build on a CPU-only machine, on pip's report format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_torch_check.py"


def _run(tmp_path: Path, installs: list[tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    report = {
        "version": "1",
        "install": [{"metadata": {"name": n, "version": v}} for n, v in installs],
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)


def test_cpu_build_passes(tmp_path: Path) -> None:
    r = _run(tmp_path, [("torch", "2.13.0+cpu"), ("sympy", "1.14.0"), ("filelock", "4.3.2")])
    assert r.returncode == 0 and not r.stderr


def test_cuda_build_is_refused_before_download(tmp_path: Path) -> None:
    r = _run(tmp_path, [("torch", "2.13.0"), ("nvidia-cublas-cu12", "12.9.1.4"),
                        ("nvidia-cudnn-cu12", "9.10.2.21")])  # fmt: skip
    assert (
        r.returncode == 1
        and "nvidia-cublas-cu12" in r.stderr
        and "Nothing was installed" in r.stderr
    )
    r = _run(tmp_path, [("torch", "2.13.0+cu130")])  # a local-version CUDA build alone
    assert r.returncode == 1 and "torch 2.13.0+cu130" in r.stderr
