"""Seeds for a request's later lives. A preempted request is recomputed with a fresh RNG stream."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser: a bijective 64-bit mix with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, generated_count: int) -> int:
    """The seed a request continues with after `generated_count` tokens, in [0, 2**63).

    Deterministic in both arguments; the result fits a signed 64-bit device tensor. Negative or
    oversized `seed`s are taken modulo 2**64.
    """
    if generated_count < 0:
        raise ValueError(f"generated_count must be non-negative, got {generated_count}")
    return _splitmix64((seed & _MASK64) ^ _splitmix64(generated_count)) >> 1
