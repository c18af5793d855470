"""Integer size arithmetic shared by the plan, the kernels and the weight layouts (no jax)."""

from __future__ import annotations


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest floor * 2**k >= n (floor a power of two: the smallest power of two >= n, >= floor)."""
    b = floor
    while b < n:
        b *= 2
    return b


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m
