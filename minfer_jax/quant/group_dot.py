"""One-token dot products per scale group, for the CUDA-core GEMV (pallas/gemv.py, nt = 1).

Every block format computes, per output row and per group of `group` weights,

    y += A_g * S_g + B_g * X_g,   S_g = sum_j q_j * x_j (raw quant integers),  X_g = sum_j x_j

(A = d or d*sc, B = the offset: -8d for Q4_0, m for Q4_1, -dmin*m for K-quants, ...). Written
this way the kernel never builds a dequantized [bn, bk] tile: quants stay in the plane's own
packing, viewed at a higher rank so that unpacking is broadcasting (shift by an iota on a new
axis) rather than reshaping. Under the Triton lowering a reshape is a layout conversion through
shared memory; a broadcast is free. A probe of this layout for Q4_0 streamed 880 GB/s where the
reshape-based decode reached 585 (docs/BENCHMARKS.md).

Views. A plane [Npad, K / wpc] is reshaped (free, in XLA, outside the kernel) to
[Npad, K / group, *per_group] ("grouped" planes) or, for fields coarser than a group (K-quant
super-block d/dmin), read with a gather index (g // groups_per_field) into [bn, G]. x [K] is
reshaped to [K / group, *x_view] and each format picks its slots with integer indices. Every
view keeps natural k order, so weight k of group g is x[g * group + k].

`quant.planes.decode` remains the single definition of the values; tests check that
A*S + B*X summed over groups equals x . decode(planes) for every format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from minfer_jax.quant.planes import QType

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    group: int  # weights per group (the finest scale granularity)
    views: tuple[tuple[str, tuple[int, ...]], ...]  # plane -> trailing shape per group
    coarse: tuple[tuple[str, int], ...]  # plane -> groups per plane column (gathered to [bn, G])
    x_view: tuple[int, ...]  # trailing shape of x per group
    x_slots: int  # > 0: x arrives split along its last axis into this many tensors (loaded apart:
    #               the Triton lowering cannot slice a loaded tensor)
    fn: Callable = dataclasses.field(compare=False)  # (tiles, xs: list of x tensors) -> (S, A, B), each [bn, G]


def _u(v):  # uint8/int8 -> int32 for shifts and arithmetic
    return v.astype(jnp.int32)


def _bits(v, shifts, mask):
    """v [..., n] ints, shifts [m] -> [..., n, m]: (v >> shift) & mask (broadcast, no reshape)."""
    return (v[..., None] >> shifts) & mask


def _iota(n, scale=1, offset=0):
    return jax.lax.iota(jnp.int32, n) * scale + offset


def _sum2(v):  # [bn, G, a, b] -> [bn, G]
    return jnp.sum(jnp.sum(v, axis=-1), axis=-1)


def _q8_0(t, xs):
    # q [bn, G, 32]; x [G, 32]
    s = jnp.sum(t["q"].astype(F32) * xs[0][None], axis=-1)
    d = t["d"].astype(F32)
    return s, d, jnp.zeros_like(d)


def _nibble_dot(qs, xs, hi_lo=None, hi_hi=None):
    """qs [bn, G, a, b] bytes (byte = weights 2i, 2i+1); xs = (x_even, x_odd) [G, a, b]. Optional 5th bits."""
    b = _u(qs)
    lo, hi = (b & 15).astype(F32), (b >> 4).astype(F32)
    if hi_lo is not None:
        lo, hi = lo + 16.0 * hi_lo.astype(F32), hi + 16.0 * hi_hi.astype(F32)
    return _sum2(lo * xs[0][None] + hi * xs[1][None])


def _q4(t, xs):
    return _nibble_dot(t["qs"], xs)


def _q5_bits(t):
    # qh [bn, G, 4]: byte a holds the 5th bits of weights 8a .. 8a+7; weight 2(4a+b)+c -> bit 2b+c
    h = _u(t["qh"])
    return _bits(h, _iota(4, 2), 1), _bits(h, _iota(4, 2, 1), 1)  # [bn, G, 4, 4] each


def _q4_0(t, xs):
    d = t["d"].astype(F32)
    return _q4(t, xs), d, -8.0 * d


def _q4_1(t, xs):
    return _q4(t, xs), t["d"].astype(F32), t["m"].astype(F32)


def _q5_0(t, xs):
    d = t["d"].astype(F32)
    return _nibble_dot(t["qs"], xs, *_q5_bits(t)), d, -16.0 * d


def _q5_1(t, xs):
    return _nibble_dot(t["qs"], xs, *_q5_bits(t)), t["d"].astype(F32), t["m"].astype(F32)


def _kquant_affine(t):
    return t["d"].astype(F32) * _u(t["sc"]).astype(F32), -(t["dmin"].astype(F32) * _u(t["m"]).astype(F32))


def _q4_k(t, xs):
    a, b = _kquant_affine(t)
    return _q4(t, xs), a, b


def _q5_k(t, xs):
    a, b = _kquant_affine(t)
    return _nibble_dot(t["qs"], xs, *_q5_bits(t)), a, b


def _q6_k(t, xs):
    # group 16: ql [bn, G, 4, 2] (byte 2a+b = weights 4a+2b+c, nibble c); qh [bn, G, 4] (byte a =
    # weights 4a+j at bits 2j, so weight 4a+2b+c at shift 4b+2c); x [G, 4, 2, 2] (a, b, c)
    ql, qh = _u(t["ql"]), _u(t["qh"])
    s = 0.0
    for c in range(2):
        q = ((ql >> (4 * c)) & 15) + 16 * _bits(qh, _iota(2, 4, 2 * c), 3)  # [bn, G, 4, 2]
        s = s + _sum2(q.astype(F32) * xs[c][None])
    a = t["d"].astype(F32) * t["sc"].astype(F32)
    return s, a, -32.0 * a


def _q3_k(t, xs):
    # group 16: qs [bn, G, 2, 2] (byte 2e+f = weights 8e+4f+j at bits 2j); qh [bn, G, 2] (byte e =
    # high bits of weights 8e..8e+7, weight 8e+4f+j at bit 4f+j); x [G, 2, 2, 4] (e, f, j)
    q2 = _bits(_u(t["qs"]), _iota(4, 2), 3)  # [bn, G, 2, 2, 4]
    h = (_u(t["qh"])[..., None, None] >> (_iota(2, 4)[:, None] + _iota(4)[None, :])) & 1  # [bn, G, 2, 2, 4]
    q = (q2 + 4 * h).astype(F32)
    s = jnp.sum(_sum2(q * xs[0][None]), axis=-1)
    a = t["d"].astype(F32) * t["sc"].astype(F32)
    return s, a, -4.0 * a


def _q2_k(t, xs):
    # group 16: qs [bn, G, 4] (byte a = weights 4a+j at bits 2j); x [G, 4, 4]; sc byte: scale | min << 4
    q = _bits(_u(t["qs"]), _iota(4, 2), 3).astype(F32)  # [bn, G, 4, 4]
    s = _sum2(q * xs[0][None])
    sc = _u(t["sc"])
    return s, t["d"].astype(F32) * (sc & 15).astype(F32), -(t["dmin"].astype(F32) * (sc >> 4).astype(F32))


SPECS: dict[QType, GroupSpec] = {
    QType.Q8_0: GroupSpec(32, (("q", (32,)), ("d", ())), (), (32,), 0, _q8_0),
    QType.Q4_0: GroupSpec(32, (("qs", (4, 4)), ("d", ())), (), (4, 4, 2), 2, _q4_0),
    QType.Q4_1: GroupSpec(32, (("qs", (4, 4)), ("d", ()), ("m", ())), (), (4, 4, 2), 2, _q4_1),
    QType.Q5_0: GroupSpec(32, (("qs", (4, 4)), ("qh", (4,)), ("d", ())), (), (4, 4, 2), 2, _q5_0),
    QType.Q5_1: GroupSpec(32, (("qs", (4, 4)), ("qh", (4,)), ("d", ()), ("m", ())), (), (4, 4, 2), 2, _q5_1),
    QType.Q4_K: GroupSpec(32, (("qs", (4, 4)), ("sc", ()), ("m", ())), (("d", 8), ("dmin", 8)), (4, 4, 2), 2, _q4_k),
    QType.Q5_K: GroupSpec(32, (("qs", (4, 4)), ("qh", (4,)), ("sc", ()), ("m", ())), (("d", 8), ("dmin", 8)),
                          (4, 4, 2), 2, _q5_k),
    QType.Q6_K: GroupSpec(16, (("ql", (4, 2)), ("qh", (4,)), ("sc", ())), (("d", 16),), (4, 2, 2), 2, _q6_k),
    QType.Q3_K: GroupSpec(16, (("qs", (2, 2)), ("qh", (2,)), ("sc", ())), (("d", 16),), (2, 2, 4), 0, _q3_k),
    QType.Q2_K: GroupSpec(16, (("qs", (4,)), ("sc", ())), (("d", 16), ("dmin", 16)), (4, 4), 0, _q2_k),
}


def grouped_planes(qtype: QType, planes) -> dict[str, jax.Array]:
    """Planes reshaped to [Npad, K / group, *per_group] (coarse planes unchanged)."""
    spec = SPECS[qtype]
    out = {}
    for name, tail in spec.views:
        p = planes[name]
        out[name] = p.reshape(p.shape[0], -1, *tail) if tail else p
    for name, _ in spec.coarse:
        out[name] = planes[name]
    return out


def grouped_x(qtype: QType, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [K] -> (x viewed [K / group, *x_view] f32, per-group sums [K / group] f32)."""
    spec = SPECS[qtype]
    xg = x.astype(F32).reshape(-1, spec.group)
    return xg.reshape(-1, *spec.x_view), jnp.sum(xg, axis=1)


def group_dot_reference(qtype: QType, planes, x: jax.Array) -> jax.Array:
    """y [Npad] = sum over groups of A*S + B*X on whole arrays (what the kernel computes per tile)."""
    spec = SPECS[qtype]
    gp = grouped_planes(qtype, planes)
    xv, xs = grouped_x(qtype, x)
    n_groups = xs.shape[0]
    tiles = {name: gp[name] for name, _ in spec.views}
    for name, per in spec.coarse:
        tiles[name] = jnp.repeat(gp[name], per, axis=1)[:, :n_groups]
    s, a, b = spec.fn(tiles, split_x(spec, xv))
    return jnp.sum(a * s + b * xs[None, :], axis=1)


def split_x(spec: GroupSpec, xv: jax.Array) -> list[jax.Array]:
    """Whole-array version of the kernel's per-slot x loads."""
    return [xv[..., c] for c in range(spec.x_slots)] if spec.x_slots else [xv]
