"""Small helpers shared across layers (no JAX)."""

from __future__ import annotations


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): the padded size of a jitted dimension."""
    b = max(int(minimum), 1)
    while b < n:
        b *= 2
    return b
