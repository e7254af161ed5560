"""Byte-size constants and formatting shared by the memory modules. Pure."""

from __future__ import annotations

from typing import Final

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30


def gib(num_bytes: int) -> str:
    """`num_bytes` in GiB with two decimals, the unit the startup table is read in."""
    return f"{num_bytes / GIB:.2f}"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
