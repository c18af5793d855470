"""Integer size arithmetic shared by the plan, the kernels and the weight layouts (no jax)."""

from __future__ import annotations

import logging
import os


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest floor * 2**k >= n (floor a power of two: the smallest power of two >= n, >=
    floor)."""
    b = floor
    while b < n:
        b *= 2
    return b


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def gib_from_env(name: str, default_gib: float) -> int:
    """A size bound in bytes from the environment variable `name` (GiB, e.g. "4" or "0.5"; unset:
    default_gib; not a number: default_gib, with a warning); never negative."""
    raw = os.environ.get(name, "")
    try:
        gib = float(raw) if raw else default_gib
    except ValueError:
        logging.getLogger("minfer_jax").warning(
            "%s=%r is not a number; using %s", name, raw, default_gib
        )
        gib = default_gib
    return max(int(gib * 2**30), 0)
