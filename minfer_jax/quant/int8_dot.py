"""The CPU's matmul of an `Int8Weight` (route "int8", ops.matmul): one row decodes the int8
weights inside XLA's dot; more rows read the dense f32 copy where the weight keeps one.

XLA's CPU backend fuses a producer into a dot only for a matrix-vector product whose vector is
under 16 KiB (kFusionThresholdBytes, xla/service/cpu/cpu_instruction_fusion.cc); then the
decode q * a (+ b) runs inside the dot's loop and the int8 bytes stream instead of f32 values
(the 0.5B's gate+up 0.22 vs 0.46 ms, both cores). A wider x (the 0.5B's ffn_down, K = 4864:
19 KiB) would write every f32 value out first (5.8 ms against 0.76 for f32), so the weight is
stored in K slices of under 16 KiB each (`chunks_for`), one fused dot per slice, their partials
concatenated and summed (an add of two dots fuses one of them as the add's output fusion,
which unfuses its decode: 5.3 ms). A slice taken from an [n, k] matrix at trace time is not
fused either: the slices are stored apart (Int8Weight.q [chunks, n, k / chunks]).
At many rows XLA decodes int8 into f32 far slower than it reads f32 (2-4x the f32 GEMM's time at
64-256 rows), so the layer matrices keep a dense f32 copy for prefill (Int8Weight.dense).
Measurements: docs/BENCHMARKS.md, "The int8 CPU weight form" and "Int8 layer matrices for
one-row dots".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax.quant.matrix import DenseWeight, Int8Weight

FUSED_VECTOR_BYTES = 16 * 1024  # XLA CPU fuses into a matrix-vector dot below this vector size
# Without a dense copy (the vocabulary), up to this many rows run as one fused dot each: XLA
# writes the decoded matrix out for a many-row dot (the 0.5B's head 530-600 ms at 2-32 rows
# against 23 / 96 / 364 ms row by row at 2 / 8 / 32 rows, loaded machine)
ONE_ROW_MAX_NT = 32


def chunks_for(k: int, group: int) -> int:
    """How many K slices an [n, k] int8 matrix (scale groups of `group`) is stored in: the
    fewest whose f32 slice of x stays under FUSED_VECTOR_BYTES, each whole groups; 1 where none
    divides k so."""
    for c in range(1, k // group + 1):
        kc, rest = divmod(k, c)
        if rest == 0 and kc % group == 0 and kc * 4 < FUSED_VECTOR_BYTES:
            return c
    return 1


def dense_matmul(x: jax.Array, w: DenseWeight) -> jax.Array:
    """x [nt, K] . w^T -> [nt, N] f32 through XLA's dot."""
    wm = w.w if w.transposed else w.w.T  # [K, N]
    return jnp.dot(x.astype(wm.dtype), wm, preferred_element_type=jnp.float32)


def computed_once(x: jax.Array) -> jax.Array:
    """x, made by an op XLA CPU does not fuse into its consumer (a reduce-window: a cumulative
    sum after a zero row). XLA fuses x's elementwise producers (the RMSNorm before q/k/v, gate/up
    and the head) into a fused dot's loop and recomputes them for every output row: the 0.5B's
    head 13.3 vs 7.6 ms with the norm recomputed (8.0 with this; a size-1 cumulative sum is
    simplified away: 16.9)."""
    return jnp.cumsum(jnp.stack([jnp.zeros_like(x), x]), axis=0)[1]


def int8_matmul(x: jax.Array, w: Int8Weight) -> jax.Array:
    """x [nt, K] . w's values^T -> [nt, N] f32: the dense copy for more than one row where w
    keeps one, else the decode fused into the dot, one dot per K slice (and per row up to
    ONE_ROW_MAX_NT rows). The barrier on the inputs ties the weight to x (which changes every
    step), keeping the decode inside a decode loop's body: loop-invariant code motion hoisted
    it, writing every int8 matrix out as f32 at each call. The one on the output keeps a
    following add (q/k/v's bias) from fusing the dot as its output fusion, which writes the
    decoded matrix out first (3.4 vs 0.05 ms for q/k/v). Neither keeps x's producers out of the
    fusion (barriers are expanded before fusion): `computed_once` does."""
    nt = x.shape[0]
    if nt > 1 and w.dense is not None:
        return dense_matmul(x, w.dense)
    if 1 < nt <= ONE_ROW_MAX_NT:
        return jnp.concatenate([int8_matmul(x[i : i + 1], w) for i in range(nt)])
    x, w = jax.lax.optimization_barrier((x.astype(jnp.float32), Int8Weight(w.q, w.a, w.b)))
    x = computed_once(x)
    c, n, kc = w.q.shape
    parts = [jnp.dot(x[:, i * kc : (i + 1) * kc], w.chunk_values(i).T) for i in range(c)]
    y = parts[0] if c == 1 else jnp.concatenate(parts, axis=-1).reshape(nt, c, n).sum(axis=1)
    return jax.lax.optimization_barrier(y)  # an add after it (a bias) would unfuse the decode
