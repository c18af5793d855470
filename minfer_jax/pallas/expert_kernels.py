"""The expert GEMV's kernel bodies: one program's rows of ONE chosen expert's weight for one
input row, the expert picked by an id read inside the kernel (pallas/expert_gemv.py builds the
launches).

An expert weight is stacked (the contract in docs/ARCHITECTURE.md, "Experts"): every plane
[E, Npad, cols], flattened to [E * Npad, cols] for the kernel (a free reshape), so expert e's rows
[r, r + bn) are the plane rows [e * Npad + r, e * Npad + r + bn): a dynamic `pl.ds` start, the
one kind of dynamic offset the Triton lowering takes (the plane refs are whole arrays; no index
map can read the ids, which never leave the device).

A weight's format picks its body through the per-format records: a block format with int8 words
(int8_words.SPECS) runs the integer GEMV's step (gemv_int8_kernel.load_step_tiles, token_sums,
in_kernel_x_source: x quantized per step inside the program, dp4a on the planes' words); any
other format (F32 / F16 / BF16, and formats without word specs) decodes [bn, bk] tiles through
quant.planes' decode (tiles.load_weight_tile) and multiply-adds them into an f32 accumulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import gemv_int8_kernel, gemv_tuning, int8_words, tiles
from minfer_jax.quant.planes import QType, get_format

DECODED_STEP_WEIGHTS = 256  # decoded formats: weights per row per step (a [bn, 256] f32 tile)

# the gated activations the fused gate+up kernel applies (one definition, kernel and reference)
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss (llama.cpp's ggml_swiglu_oai)
SWIGLU_OAI_LIMIT = 7.0


def _sigmoid(v: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-v))  # exp and a divide: lowered by every backend


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: silu(gate) * up."""
    return gate * _sigmoid(gate) * up


def swiglu_oai(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gpt-oss's clamped SwiGLU: g = min(gate, 7), u = clamp(up, -7, 7),
    g * sigmoid(1.702 g) * (u + 1)."""
    g = jnp.minimum(gate, SWIGLU_OAI_LIMIT)
    u = jnp.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return g * _sigmoid(SWIGLU_OAI_ALPHA * g) * (u + 1.0)


GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


def gelu_tanh_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """GeGLU (gemma4's experts): gelu_tanh(gate) * up, the tanh written as a sigmoid
    (0.5 (1 + tanh z) = sigmoid(2 z)) so every backend lowers it."""
    z = GELU_TANH_C * (gate + 0.044715 * gate * gate * gate)
    return gate * _sigmoid(2.0 * z) * up


GLU_ACTIVATIONS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "silu": silu_glu,
    "swiglu_oai": swiglu_oai,
    "gelu_tanh": gelu_tanh_glu,
}


@dataclasses.dataclass(frozen=True)
class RowsBody:
    """How a program computes rows of one expert's weight for one x row: `rows(x_ref, tok,
    plane_refs, row0)` -> [bn] f32, x_ref holding the x rows laid out by `x_layout`, tok a static
    row of that block, row0 the first flattened plane row (e * Npad + r)."""

    qtype: QType
    n_refs: int  # plane refs it reads, in `plane_order`
    plane_order: tuple[str, ...]
    x_layout: Callable[[jax.Array], jax.Array]  # x [R, K] f32 -> the array x_ref blocks
    rows: Callable


def rows_body(qtype: QType, bn: int, k: int, interpret: bool, x_terms: int = 1) -> RowsBody:
    """The body of a weight of qtype with bn rows per program and K = k inputs (x_terms: int8
    terms of x on the integer path, gemv_tuning.PRECISE_X_TERMS in the precise mode)."""
    if qtype in int8_words.SPECS:
        return _int8_rows(qtype, bn, k, interpret, x_terms)
    return _decoded_rows(qtype, bn, k)


def _int8_rows(qtype: QType, bn: int, k: int, interpret: bool, x_terms: int) -> RowsBody:
    """Integer path: steps of INT8_STEP_WEIGHTS weights per row (gt groups), x quantized per
    step as the GEMV's in-kernel path does, dp4a on the weight words."""
    spec = int8_words.SPECS[qtype]
    n_groups = k // spec.group
    gt = tiles.pow2_divisor(n_groups, gemv_tuning.INT8_STEP_WEIGHTS // spec.group)
    exact_round = gemv_tuning.row(qtype).exact_round  # the reference's rounding (numerics)
    source = gemv_int8_kernel.in_kernel_x_source(qtype, gt, exact_round, x_terms=x_terms)
    dot4 = int8_words.dp4a_emulated if interpret else int8_words.dp4a_ptx
    perm = int8_words.prmt_emulated if interpret else int8_words.prmt_ptx
    view_names = [name for name, _ in spec.views]
    coarse_names = [name for name, _ in spec.coarse]

    def rows(x_ref, tok: int, plane_refs, row0):
        views = dict(zip(view_names, plane_refs))
        coarse = dict(zip(coarse_names, plane_refs[len(view_names) :]))

        def step(j, acc):
            g0 = j * gt if isinstance(j, int) else pl.multiple_of(j * gt, gt)
            groups = (g0 + lax.iota(jnp.int32, gt))[None, :]  # [1, gt] absolute
            t = gemv_int8_kernel.load_step_tiles(
                spec, views, coarse, g0, gt, groups, bn, False, False, row0
            )
            words, a, b = spec.fn(t, groups % 2, perm)
            terms, xo, xsum = source.prepare(source.load([x_ref], tok, g0, None))
            return acc + gemv_int8_kernel.token_sums(
                spec, words, a, b, terms, xo, xsum, dot4, False
            )

        acc = tiles.k_steps(n_groups // gt, step, jnp.zeros((bn, gt), jnp.float32))
        return jnp.sum(acc, axis=1)

    return RowsBody(
        qtype,
        len(view_names) + len(coarse_names),
        (*view_names, *coarse_names),
        lambda x: int8_words.x_view(qtype, x),
        rows,
    )


def _decoded_rows(qtype: QType, bn: int, k: int) -> RowsBody:
    """Any format: [bn, bk] tiles decoded to f32 (quant.planes.decode) times x, multiply-added
    into a [bn, bk] accumulator, reduced once at the end (the float GEMV's "fma" path)."""
    fmt = get_format(qtype)
    bk = tiles.pow2_divisor(k, DECODED_STEP_WEIGHTS)

    def rows(x_ref, tok: int, plane_refs, row0):
        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, row0, bn, k0, bk, jnp.float32)
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            return acc + w * x_ref[pl.ds(tok, 1), pl.ds(kx, bk)]  # [bn, bk]

        acc = tiles.k_steps(k // bk, step, jnp.zeros((bn, bk), jnp.float32))
        return jnp.sum(acc, axis=1)

    return RowsBody(
        qtype,
        len(fmt.planes),
        tuple(p.name for p in fmt.planes),
        lambda x: x.astype(jnp.float32),
        rows,
    )


def kernel_planes(body: RowsBody, planes) -> list[jax.Array]:
    """A stacked weight's planes {name: [E, Npad, cols]} as the body's refs: flattened to
    [E * Npad, ...] (and, integer path, viewed as words per group: int8_words.word_planes)."""
    flat = {name: p.reshape(p.shape[0] * p.shape[1], *p.shape[2:]) for name, p in planes.items()}
    if body.qtype in int8_words.SPECS:
        flat = int8_words.word_planes(body.qtype, flat)
    return [flat[name] for name in body.plane_order]
