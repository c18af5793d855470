"""Bench input: the error for bad flags and the parsers of flag values (llama-bench's syntax)."""

from __future__ import annotations

import re
from typing import Any

from minfer_jax.errors import MinferError


class BenchError(MinferError, ValueError):
    """Bad benchmark input (flags, shapes, sizes): reported as one line, exit status 2."""


_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?(?:,|$)")


def parse_int_range(s: str, what: str = "value") -> list[int]:
    """llama-bench's parse_int_range: comma list of first[-last[(+|*)step]], e.g. '128,512' or
    '16-2048*2'."""
    out: list[int] = []
    rest = str(s).strip()
    if not rest:
        raise BenchError(f"{what}: empty list")
    while rest:
        m = _RANGE_RE.match(rest)
        if not m:
            raise BenchError(
                f"{what}: cannot parse {s!r} (expected e.g. 512 or 128,512 or 16-2048*2)"
            )
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op = m.group(3) or "+"
        step = int(m.group(4)) if m.group(4) is not None else 1
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(
                    f"{what}: invalid range {m.group(0).rstrip(',')!r} (it does not advance)"
                )
            i = nxt
        rest = rest[m.end() :]
    return out


def parse_pg(s: str) -> tuple[int, int]:
    """-pg 'N,M' (llama-bench: exactly two integers)."""
    parts = str(s).split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise BenchError(f"-pg: expected '<prompt>,<gen>' such as 512,128, got {s!r}")
    return int(parts[0]), int(parts[1])


def _qtype(name: str):
    from minfer_jax.quant.planes import FORMATS, QType

    key = name.strip().upper()
    try:
        qt = QType[key]
    except KeyError:
        raise BenchError(
            f"unknown weight type {name!r}; supported: {', '.join(q.name.lower() for q in FORMATS)}"
        ) from None
    if qt not in FORMATS:
        raise BenchError(
            f"weight type {qt.name} has no device layout; supported: "
            f"{', '.join(q.name.lower() for q in FORMATS)}"
        )
    return qt


def parse_shapes(s: str) -> list[tuple[Any, int, int]]:
    """'q4_k:4096x14336,q8_0:4096x14336' (type:OUTxIN) -> [(QType, out, in), ...]."""
    from minfer_jax.quant.planes import get_format

    out = []
    for item in str(s).split(","):
        item = item.strip()
        m = re.fullmatch(r"([A-Za-z0-9_]+):(\d+)[xX](\d+)", item)
        if not m:
            raise BenchError(
                f"--shapes: cannot parse {item!r} (expected TYPE:OUTxIN such as q4_k:4096x14336)"
            )
        qt, n, k = _qtype(m.group(1)), int(m.group(2)), int(m.group(3))
        block = get_format(qt).block
        if n <= 0 or k <= 0:
            raise BenchError(f"--shapes: {item!r}: sizes must be positive")
        if k % block:
            raise BenchError(
                f"--shapes: {item!r}: in={k} is not a multiple of {qt.name}'s block of {block}"
            )
        out.append((qt, n, k))
    return out
