"""Decode epilogues of split-K GEMV partials (gemv's `partials=True` output), each one launch where
XLA runs two or three (a reduce over the splits, then the elementwise ops, then the next norm's
reduce):

- `add_partials`: the residual add after the o and down projections, h = x + sum of the
  partials, with h's sums of squares in pieces for the next RMSNorm (the GEMV that reads the
  norm's output takes them: gemv.gemv_int8(row_sumsq=), and computes the rsqrt itself);
- `glu_partials`: the gated FFN's activation act(gate) * up from the gate / up projections'
  partials, the down projection's input.

Grid (rows, column blocks of COLS): many small programs, all their loads in flight at once.
Each sum runs left to right over the splits, and each row is one program's, so a row's result
does not depend on the other rows of the batch (batch invariance). An already summed product
(a GEMM's, or a deterministic GEMV's row chunks) is one "split".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.sizes import pow2_at_least

__all__ = [
    "ACTIVATIONS",
    "add_partials",
    "add_partials_reference",
    "glu_partials",
    "glu_partials_reference",
]

COLS = 128  # columns per program (at most; a power of two dividing the width)


def _silu(v):
    return v / (1.0 + jnp.exp(-v))


def _gelu_tanh(v):  # ggml_gelu / jax.nn.gelu(approximate=True)
    return 0.5 * v * (1.0 + jnp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}  # the gated FFNs' (Qwen2 / Llama, Gemma 3)


def _cols(width: int) -> int:
    return tiles.pow2_divisor(width, COLS)


def _summed(ref, splits: int, b, start, cols: int):
    """[cols] f32: part ref's rows b, columns [start, start + cols), its splits added in order."""
    v = ref[0, b, pl.ds(start, cols)]
    for s in range(1, splits):  # left to right: the same order at every batch size
        v = v + ref[s, b, pl.ds(start, cols)]
    return v


@functools.partial(jax.jit, static_argnames=("interpret",))
def add_partials(
    x: jax.Array, parts: jax.Array, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """x [B, D] f32 (the residual stream), parts [S, R >= B, Np >= D] f32 (a projection's split-K
    partials) -> (h [B, D] f32 = x + the partials' sum over S in columns [0, D),
    sumsq [B, P] f32: h's sum of squares in P (a power of two) pieces, zeros past the
    D / cols column blocks; their sum left to right is each row's sum of squares)."""
    batch, width = x.shape
    splits = parts.shape[0]
    cols = _cols(width)
    blocks = width // cols
    pieces = pow2_at_least(blocks)
    tiles.silence_triton_deprecation()

    def kernel(x_ref, part_ref, h_ref, sumsq_ref):
        b, c = pl.program_id(0), pl.program_id(1)

        @pl.when(c < blocks)
        def _():
            start = pl.multiple_of(c * cols, cols)
            h = x_ref[b, pl.ds(start, cols)] + _summed(part_ref, splits, b, start, cols)
            h_ref[b, pl.ds(start, cols)] = h
            sumsq_ref[...] = jnp.sum(h * h)

        @pl.when(c >= blocks)
        def _():
            sumsq_ref[...] = jnp.float32(0.0)

    whole = lambda a: pl.BlockSpec(a.shape, lambda b, c: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((batch, width), jnp.float32),
            jax.ShapeDtypeStruct((batch, pieces), jnp.float32),
        ],
        grid=(batch, pieces),
        in_specs=[whole(x), whole(parts)],
        out_specs=[
            pl.BlockSpec((batch, width), lambda b, c: (0, 0)),
            pl.BlockSpec((None, None), lambda b, c: (b, c)),
        ],
        compiler_params=tiles.compiler_params(1, 1),
        interpret=interpret,
        name="add_partials",
    )(x.astype(jnp.float32), parts)


def add_partials_reference(x: jax.Array, parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """add_partials' math in plain jnp (the same column blocks, sums in the same order)."""
    batch, width = x.shape
    cols = _cols(width)
    h = x.astype(jnp.float32) + tiles.sum_splits(parts, 0, ordered=True)[:batch, :width]
    sumsq = jnp.sum((h * h).reshape(batch, width // cols, cols), axis=-1)
    pieces = pow2_at_least(width // cols)
    return h, jnp.pad(sumsq, ((0, 0), (0, pieces - width // cols)))


@functools.partial(jax.jit, static_argnames=("widths", "d_ff", "act", "batch", "interpret"))
def glu_partials(
    parts: tuple[jax.Array, ...],
    *,
    widths: tuple[int, ...],
    d_ff: int,
    act: str,
    batch: int,
    interpret: bool = False,
) -> jax.Array:
    """parts: [S_i, R_i >= batch, Np_i >= widths[i]] f32 each, the first widths[i] columns of part
    i (concatenated) a row's gate | up (d_ff columns each) -> act(gate) * up [batch, d_ff] f32,
    act one of ACTIVATIONS."""
    if sum(widths) != 2 * d_ff:
        raise ValueError(f"gate / up parts are {sum(widths)} columns wide, expected {2 * d_ff}")
    gate_at, up_at = tiles.locate_region(widths, 0, d_ff), tiles.locate_region(widths, d_ff, d_ff)
    splits = tuple(p.shape[0] for p in parts)
    cols = _cols(d_ff)
    fn = ACTIVATIONS[act]
    tiles.silence_triton_deprecation()

    def kernel(*refs):
        part_refs, out_ref = refs[:-1], refs[-1]
        b, c = pl.program_id(0), pl.program_id(1)
        start = pl.multiple_of(c * cols, cols)

        def region(at):
            i, offset = at
            return _summed(part_refs[i], splits[i], b, pl.multiple_of(offset + start, cols), cols)

        out_ref[...] = fn(region(gate_at)) * region(up_at)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, d_ff), jnp.float32),
        grid=(batch, d_ff // cols),
        in_specs=[pl.BlockSpec(p.shape, lambda b, c, n=p.ndim: (0,) * n) for p in parts],
        out_specs=pl.BlockSpec((None, cols), lambda b, c: (b, c)),
        compiler_params=tiles.compiler_params(1, 1),
        interpret=interpret,
        name="glu_partials",
    )(*parts)


def glu_partials_reference(
    parts: tuple[jax.Array, ...], *, widths: tuple[int, ...], d_ff: int, act: str, batch: int
) -> jax.Array:
    """glu_partials' math in plain jnp."""
    sums = [tiles.sum_splits(p, 0, ordered=True)[:batch, :w] for p, w in zip(parts, widths)]
    both = jnp.concatenate(sums, axis=-1)
    return ACTIVATIONS[act](both[:, :d_ff]) * both[:, d_ff:]
