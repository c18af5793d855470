"""Decode residual add + RMSNorm in one launch per row batch (XLA runs it as a reduction and a
multiply, and recomputes the add inside both).

h = x + the sum of a matmul's split-K partials (gemv.gemv_int8's `partials=True` output; none:
h = x), normed = h * rsqrt(mean(h^2) + eps) * weight. Grid (B,): program b keeps its row in
registers in chunks of a power of two (the Triton tiles) and sums them in one order whatever
the batch (batch invariance).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles

__all__ = ["add_rms_norm", "add_rms_norm_reference"]

MAX_CHUNK = 1024  # values per load: a power of two dividing d


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(
    x: jax.Array,
    parts: tuple[jax.Array, ...],
    weight: jax.Array,
    *,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """x [B, d] f32, parts: [S_i, R_i >= B, Np_i >= d] f32 each (rows [0, B) and columns [0, d)
    of their S_i slices add up to what is added to x), weight [d] -> (h, normed), both [B, d]
    f32."""
    batch, d = x.shape
    chunk = tiles.pow2_divisor(d, MAX_CHUNK)
    splits = tuple(p.shape[0] for p in parts)
    tiles.silence_triton_deprecation()

    def kernel(x_ref, *refs):
        part_refs, (w_ref, h_ref, n_ref) = refs[: len(parts)], refs[len(parts) :]
        b = pl.program_id(0)
        rows, sq = [], jnp.float32(0.0)
        for c in range(d // chunk):
            at = pl.ds(c * chunk, chunk)
            v = x_ref[b, at]
            for ref, n in zip(part_refs, splits):
                for s in range(n):  # left to right
                    v = v + ref[s, b, at]
            rows.append(v)
            sq = sq + jnp.sum(v * v)
        r = lax.rsqrt(sq / d + eps)
        for c, v in enumerate(rows):
            at = pl.ds(c * chunk, chunk)
            h_ref[b, at] = v
            n_ref[b, at] = v * r * w_ref[at]

    whole = lambda a: pl.BlockSpec(a.shape, lambda b: (0,) * a.ndim)  # noqa: E731
    operands = (x.astype(jnp.float32), *parts, weight.astype(jnp.float32))
    out = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=[out, out],
        grid=(batch,),
        in_specs=[whole(a) for a in operands],
        out_specs=[whole(out), whole(out)],
        compiler_params=tiles.compiler_params(4, 1),
        interpret=interpret,
        name="add_rms_norm",
    )(*operands)


def add_rms_norm_reference(x, parts, weight, *, eps):
    """add_rms_norm's math in plain jnp (ops.rms_norm after the partials are added)."""
    batch, d = x.shape
    h = x.astype(jnp.float32)
    for p in parts:
        h = h + tiles.sum_splits(p, 0, ordered=True)[:batch, :d]
    normed = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps) * weight
    return h, normed
