"""Decode GEMV: y[nt, N] = x[nt, K] . W[N, K]^T for nt = 1 .. 16 (routed here: up to
ops.Impl.gemv_max_nt, 8 by default), every weight byte read once.

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
    "gemv_int8_group",
    "gemv_int8_reference",
    "groupable",
]

_STATIC = ("qtype", "n_out", "config", "deterministic", "partials", "interpret")
_STATIC_INT8 = (*_STATIC, "norm_eps", "precise")
_STATIC_GROUP = (
    "qtypes",
    "n_outs",
    "configs",
    "norm_eps",
    "deterministic",
    "precise",
    "partials",
    "interpret",
)


@functools.partial(jax.jit, static_argnames=_STATIC_INT8)
def gemv_int8(
    x: jax.Array,
    planes: dict,
    *,
    qtype: QType,
    n_out: int,
    x_scale: jax.Array | None = None,
    row_sumsq: jax.Array | None = None,
    norm_eps: float | None = None,
    config: GemvConfig | None = None,
    deterministic: bool = False,
    precise: bool = False,
    partials: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Block formats: (x [nt, K] (nt <= 16) * x_scale [K]) . W^T -> [nt, n_out] f32, W as its
    planes; partials: the split-K partial sums [splits, pow2(nt), Npad] unadded (for a consumer
    kernel that adds them itself: decode_qkv, split_sums).

    x_scale (optional, f32 [K]) multiplies x per input feature (a folded RMSNorm weight: ops.py),
    inside the kernel as x is loaded where the kernel quantizes x itself, else in the XLA fusion
    that quantizes x before it. norm_eps: x is an RMSNorm's input (x_scale its weight) and each
    token's x is multiplied by rsqrt(mean(x^2) + norm_eps) too: from row_sumsq (f32 [nt, C],
    pieces of each row's sum of squares: split_sums.add_partials' or one XLA reduce's) where
    given, else computed by every program from x's whole row.
    deterministic: each row's result does not depend on nt (one config for all, choose_config;
    split-K partials added in a fixed order). precise: x in gemv_tuning.PRECISE_X_TERMS int8
    terms (choose_config). Both apply where config is None."""
    [out] = gemv_int8_group(
        x,
        (planes,),
        qtypes=(qtype,),
        n_outs=(n_out,),
        x_scale=x_scale,
        row_sumsq=row_sumsq,
        norm_eps=norm_eps,
        configs=None if config is None else (config,),
        deterministic=deterministic,
        precise=precise,
        partials=partials,
        interpret=interpret,
    )
    return out


@functools.partial(jax.jit, static_argnames=_STATIC_GROUP)
def gemv_int8_group(
    x: jax.Array,
    planes: tuple[dict, ...],
    *,
    qtypes: tuple[QType, ...],
    n_outs: tuple[int, ...],
    x_scale: jax.Array | None = None,
    row_sumsq: jax.Array | None = None,
    norm_eps: float | None = None,
    configs: tuple[GemvConfig, ...] | None = None,
    deterministic: bool = False,
    precise: bool = False,
    partials: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """gemv_int8 of the same x through several block-format weights (of any formats, the same K)
    in one launch: the grid's row blocks are the weights' row blocks one after another, and each
    program runs its weight's format (one branch per weight). -> one result per weight, as
    gemv_int8's (deterministic, precise: as there, where configs is None). Their configs must
    share the K split and compiler settings (groupable)."""
    nt, k = x.shape
    cfgs = configs or tuple(
        choose_config(q, n, k, nt, deterministic, precise) for q, n in zip(qtypes, n_outs)
    )
    if not groupable(cfgs):
        raise ValueError(f"one GEMV launch needs one K split and compiler setting, got {cfgs}")
    npads = [_prologue(x, p, q, c) for p, q, c in zip(planes, qtypes, cfgs)]
    if x_scale is not None:
        x_scale = x_scale.astype(jnp.float32)
    ntp = pow2_at_least(nt)
    x = jnp.pad(x, ((0, ntp - nt), (0, 0)))
    if row_sumsq is not None:
        assert norm_eps is not None, "row_sumsq is the norm's: norm_eps goes with it"
        pieces = row_sumsq.shape[1]  # read as one vector: a power of two (Triton tensors)
        row_sumsq = jnp.pad(
            row_sumsq.astype(jnp.float32), ((0, ntp - nt), (0, pow2_at_least(pieces) - pieces))
        )
    members = [
        _int8_member(x, p, q, c, x_scale, row_sumsq, norm_eps, interpret)
        for p, q, c in zip(planes, qtypes, cfgs)
    ]
    row_blocks = [npad // c.bn for npad, c in zip(npads, cfgs)]
    starts = [sum(row_blocks[:m]) for m in range(len(members))]
    in_specs, operands, out_specs = [], [], []
    split_major = cfgs[0].split_major
    for (ops_m, specs_m, _), start, blocks, c in zip(members, starts, row_blocks, cfgs):
        local = functools.partial(_local_block, start, blocks, len(members) > 1)
        operands += ops_m
        in_specs += [_shifted(spec, local, split_major) for spec in specs_m]
        out_spec = pl.BlockSpec((None, ntp, c.bn), lambda i, s, f=local: (s, 0, f(i)))
        out_specs.append(_shifted(out_spec, lambda i: i, split_major))
    n_refs = [len(ops_m) for ops_m, _, _ in members]
    bodies = [body for _, _, body in members]
    kernel = (
        bodies[0]
        if len(members) == 1 and not split_major
        else _branch_kernel(tuple(bodies), tuple(n_refs), tuple(starts), split_major)
    )
    grid = (sum(row_blocks), cfgs[0].splits)
    name = "gemv_int8_" + "+".join(q.name.lower() for q in qtypes)
    outs = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((cfgs[0].splits, ntp, npad), jnp.float32) for npad in npads
        ],
        grid=grid[::-1] if split_major else grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=tiles.compiler_params(cfgs[0].num_warps, cfgs[0].num_stages),
        interpret=interpret,
        name=name,
    )(*operands)
    if partials:
        return tuple(outs)
    return tuple(tiles.sum_splits(o, 0, deterministic)[:nt, :n] for o, n in zip(outs, n_outs))


def groupable(configs) -> bool:
    """Whether GEMVs of these configs can share one launch: one K split (the grid's second axis)
    and one num_warps / num_stages / grid order (per launch)."""
    return len({(c.splits, c.num_warps, c.num_stages, c.split_major) for c in configs}) == 1


def _int8_member(x, planes, qtype: QType, cfg: GemvConfig, x_scale, row_sumsq, norm_eps, interpret):
    """One weight's share of a gemv_int8_group launch: (its operands, x's then the planes', their
    BlockSpecs with the row block numbered from 0, the kernel body (*its refs, its output ref))."""
    spec = int8_words.SPECS[qtype]
    ntp, k = x.shape
    n_groups = k // spec.group
    gs = n_groups // cfg.splits  # groups per split
    gt = cfg.bk // spec.group  # groups per step
    assert n_groups % cfg.splits == 0 and gs % gt == 0, (cfg, k)
    tuning = row(qtype)
    block = gemv_int8_kernel.Block(qtype, ntp, cfg.bn, gt, gs // gt)
    dot4 = int8_words.dp4a_emulated if interpret else int8_words.dp4a_ptx
    perm = int8_words.prmt_emulated if interpret else int8_words.prmt_ptx
    if cfg.prequant:
        assert cfg.x_terms == 1, "x quantized before the kernel comes in one term"
        xs = x if norm_eps is None else x * _norm_rsqrt(x, row_sumsq, norm_eps)
        xw, xsc = int8_words.quantize_x(
            qtype, xs if x_scale is None else xs * x_scale, tuning.exact_round
        )  # one XLA fusion
        operands = [xw, xsc]  # [ntp, G, x_slots, x_words] int32, [ntp, 4, G, 1] f32
        in_specs = [
            pl.BlockSpec((ntp, gs, spec.x_slots, spec.x_words), lambda i, s: (0, s, 0, 0)),
            pl.BlockSpec((ntp, 4, gs, 1), lambda i, s: (0, 0, s, 0)),
        ]
        dims3, flat = tuning.tile_shapes(prequant=True)
        body = gemv_int8_kernel.prequantized_x_kernel(block, dims3, dot4, cfg.x_first, perm)
    else:
        operands = [int8_words.x_view(qtype, x)]  # [ntp, G, x_words, 4, x_slots]
        in_specs = [
            pl.BlockSpec((ntp, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))
        ]
        if x_scale is not None:  # scaled inside the kernel, as x is loaded
            operands.append(int8_words.x_view(qtype, x_scale[None]))  # [1, G, x_words, 4, x_slots]
            in_specs.append(
                pl.BlockSpec((1, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))
            )
        norm = None if norm_eps is None else (k, float(norm_eps))
        if row_sumsq is not None:  # the rows' sums of squares in pieces, one vector per token
            operands.append(row_sumsq)
            in_specs.append(pl.BlockSpec(row_sumsq.shape, lambda i, s: (0, 0)))
        elif norm_eps is not None:  # whole rows, for the norm's sum of squares
            operands.append(x.astype(jnp.float32))
            in_specs.append(pl.BlockSpec((ntp, k), lambda i, s: (0, 0)))
        dims3, flat = tuning.tile_shapes(prequant=False)
        body = gemv_int8_kernel.in_kernel_x_kernel(
            block,
            tuning.exact_round,
            x_scale is not None,
            dot4,
            cfg.x_first,
            norm,
            0 if row_sumsq is None else row_sumsq.shape[1],
            cfg.x_terms,
            perm,
        )
    wp = int8_words.word_planes(qtype, planes, dims3=dims3, flat_words=flat)
    for name, tail in spec.view_tails(dims3, flat):
        operands.append(wp[name])
        in_specs.append(
            pl.BlockSpec((cfg.bn, gs, *tail), functools.partial(_row_block_index, len(tail)))
        )
    for name, _ in spec.coarse:  # whole rows (n_groups / per columns): indexed by absolute group
        operands.append(wp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, wp[name].shape[1]), lambda i, s: (i, 0)))
    return operands, in_specs, body


def _local_block(start: int, blocks: int, clamp: bool, i):
    """A grouped launch's row block i as its weight's own row block (clamped into range for the
    other weights' programs, which only compute the block's address, never touch it)."""
    if not clamp:
        return i
    return jnp.clip(i - start, 0, blocks - 1)


def _shifted(spec: pl.BlockSpec, local, split_major: bool) -> pl.BlockSpec:
    """spec with its index map reading the row block through `local` (and the grid's axes
    swapped with split_major)."""
    index_map = spec.index_map
    if split_major:
        return pl.BlockSpec(spec.block_shape, lambda s, i: index_map(local(i), s))
    return pl.BlockSpec(spec.block_shape, lambda i, s: index_map(local(i), s))


@functools.cache
def _branch_kernel(bodies: tuple, n_refs: tuple, starts: tuple, split_major: bool):
    """One program of a grouped launch: the body of the weight its row block belongs to (with
    one body, a split-major grid's program ids read in their order)."""

    def kernel(*refs):
        n_in = sum(n_refs)
        ins, outs = refs[:n_in], refs[n_in:]
        i, split = pl.program_id(0), pl.program_id(1)  # read here: the interpreter needs it
        if split_major:
            i, split = split, i
        if len(bodies) == 1:
            return bodies[0](*ins, outs[0], split=split)
        for m, body in enumerate(bodies):
            first = sum(n_refs[:m])
            if m == 0:
                inside = i < starts[1]
            elif m + 1 == len(bodies):
                inside = i >= starts[m]
            else:
                inside = (i >= starts[m]) & (i < starts[m + 1])
            pl.when(inside)(
                functools.partial(body, *ins[first : first + n_refs[m]], outs[m], split=split)
            )

    return kernel


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
    cfg = config or choose_config(qtype, n_out, x.shape[1], x.shape[0], deterministic)
    npad = _prologue(x, planes, qtype, cfg)
    fmt = get_format(qtype)
    nt, k = x.shape
    k_split = k // cfg.splits
    xs = x if x_scale is None else x * x_scale.astype(jnp.float32)  # fused into the cast below
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


def _prologue(x, planes, qtype: QType, cfg: GemvConfig) -> int:
    """What both families check first (token count, blocks against the shapes) -> padded rows."""
    nt, k = x.shape
    if not 1 <= nt <= NT_PAD:
        raise ValueError(f"gemv takes 1 .. {NT_PAD} tokens, got {nt}")
    npad = tiles.plane_arrays(get_format(qtype), planes)[0].shape[0]
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()
    return npad


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
    row_sumsq: jax.Array | None = None,
    norm_eps: float | None = None,
    x_terms: int = 1,
) -> jax.Array:
    """What gemv_int8 computes, on whole arrays with planes.decode_ints (not the word tricks): the
    same activation quantization (and rounding, TUNING's exact_round; in x_terms int8 terms, as
    GemvConfig.x_terms) and exact integer sums."""
    x = x.astype(jnp.float32)
    if norm_eps is not None:
        x = x * _norm_rsqrt(x, row_sumsq, norm_eps)
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
        terms, xo, xsum = int8_words.quantize_slot_terms(
            [xv[t, ..., s] for s in range(spec.x_slots)], spec.offset, exact_round, x_terms
        )
        sdx = 0.0
        for words, dx in terms:
            xq = lax.bitcast_convert_type(jnp.stack(words, axis=0), jnp.int8)  # [S, G, W, 4]
            xq = (
                xq.transpose(1, 2, 3, 0).reshape(g, spec.group).astype(jnp.int32)
            )  # natural order in the group
            s = jnp.einsum("gk,ngk->ng", xq, q, preferred_element_type=jnp.int32).astype(
                jnp.float32
            )  # [N, G]
            sdx = sdx + s * dx[None, :]
        y = jnp.sum(a[:n_out] * (sdx + xo[None, :]), axis=-1)
        if b is not None:
            y = y + b[:n_out] @ xsum
        ys.append(y)
    return jnp.stack(ys)


def _norm_rsqrt(x: jax.Array, row_sumsq: jax.Array | None, eps: float) -> jax.Array:
    """[nt, 1]: rsqrt(mean(x^2) + eps) per row, the sum of squares from row_sumsq's pieces where
    given."""
    k = x.shape[-1]
    if row_sumsq is None:
        return lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    total = jnp.sum(row_sumsq, axis=-1, keepdims=True)
    return lax.rsqrt(total * jnp.float32(1.0 / k) + jnp.float32(eps))


def gemv_float_reference(
    x: jax.Array, planes, *, qtype: QType, n_out: int, x_scale: jax.Array | None = None
) -> jax.Array:
    """What gemv_float computes: whole-matrix decode in the compute dtype + one f32-accumulated
    dot."""
    if x_scale is not None:
        x = x.astype(jnp.float32) * x_scale.astype(jnp.float32)
    return tiles.dequant_matmul_reference(x, planes, qtype=qtype, n_out=n_out)
