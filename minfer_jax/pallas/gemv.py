"""Decode GEMV: y[nt, N] = x[nt, K] . W[N, K]^T for nt = 1 .. 8, every weight byte read once.

Two kernel families, picked by ops.route (never here): `gemv_int8` for the block formats (Q4_0 ..
Q6_K) and `gemv_float` for F32 / F16 / BF16; each has its jnp reference beside it. Blocks and path
per call come from gemv_tuning (one row per format); the word layouts from int8_words.

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN; packed
quants in uint32 words.

Integer path (llama.cpp's MMVQ idea): x is quantized to int8 with one scale per scale group, for
few tokens by each program on its slice of x (in registers: no prepass kernel), from
gemv_tuning.PREQUANT_MIN_NT tokens on by one XLA fusion before the kernel; then per group S = sum
q * xq is computed four weights per instruction with PTX `dp4a` on the planes' own words (inline
asm; an exact jnp emulation in interpret mode), and y += a * (dx * S + offset term) + b * sum(x).
All nt tokens are handled inside the program (the token loop is unrolled over the same loaded
weight words), so each weight word is read once.
Grid (Npad / bn, splits): program (i, s) owns rows [i*bn, (i+1)*bn) and the s-th K range,
walking it gt groups per step; with the default configs the K range is a single step (no K loop).

Float path: one token multiply-adds the decoded [bn, bk] tile into an f32 accumulator ("fma");
more tokens go through a tensor-core dot with x padded to NT_PAD = 16 rows (the smallest dot the
Triton lowering accepts).

Split-K partial sums [splits, rows, Npad] are added by XLA in the consumer's fusion; splitting
pays for the 0.5B shapes, whose 896..4864-row matrices would otherwise keep only a handful of
the 132 SMs busy (atomic adds into one zeroed output measured slower in the model:
docs/BENCHMARKS.md, GEMV choices [G-split-sums]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import gemv_int8_kernel, int8_words, tiles
from minfer_jax.pallas.gemv_tuning import MAX_NT, NT_PAD, TUNING, GemvConfig, choose_config, row
from minfer_jax.quant.planes import QType, decode_ints, get_format
from minfer_jax.sizes import pow2_at_least

__all__ = [
    "MAX_NT",
    "NT_PAD",
    "GemvConfig",
    "choose_config",
    "gemv_float",
    "gemv_float_reference",
    "gemv_int8",
    "gemv_int8_reference",
]

_STATIC = ("qtype", "n_out", "config", "deterministic", "partials", "interpret")
_STATIC_INT8 = (*_STATIC, "norm_eps")


@functools.partial(jax.jit, static_argnames=_STATIC_INT8)
def gemv_int8(
    x: jax.Array,
    planes: dict,
    *,
    qtype: QType,
    n_out: int,
    x_scale: jax.Array | None = None,
    norm_eps: float | None = None,
    config: GemvConfig | None = None,
    deterministic: bool = False,
    partials: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Block formats: (x [nt, K] (nt <= 16) * x_scale [K]) . W^T -> [nt, n_out] f32, W as its
    planes; partials: the split-K partial sums [splits, pow2(nt), Npad] unadded (for a consumer
    kernel that adds them itself: decode_qkv).

    x_scale (optional, f32 [K]) multiplies x per input feature (a folded RMSNorm weight: ops.py):
    inside the kernel as x is loaded where the kernel quantizes x itself, else in the XLA fusion
    that quantizes x before it. deterministic: each row's result does not depend on nt (one
    config for all, choose_config; split-K partials added in a fixed order)."""
    cfg, npad, x_scale = _prologue(x, planes, qtype, n_out, x_scale, config, deterministic)
    spec = int8_words.SPECS[qtype]
    nt, k = x.shape
    ntp = pow2_at_least(nt)
    n_groups = k // spec.group
    gs = n_groups // cfg.splits  # groups per split
    gt = cfg.bk // spec.group  # groups per step
    assert n_groups % cfg.splits == 0 and gs % gt == 0, (cfg, k)
    x = jnp.pad(x, ((0, ntp - nt), (0, 0)))
    tuning = row(qtype)
    block = gemv_int8_kernel.Block(qtype, ntp, cfg.bn, gt, gs // gt)
    dot4 = int8_words.dp4a_emulated if interpret else _dp4a
    if cfg.prequant:
        xw, xsc = int8_words.quantize_x(
            qtype, x if x_scale is None else x * x_scale, tuning.exact_round
        )  # one XLA fusion
        x_ops = (xw, xsc)  # [ntp, G, x_slots, x_words] int32, [ntp, 4, G, 1] f32
        in_specs = [
            pl.BlockSpec((ntp, gs, spec.x_slots, spec.x_words), lambda i, s: (0, s, 0, 0)),
            pl.BlockSpec((ntp, 4, gs, 1), lambda i, s: (0, 0, s, 0)),
        ]
        dims3, flat = tuning.tile_shapes(prequant=True)
        kernel = gemv_int8_kernel.prequantized_x_kernel(block, dims3, dot4, cfg.x_first)
    else:
        x_ops = (int8_words.x_view(qtype, x),)  # [ntp, G, x_words, 4, x_slots]
        in_specs = [
            pl.BlockSpec((ntp, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))
        ]
        if x_scale is not None:  # scaled inside the kernel, as x is loaded
            x_ops += (int8_words.x_view(qtype, x_scale[None]),)  # [1, G, x_words, 4, x_slots]
            in_specs.append(
                pl.BlockSpec((1, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))
            )
        norm = None
        if norm_eps is not None:  # whole rows, for the norm's sum of squares
            x_ops += (x.astype(jnp.float32),)
            in_specs.append(pl.BlockSpec((ntp, k), lambda i, s: (0, 0)))
            norm = (k, float(norm_eps))
        dims3, flat = tuning.tile_shapes(prequant=False)
        kernel = gemv_int8_kernel.in_kernel_x_kernel(
            block, tuning.exact_round, x_scale is not None, dot4, cfg.x_first, norm
        )
    wp = int8_words.word_planes(qtype, planes, dims3=dims3, flat_words=flat)
    arrays = []
    for name, tail in spec.view_tails(dims3, flat):
        arrays.append(wp[name])
        in_specs.append(
            pl.BlockSpec((cfg.bn, gs, *tail), functools.partial(_row_block_index, len(tail)))
        )
    for name, _ in spec.coarse:  # whole rows (n_groups / per columns): indexed by absolute group
        arrays.append(wp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, wp[name].shape[1]), lambda i, s: (i, 0)))
    out = _split_k_call(
        kernel,
        in_specs,
        (*x_ops, *arrays),
        cfg,
        npad,
        ntp,
        interpret,
        f"gemv_int8_{qtype.name.lower()}",
    )
    return out if partials else tiles.sum_splits(out, 0, deterministic)[:nt, :n_out]


@functools.partial(jax.jit, static_argnames=_STATIC)
def gemv_float(
    x: jax.Array,
    planes: dict,
    *,
    qtype: QType,
    n_out: int,
    x_scale: jax.Array | None = None,
    config: GemvConfig | None = None,
    deterministic: bool = False,
    partials: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Float formats: (x [nt, K] (nt <= 16) * x_scale [K]) . W^T -> [nt, n_out] f32, W as its
    planes. deterministic, partials ([splits, NT_PAD, Npad]): as gemv_int8's."""
    cfg, npad, x_scale = _prologue(x, planes, qtype, n_out, x_scale, config, deterministic)
    fmt = get_format(qtype)
    nt, k = x.shape
    k_split = k // cfg.splits
    xs = x if x_scale is None else x * x_scale  # fused into the cast below
    x16 = tiles.cast_rows(xs, NT_PAD, fmt.compute_dtype)  # [16, K]
    in_specs = [pl.BlockSpec((NT_PAD, k_split), lambda i, s: (0, s))]
    in_specs += [pl.BlockSpec((cfg.bn, k_split // p.wpc), lambda i, s: (i, s)) for p in fmt.planes]
    if cfg.fma and nt == 1:
        kernel = _fma_kernel(qtype, cfg.bn, cfg.bk, k_split)
    else:
        kernel = _dot_kernel(qtype, cfg.bn, cfg.bk, k_split, fmt.compute_dtype)
    out = _split_k_call(
        kernel,
        in_specs,
        (x16, *tiles.plane_arrays(fmt, planes)),
        cfg,
        npad,
        NT_PAD,
        interpret,
        f"gemv_{fmt.name.lower()}",
    )
    return out if partials else tiles.sum_splits(out, 0, deterministic)[:nt, :n_out]


def _prologue(x, planes, qtype: QType, n_out: int, x_scale, config, deterministic: bool):
    """What both families check and resolve first: token count, config, padded rows, x_scale in
    f32."""
    nt, k = x.shape
    if not 1 <= nt <= NT_PAD:
        raise ValueError(f"gemv takes 1 .. {NT_PAD} tokens, got {nt}")
    cfg = config or choose_config(qtype, n_out, k, nt, deterministic)
    npad = tiles.plane_arrays(get_format(qtype), planes)[0].shape[0]
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()
    if x_scale is not None:
        x_scale = x_scale.astype(jnp.float32)
    return cfg, npad, x_scale


def _row_block_index(n_tail: int, i, s):
    return (i, s) + (0,) * n_tail


def _split_k_call(
    kernel, in_specs, operands, cfg: GemvConfig, npad: int, rows: int, interpret: bool, name: str
):
    """Grid (Npad / bn, splits) -> partial sums [splits, rows, Npad] f32 (XLA adds the splits)."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.splits, rows, npad), jnp.float32),
        grid=(npad // cfg.bn, cfg.splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, rows, cfg.bn), lambda i, s: (s, 0, i)),
        compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


def _dp4a(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """c + dot of the four signed bytes of a and b, per element (PTX dp4a; GPU only)."""
    from jax.experimental.pallas import triton as pltriton

    [r] = pltriton.elementwise_inline_asm(
        "dp4a.s32.s32 $0, $1, $2, $3;",
        args=[a, b, c],
        constraints="=r,r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return r


# One kernel closure per configuration (jax#40847: a shared function object can reuse a trace).


@functools.cache
def _fma_kernel(qtype: QType, bn: int, bk: int, k_split: int):
    """One token: y[n] = sum_k w[n, k] x[k], multiply-added into a [bn, bk] f32 accumulator (no
    per-step reduction, no operand layout change for a dot), reduced once at the end."""
    fmt = get_format(qtype)

    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, 0, bn, k0, bk, jnp.float32)  # [bn, bk]
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            return acc + w * x_ref[pl.ds(0, 1), pl.ds(kx, bk)].astype(jnp.float32)  # [bn, bk]

        acc = jnp.zeros((bn, bk), jnp.float32)
        acc = tiles.k_steps(k_split // bk, step, acc)
        o_ref[...] = jnp.broadcast_to(jnp.sum(acc, axis=1)[None, :], (NT_PAD, bn))

    return kernel


@functools.cache
def _dot_kernel(qtype: QType, bn: int, bk: int, k_split: int, compute_dtype):
    """x [16, bk] . decoded tile [bn, bk]^T per step on the tensor cores, f32 accumulation."""
    fmt = get_format(qtype)

    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, 0, bn, k0, bk, compute_dtype)  # [bn, bk]
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            xt = x_ref[:, pl.ds(kx, bk)]  # [16, bk]
            return acc + lax.dot_general(
                xt, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # [16, bn]

        acc = jnp.zeros((NT_PAD, bn), jnp.float32)
        o_ref[...] = tiles.k_steps(k_split // bk, step, acc)

    return kernel


# ----------------------------------------------------------------------------- references


def gemv_int8_reference(
    x: jax.Array,
    planes,
    *,
    qtype: QType,
    n_out: int,
    x_scale: jax.Array | None = None,
    norm_eps: float | None = None,
) -> jax.Array:
    """What gemv_int8 computes, on whole arrays with planes.decode_ints (not the word tricks): the
    same activation quantization (and rounding, TUNING's exact_round) and exact integer sums."""
    x = x.astype(jnp.float32)
    if norm_eps is not None:
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    if x_scale is not None:
        x = x * x_scale.astype(jnp.float32)
    spec = int8_words.SPECS[qtype]
    exact_round = TUNING[qtype].exact_round
    nt, k = x.shape
    g = k // spec.group
    xv = int8_words.x_view(qtype, x)
    q, a, b = decode_ints(qtype, planes, jnp.float32)  # q [Npad, K] (offset applied), a/b [Npad, G]
    q = (q[:n_out] - spec.offset).reshape(
        n_out, g, spec.group
    )  # raw integers, as the kernel multiplies them
    ys = []
    for t in range(nt):
        words, dx, xo, xsum = int8_words.quantize_slots(
            [xv[t, ..., s] for s in range(spec.x_slots)], spec.offset, exact_round
        )
        xq = lax.bitcast_convert_type(jnp.stack(words, axis=0), jnp.int8)  # [S, G, W, 4]
        xq = (
            xq.transpose(1, 2, 3, 0).reshape(g, spec.group).astype(jnp.int32)
        )  # natural order in the group
        s = jnp.einsum("gk,ngk->ng", xq, q, preferred_element_type=jnp.int32).astype(
            jnp.float32
        )  # [N, G]
        y = jnp.sum(a[:n_out] * (s * dx[None, :] + xo[None, :]), axis=-1)
        if b is not None:
            y = y + b[:n_out] @ xsum
        ys.append(y)
    return jnp.stack(ys)


def gemv_float_reference(
    x: jax.Array, planes, *, qtype: QType, n_out: int, x_scale: jax.Array | None = None
) -> jax.Array:
    """What gemv_float computes: whole-matrix decode in the compute dtype + one f32-accumulated
    dot."""
    if x_scale is not None:
        x = x.astype(jnp.float32) * x_scale.astype(jnp.float32)
    return tiles.dequant_matmul_reference(x, planes, qtype=qtype, n_out=n_out)
