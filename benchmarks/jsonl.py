"""Benchmark records as JSON lines (BENCHMARKS.md): one object per line, appended to --out."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def append(path: Path | None, records: Iterable[dict]) -> None:
    """Append `records` to `path`, one JSON object per line (nothing when path is None)."""
    if path is None:
        return
    with path.open("a") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
