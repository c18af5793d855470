"""The residual stream of a decoder step, and the one place that decides how a layer's products
join it: a family layer says what it adds (`add_product(x, y, w, ...)`: x + y . w^T), this
module decides how.

- Decode on the kernels with impl.fused_decode, one device (`start(..., decode=True)`): the o /
  down projections' split-K partials are added to the rows by one kernel that also sums their
  squares in pieces (pallas/split_sums.add_partials), which the next RMSNorm's GEMVs read
  (ops.norm_matmuls' sumsq, Route.fold_norm "rsqrt"); the gated activation is formed from the
  gate / up GEMVs' partials by one kernel (split_sums.glu_partials). A product normed before its
  add (Gemma's post-norms) or biased after it (gpt-oss's o bias) joins as a plain add (`x + v`).
- Otherwise one matmul and an add; inside shard_map (tensor parallel, Join.par: the shard's
  hooks, engine/sharding.TensorParallel) the shard's partial product and an all-reduce.
A model-agnostic attention module decides the same for q / k / v (model/attention.Attend).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.pallas import split_sums


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (ggml_gelu; Gemma's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}  # as split_sums.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class Join:
    """How a step's products join its residual stream (static; `start` decides it)."""

    # the split-K epilogue kernels: a decode step on the kernels, impl.fused_decode, one device
    epilogues: bool = False
    # inside shard_map: the shard's hooks (row_matmul, all_reduce); None on one device
    par: Any = None


@dataclasses.dataclass(frozen=True)
class Stream:
    """The residual stream between layers (a trace-time container, not a pytree): its rows and,
    after an epilogue add, their sums of squares in pieces for the next norm's GEMVs."""

    rows: jax.Array  # [T, d] f32
    join: Join = Join()
    sumsq: jax.Array | None = None  # [T, P] f32 (split_sums.add_partials'), or None

    def __add__(self, v: jax.Array) -> Stream:
        """x + v for a finished v [T, d] (the sums of squares no longer hold)."""
        return Stream(self.rows + v, self.join)

    def __mul__(self, s: jax.Array) -> Stream:
        return Stream(self.rows * s, self.join)


def start(rows: jax.Array, impl: ops.Impl, par=None, decode: bool = False) -> Stream:
    """The stream of a step's embedded rows [T, d]; decode: a decode step (one row per
    sequence), whose products take the epilogue kernels on the kernels with impl.fused_decode on
    one device."""
    epilogues = decode and impl.fused_decode and impl.kernels != "xla" and par is None
    return Stream(rows, Join(epilogues, par))


def norm_matmuls(x: Stream, norm: jax.Array, eps: float, weights, impl: ops.Impl) -> list:
    """ops.norm_matmuls of the stream's rows (their sums of squares given where it has them)."""
    return ops.norm_matmuls(x.rows, norm, eps, weights, impl, x.sumsq)


def norm_matmul_parts(x: Stream, norm: jax.Array, eps: float, weights, impl: ops.Impl) -> list:
    """ops.norm_matmul_parts of the stream's rows: the products' split-K partials unadded."""
    return ops.norm_matmul_parts(x.rows, norm, eps, weights, impl, x.sumsq)


def row_product(x: Stream, y: jax.Array, w, which: str, impl: ops.Impl) -> jax.Array:
    """y . w^T [T, d] for x's stream, w the o ("attn_out") or down ("ffn_out") projection: one
    device's matmul, or a shard's partial product + all-reduce."""
    par = x.join.par
    return ops.matmul(y, w, impl) if par is None else par.row_matmul(which, y, w, impl)


def add_product(x: Stream, y: jax.Array, w, which: str, impl: ops.Impl) -> Stream:
    """x + y . w^T, the residual add after the o ("attn_out") or down ("ffn_out") projection:
    with the epilogues one kernel adds the projection's partials to x and sums the squares,
    else the matmul (row_product) and an add."""
    if x.join.epilogues:
        parts = ops.matmul_parts(y, w, impl)
        rows, sumsq = split_sums.add_partials(x.rows, parts, interpret=impl.kernels == "interpret")
        return Stream(rows, x.join, sumsq)
    return Stream(x.rows + row_product(x, y, w, which, impl), x.join)


def total(x: Stream, out: jax.Array) -> jax.Array:
    """A layer output computed whole on each shard's slice (a mixture of experts') summed over
    the shards; as it is on one device."""
    return out if x.join.par is None else x.join.par.all_reduce(out)


def gated_act(
    x: Stream, norm: jax.Array, eps: float, gate_up, d_ff: int, act: str, impl: ops.Impl
) -> jax.Array:
    """act(gate(n(x))) * up(n(x)) [T, d_ff], n the RMSNorm with weight `norm`, gate_up the
    weights whose rows are gate | up (d_ff each): the down projection's input. With the
    epilogues one kernel forms it from the GEMVs' partials."""
    if x.join.epilogues:
        parts = norm_matmul_parts(x, norm, eps, gate_up, impl)
        return split_sums.glu_partials(
            tuple(parts),
            widths=tuple(w.shape[0] for w in gate_up),
            d_ff=d_ff,
            act=act,
            batch=x.rows.shape[0],
            interpret=impl.kernels == "interpret",
        )
    both = jnp.concatenate(norm_matmuls(x, norm, eps, gate_up, impl), axis=-1)  # [T, 2ff]
    gate, up = both[:, :d_ff], both[:, d_ff:]
    return ACTIVATIONS[act](gate) * up
