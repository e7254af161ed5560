"""Refuse a CUDA build of torch on a machine without an NVIDIA driver (used by setup.sh).

usage: python cpu_torch_check.py REPORT.json  (pip's `install --dry-run --report` output)
Exit 0 when the install would be a CPU build; 1, with a message naming what it would pull in,
when it would be a CUDA build (several GB of libraries this machine cannot use).
"""

from __future__ import annotations

import json
import sys


def cuda_packages(report: dict) -> list[str]:
    found = []
    for item in report.get("install", []):
        name = item["metadata"]["name"].lower()
        version = item["metadata"]["version"]
        if name.startswith("nvidia-") or (name == "torch" and "+cu" in version):
            found.append(f"{name} {version}")
    return found


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        found = cuda_packages(json.load(f))
    if not found:
        return 0
    print(
        "setup: this machine has no NVIDIA driver, but the package index offers a CUDA build"
        f" of torch here ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}).\n"
        "Point pip at an index or a wheel folder that holds the CPU build of torch 2.13.0\n"
        "(PIP_INDEX_URL, PIP_EXTRA_INDEX_URL or PIP_FIND_LINKS), or install it into .venv\n"
        "first, and run this command again. Nothing was installed.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
