"""What the GEMV and GEMM kernels share: loading a weight tile from its planes and decoding it.

A weight tile is rows [r0, r0 + bn) x weights [k0, k0 + bk). For a plane with `wpc` weights per
column that is the rectangle plane[r0 : r0 + bn, k0 / wpc : (k0 + bk) / wpc] (one column when the
plane's group is wider than the tile); each is one load
with a single indexer (the Triton lowering allows no chained `.at[]`), of a power-of-two shape
because bn, bk and every wpc are powers of two. The arithmetic is quant.planes.decode, the same
function the reference path runs on whole arrays.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.quant.planes import Format, QType, decode, get_format, tile_cols


def load_plane_tiles(fmt: Format, plane_refs, r0, bn: int, k0, bk: int) -> dict[str, jax.Array]:
    """The plane rectangles covering rows [r0, r0+bn) x weights [k0, k0+bk)."""
    tiles = {}
    for plane, ref in zip(fmt.planes, plane_refs):
        cols = tile_cols(bk, plane.wpc)
        start = k0 // plane.wpc if isinstance(k0, int) else pl.multiple_of(k0 // plane.wpc, cols)
        tiles[plane.name] = ref[pl.ds(r0, bn), pl.ds(start, cols)]
    return tiles


def load_weight_tile(
    fmt: Format, plane_refs, r0, bn: int, k0, bk: int, dtype, magic_half: bool = False
) -> jax.Array:
    """Decode rows [r0, r0+bn) x weights [k0, k0+bk) of a weight into values [bn, bk] of dtype."""
    return decode(
        fmt.qtype, load_plane_tiles(fmt, plane_refs, r0, bn, k0, bk), dtype, magic_half=magic_half
    )


def k_steps(n_steps: int, step, init):
    """Run step(j, carry) for j = 0 .. n_steps-1 inside a kernel. One step is called with the
    Python int 0, so its offsets stay static (no loop, no pl.multiple_of hints needed)."""
    return step(0, init) if n_steps == 1 else lax.fori_loop(0, n_steps, step, init)


def plane_arrays(fmt: Format, planes) -> list[jax.Array]:
    """Planes in the format's declared order (the order kernels receive their refs in)."""
    return [planes[p.name] for p in fmt.planes]


def nearest_split(chunks: int, programs: int, target: int) -> int:
    """The divisor d of chunks whose program count programs * d lands nearest target (in ratio;
    ties to the smaller d): a prime chunk count may overshoot rather than leave the GPU idle."""
    divisors = [d for d in range(1, chunks + 1) if chunks % d == 0]
    return min(divisors, key=lambda d: (abs(math.log(programs * d / target)), d))


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


@functools.cache
def silence_triton_deprecation() -> None:
    """jax >= 0.11 warns on every Triton-backend lowering; we choose that backend knowingly.

    Mosaic GPU variants can replace kernels one at a time behind ops.py (docs/ARCHITECTURE.md).
    Called once, from the kernel wrappers, never at import time.
    """
    warnings.filterwarnings(
        "ignore", message=r".*[Tt]riton.*deprecat.*", category=DeprecationWarning
    )
    warnings.filterwarnings(
        "ignore", message=r".*deprecat.*[Tt]riton.*", category=DeprecationWarning
    )


def compiler_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def sum_splits(x: jax.Array, axis: int, ordered: bool) -> jax.Array:
    """Split partials summed over `axis`; ordered: added left to right as one elementwise chain,
    since a reduce may order its sums by the other axes' sizes (batch invariance)."""
    if not ordered:
        return jnp.sum(x, axis=axis)
    parts = [jnp.take(x, s, axis=axis) for s in range(x.shape[axis])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def cast_rows(x: jax.Array, rows: int, dtype) -> jax.Array:
    """x [n, K] -> [rows, K] in dtype, zero rows appended (XLA fuses this into x's producer)."""
    x = x.astype(dtype)
    if x.shape[0] == rows:
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def dequant_matmul_reference(x: jax.Array, planes, *, qtype: QType, n_out: int) -> jax.Array:
    """x [M, K] . W^T -> [M, n_out] f32 in plain jnp: whole-matrix decode in the kernels' compute
    dtype and f32 accumulation, i.e. the kernels' math without their tiling."""
    fmt = get_format(qtype)
    w = decode(qtype, planes, fmt.compute_dtype)[:n_out]  # [N, K]
    return jnp.dot(x.astype(fmt.compute_dtype), w.T, preferred_element_type=jnp.float32)


def locate_region(widths: tuple[int, ...], column: int, width: int) -> tuple[int, int]:
    """(part index, column inside it) of the region [column, column + width) of parts of these
    widths laid side by side (a projection's outputs concatenated); it must lie inside one part
    (ValueError)."""
    start = 0
    for i, w in enumerate(widths):
        if start <= column and column + width <= start + w:
            return i, column - start
        start += w
    raise ValueError(f"columns [{column}, {column + width}) cross a part boundary of {widths}")
