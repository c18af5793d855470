"""The integer GEMV's kernel bodies: one program's step over gt groups of bn rows, for every token.

Per step of gt groups, acc[t] [bn, gt] += a * (dx * S + xo) + b * xs for each token t, with S the
dp4a sums of the weights' int8x4 words (int8_words) and x's. Two factories, one per way x
arrives: `in_kernel_x_kernel` (x as f32, quantized here per step and token, optionally times a
per-input scale of the same view, e.g. a folded RMSNorm weight) and `prequantized_x_kernel` (x
already quantized by int8_words.quantize_x: words + scales). Both build the same step; only the x
source differs.

The order of loads in a step is measured and must not drift (moving the per-group field loads
before the quant words once slowed Q4_0 by a fifth: docs/BENCHMARKS.md, GEMV choices
[G-load-order]): [x, if x_first], quant words and per-group fields (the views' order), coarse
fields, [x quantized, if x_first], decode, then per token [x loaded and quantized] and the sums.
Coarse planes (one value per `per` groups, e.g. a K-quant's d) arrive as whole rows and are
gathered at absolute group numbers, so a K split need not align to their columns [G-coarse-rows].
Per-group values (fields, x scales, S, accumulators) are [bn, gt] tiles, or [bn, gt, 1] (`dims3`:
meeting the words by size-1 broadcasts; gemv_tuning.Int8Row.tile_shapes says when). S goes to f32
by a conversion instruction [G-round].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import int8_words, tiles
from minfer_jax.quant.planes import QType


@dataclasses.dataclass(frozen=True)
class Block:
    """One program's share of the work: ntp tokens x bn rows, n_steps steps of gt groups."""

    qtype: QType
    ntp: int  # tokens, padded to a power of two
    bn: int
    gt: int
    n_steps: int


@dataclasses.dataclass(frozen=True)
class _XSource:
    """How a kernel gets one token's x for gt groups: `load` (refs as stored) then `prepare`
    (-> terms, xo, xsum: per int8 term of x its words per slot [1, gt, x_words] and dx, then xo,
    xsum [1, gt(, 1)]). `per_token` (optional) computes a value per token once, before the K loop
    (a norm's rsqrt), that load receives."""

    n_refs: int
    load: Callable  # (x_refs, tok, g0, token_value) -> raw
    prepare: Callable  # raw -> (words, dx, xo, xsum)
    per_token: Callable | None = None  # (x_refs, tok) -> token_value


# One kernel closure per configuration (jax#40847: a shared function object can reuse a trace).


@functools.cache
def in_kernel_x_kernel(
    block: Block,
    exact_round: bool,
    scaled: bool,
    dot4: Callable,
    x_first: bool,
    norm: tuple[int, float] | None = None,
    sumsq_pieces: int = 0,
    x_terms: int = 1,
    perm: Callable | None = None,
):
    """x as f32 views [ntp, G, x_words, 4, x_slots] (+ with `scaled` the scale's [1, G, ...]),
    quantized per step and token (in_kernel_x_source); per-group values as [bn, gt] tiles."""
    source = in_kernel_x_source(
        block.qtype, block.gt, exact_round, scaled, norm, sumsq_pieces, x_terms
    )
    return _kernel(block, source, False, False, dot4, x_first, perm)


def in_kernel_x_source(
    qtype: QType,
    gt: int,
    exact_round: bool,
    scaled: bool = False,
    norm: tuple[int, float] | None = None,
    sumsq_pieces: int = 0,
    x_terms: int = 1,
) -> _XSource:
    """x as f32 views [rows, G, x_words, 4, x_slots] (+ with `scaled` the scale's [1, G, ...]),
    quantized per step and token in x_terms int8 terms (int8_words.quantize_slot_terms); also
    the expert GEMV's (pallas/expert_kernels.py) x.

    norm = (K, eps): x is an RMSNorm's input and the scale its weight; the program quantizes
    (x * rsqrt(mean(x^2) + eps)) * scale, the norm's output, as it loads its slice. One more ref
    gives the sum of squares: x's whole rows [ntp, K], or with sumsq_pieces > 0 the rows' sums
    of squares in that many pieces [ntp, pieces] (for rows too wide to reread per program)."""
    spec = int8_words.SPECS[qtype]
    assert norm is None or scaled, "the folded norm needs its weight as the scale"
    assert norm is not None or not sumsq_pieces, "sums of squares are the norm's"
    at_rows = 1 + scaled  # ref positions: x, [scale], [rows or sums of squares]

    def rsqrt(x_refs, tok):  # the token's rsqrt(mean(x^2) + eps), once per program
        rows = x_refs[at_rows]
        if sumsq_pieces:
            return _sumsq_rsqrt(rows, tok, sumsq_pieces, *norm)
        return _row_rsqrt(rows, tok, *norm)

    def load(x_refs, tok, g0, r):  # one load per slot: [gt, x_words, 4] f32 each
        xs = [x_refs[0][tok, pl.ds(g0, gt), :, :, slot] for slot in range(spec.x_slots)]
        if norm is not None:
            xs = [v * r for v in xs]
        if scaled:
            xs = [v * x_refs[1][0, pl.ds(g0, gt), :, :, slot] for slot, v in enumerate(xs)]
        return xs

    def prepare(raw):
        terms, xo, xsum = int8_words.quantize_slot_terms(raw, spec.offset, exact_round, x_terms)
        return [([w[None] for w in words], dx[None]) for words, dx in terms], xo[None], xsum[None]

    n_refs = at_rows + (norm is not None)
    return _XSource(n_refs, load, prepare, rsqrt if norm is not None else None)


def _sumsq_rsqrt(sumsq_ref, tok: int, pieces: int, k: int, eps: float):
    """rsqrt(mean(x^2) + eps) of token tok from its sum of squares in pieces: one vector load,
    summed in an order set by the piece count and the kernel's warps, never by the row count."""
    total = jnp.sum(sumsq_ref[tok, pl.ds(0, pieces)])
    return lax.rsqrt(total * jnp.float32(1.0 / k) + jnp.float32(eps))


def _row_rsqrt(row_ref, tok: int, k: int, eps: float):
    """rsqrt(mean(x^2) + eps) of token tok's whole row [K] of row_ref, loaded in power-of-two
    pieces (Triton tensors): a scalar."""
    total, start = None, 0
    for size in _pow2_pieces(k):
        v = row_ref[tok, pl.ds(start, size)]
        part = jnp.sum(v * v)
        total = part if total is None else total + part
        start += size
    return lax.rsqrt(total * jnp.float32(1.0 / k) + jnp.float32(eps))


def _pow2_pieces(k: int) -> list[int]:
    """k as a sum of distinct powers of two, largest first (896 -> [512, 256, 128])."""
    return [1 << b for b in range(k.bit_length() - 1, -1, -1) if k >> b & 1]


@functools.cache
def prequantized_x_kernel(
    block: Block, dims3: bool, dot4: Callable, x_first: bool, perm: Callable | None = None
):
    """x as quantize_x's words [ntp, G, x_slots, x_words] and scales [ntp, 4, G, 1]; per-group
    values as [bn, gt, 1] tiles with dims3, else [bn, gt] with one-word quant views flat."""
    spec = int8_words.SPECS[block.qtype]
    gt = block.gt

    def load(x_refs, tok, g0, _):
        xw_ref, xsc_ref = x_refs
        if dims3:  # the token axis kept: x broadcasts over the rows as loaded
            t1 = pl.ds(tok, 1)
            words = [xw_ref[t1, pl.ds(g0, gt), slot, :] for slot in range(spec.x_slots)]
            return (words, *(xsc_ref[t1, c, pl.ds(g0, gt), :] for c in range(3)))
        # 2-D tiles: [1, gt, ...] slices measured far slower for Q8_0 [G-prequant-tiles]
        words = [xw_ref[tok, pl.ds(g0, gt), slot, :][None] for slot in range(spec.x_slots)]
        return (words, *(xsc_ref[tok, c, pl.ds(g0, gt), 0][None] for c in range(3)))

    def prepare(raw):
        words, dx, xo, xsum = raw
        return [(words, dx)], xo, xsum

    return _kernel(block, _XSource(2, load, prepare), dims3, not dims3, dot4, x_first, perm)


def _kernel(
    block: Block,
    x_src: _XSource,
    dims3: bool,
    flat: bool,
    dot4: Callable,
    x_first: bool,
    perm: Callable | None,
):
    spec = int8_words.SPECS[block.qtype]
    ntp, bn, gt = block.ntp, block.bn, block.gt
    col = (lambda v: v[:, :, None]) if dims3 else (lambda v: v)  # [r, gt] -> per-group shape

    def kernel(*refs, split=None):  # split: program_id(1), read by a caller that branches
        *in_refs, o_ref = refs
        x_refs, plane_refs = in_refs[: x_src.n_refs], in_refs[x_src.n_refs :]
        views = dict(zip([n for n, _ in spec.views], plane_refs))
        coarse = dict(zip([n for n, _ in spec.coarse], plane_refs[len(spec.views) :]))
        split = pl.program_id(1) if split is None else split
        split_g0 = split * (block.n_steps * gt)  # this split's first group
        per_token = [
            x_src.per_token(x_refs, tok) if x_src.per_token else None for tok in range(ntp)
        ]

        def load(tok, g0):
            return x_src.load(x_refs, tok, g0, per_token[tok])

        def step(j, accs):
            g0 = j * gt if isinstance(j, int) else pl.multiple_of(j * gt, gt)
            x_raw = [load(tok, g0) for tok in range(ntp)] if x_first else None
            groups = col(
                (split_g0 + g0 + lax.iota(jnp.int32, gt))[None, :]
            )  # [1, gt(, 1)] absolute
            t = load_step_tiles(spec, views, coarse, g0, gt, groups, bn, dims3, flat)
            xq = [x_src.prepare(raw) for raw in x_raw] if x_first else None
            words, a, b = spec.fn(
                t, groups % 2, perm
            )  # words: x_slots x [bn, gt, x_words]; a, b [bn, gt(, 1)]
            out = []
            for tok in range(ntp):  # the weight words above serve every token
                terms, xo, xsum = xq[tok] if x_first else x_src.prepare(load(tok, g0))
                out.append(accs[tok] + token_sums(spec, words, a, b, terms, xo, xsum, dot4, dims3))
            return tuple(out)

        accs = tuple(jnp.zeros((bn, gt, 1) if dims3 else (bn, gt), jnp.float32) for _ in range(ntp))
        accs = tiles.k_steps(block.n_steps, step, accs)
        for tok in range(ntp):
            acc = jnp.sum(accs[tok], axis=2) if dims3 else accs[tok]
            o_ref[tok, :] = jnp.sum(acc, axis=1)

    return kernel


def load_step_tiles(
    spec: int8_words.WordSpec,
    views: dict,
    coarse: dict,
    g0,
    gt: int,
    groups,
    bn: int,
    dims3: bool,
    flat: bool,
    row0=None,
) -> dict:
    """One step's weight tiles: the views' groups [g0, g0 + gt) of rows [row0, row0 + bn) (the
    whole block where row0 is None), then the coarse fields gathered at the absolute group numbers
    `groups` [1, gt(, 1)] -> {plane: [bn, gt, *tail] or [bn, gt(, 1)]}, in that load order."""
    col = (lambda v: v[:, :, None]) if dims3 else (lambda v: v)
    rsel = slice(None) if row0 is None else pl.ds(row0, bn)
    t = {
        name: views[name][(rsel, pl.ds(g0, gt)) + (slice(None),) * len(tail)]
        for name, tail in spec.view_tails(dims3, flat)
    }  # [bn, gt, *tail]
    rows = col(lax.iota(jnp.int32, bn)[:, None])
    if row0 is not None:
        rows = rows + row0
    for name, per in spec.coarse:  # one value per `per` groups: gather it for each group
        t[name] = coarse[name][rows, groups // per]  # [bn, gt(, 1)]
    return t


def token_sums(spec, words, a, b, terms, xo, xsum, dot4, dims3: bool):
    """One token's a * (sum over x's terms of dx * S + xo) + b * xsum per group [bn, gt(, 1)], S by
    dp4a on the words and the term's."""
    v = None
    for xw, dx in terms:
        s = jnp.zeros(words[0].shape, jnp.int32)
        for w, x in zip(words, xw):
            s = dot4(w, jnp.broadcast_to(x, w.shape), s)
        part = jnp.sum(s, axis=-1, keepdims=dims3).astype(jnp.float32) * dx  # [bn, gt(, 1)]
        v = part if v is None else v + part
    if spec.offset:
        v = v + xo
    v = a * v
    if b is not None:
        v = v + b * xsum
    return v
