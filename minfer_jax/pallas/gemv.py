"""Decode GEMV: y[nt, N] = x[nt, K] . W[N, K]^T for nt = 1 .. 8, every weight byte read once.

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN; packed
quants in uint32 words.

Block formats (Q4_0 .. Q6_K) take the integer path (quant/int8_words.py, llama.cpp's MMVQ idea):
x is quantized to int8 with one scale per scale group, for one or two tokens by each step on its
slice of x (in registers: no prepass kernel), for three or more by one XLA fusion before the
kernel (PREQUANT_MIN_NT); then per group S = sum q * xq is computed four weights per
instruction with PTX `dp4a` on the planes' own words (inline asm; an exact jnp emulation in
interpret mode), and y += a * (dx * S + offset term) + b * sum(x). All nt tokens are handled
inside the program (the token loop is unrolled over the same loaded weight words), so each
weight word is read once.
Grid (Npad / bn, splits): program (i, s) owns rows [i*bn, (i+1)*bn) and the s-th K range,
walking it gt groups per step; with the default configs the K range is a single step (no K loop).

Float formats (F32, F16, BF16): one token multiply-adds the decoded [bn, bk] tile into an f32
accumulator ("fma"); more tokens go through a tensor-core dot with x padded to NT_PAD = 16 rows
(the smallest dot the Triton lowering accepts).

Split-K partial sums [splits, rows, Npad] are added by XLA in the consumer's fusion; splitting
pays for the 0.5B shapes, whose 896..4864-row matrices would otherwise keep only a handful of
the 132 SMs busy. (Atomic adds into one zeroed output instead, which saves the reduction in an
isolated call, lowered whole-model decode from 966 to 867 tok/s on the 0.5B: docs/BENCHMARKS.md.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.quant import int8_words
from minfer_jax.quant.planes import QType, get_format

NT_PAD = 16  # x rows fed to the float formats' dot: Triton needs >= 16 on every dot side
MAX_NT = 8  # largest token count routed here (ops.GEMV_MAX_NT mirrors it)
TARGET_PROGRAMS = 1024  # ~8 programs per SM on the H200's 132 SMs keep enough loads in flight
TILE_ELEMS = 8192  # float formats: bn * bk ceiling (decoded tile + intermediates in registers)
# Integer path (block formats; H200, times on the device timeline, tools/kernel_probe.py s9-s11,
# docs/BENCHMARKS.md): every program one straight-line step of INT8_STEP_WEIGHTS weights per row
# (no K loop: all its loads issue at once), K split into as many chunks as that takes (up to
# INT8_MAX_PROGRAMS programs). Rows per program: one token 32 for the 32-weight groups, 16 for the
# 16-weight ones (Q2_K, Q3_K, Q6_K: heavier decode); several tokens 32.
# 4096 x 14336, one token: Q6_K 512 weights per step 20.8 us vs 256: 26.0.
INT8_STEP_WEIGHTS = 512
INT8_BN_ONE_TOKEN = {32: 32, 16: 16}  # group size -> rows per program
INT8_BN_TOKENS = 32
INT8_MAX_PROGRAMS = 16384
# From this token count on, x is quantized by one XLA fusion before the kernel instead of inside
# every program (where each row block re-quantizes the same x, a cost that grows with nt while the
# fusion's ~2-3 us stays fixed). 4096 x 14336 (distinct x per call, device timeline, s11):
# 8 tokens Q4_0 40.2 us vs 55.6 in-kernel, Q4_K 46.1 vs 62.5, Q6_K 44.9 vs 67.1, Q8_0 43.1 vs 49.6,
# Q5_0 43.9 vs 60.6; 2 tokens in-kernel wins: Q4_0 17.5 vs 19.6, Q4_K 21.9 vs 23.2, Q8_0 22.7 vs
# 25.3 (Q6_K 25.5 vs 24.5). One token in the whole model: 0.5B tg128 761 vs 1066 tok/s (one more
# launch per matmul).
PREQUANT_MIN_NT = 3
# Pre-quantized x (nt >= PREQUANT_MIN_NT), 4096 x 14336, 8 tokens (H200, docs/BENCHMARKS.md, vs the
# 2-D tiles of 700604b): formats whose per-group values run as 3-D tiles (Q4_0 33.8 vs 40.1 us,
# Q4_K 35.2 vs 46.1; the others spill: Q5_0 87.8 vs 43.9, Q6_K 122.8 vs 44.8), and tiles that differ
# from the default 32 rows x one step: Q4_0 64 rows (32.5 vs 33.8), Q4_K 4 steps (32.1 vs 35.2).
# Fewer, longer programs only where at least as many programs remain as where they were measured
# (Q4_K 4096 x 14336: 128 row blocks x 7 splits): a 2048-wide matrix (Qwen2.5-3B) would otherwise
# run 64 programs.
PREQUANT_3D = frozenset({QType.Q4_0, QType.Q4_K})
PREQUANT_ROWS = {QType.Q4_0: 64}
PREQUANT_STEPS = {QType.Q4_K: 4}
PREQUANT_MIN_PROGRAMS = 896
# x loaded before the weight tiles (and, in-kernel, quantized before they are decoded), so the x
# loads' latency overlaps the weights' instead of following their decode: format -> from which
# token count on, on the in-kernel path (nt < PREQUANT_MIN_NT). H200, same process, 4096 x 14336
# (docs/bench/gemv_x_first_2026-12-01c.txt): one token Q5_0 15.8 vs 18.9 us, Q5_1 18.4 vs 21.5,
# Q5_K 19.9 vs 22.1, Q6_K 20.1 vs 22.1; two tokens Q4_0 16.9 vs 17.9, Q4_1 18.5 vs 19.4, Q8_0
# 21.1 vs 22.2, Q3_K 22.8 vs 23.4. Not Q4_K (one token 16.1 vs 15.6), Q2_K (15.8 vs 15.1), Q8_0
# at one token (the 0.5B output matrix 151936 x 896: 49.8 vs 41.5 us; 4096 x 14336 equal), Q4_0 /
# Q4_1 at one token (12.7 vs 12.6, 15.1 vs 15.0).
X_FIRST = {QType.Q4_0: 2, QType.Q4_1: 2, QType.Q5_0: 1, QType.Q5_1: 1, QType.Q5_K: 1, QType.Q6_K: 1,
           QType.Q3_K: 1, QType.Q8_0: 2}
# ... and on the pre-quantized path (docs/bench/prequant_x_first.txt): 8 tokens Q4_0 28.0 vs 32.8 us,
# Q4_1 33.5 vs 36.7, Q6_K 38.8 vs 43.8, Q4_K 32.1 vs 32.5; 3 tokens Q4_0 20.6 vs 22.7, Q6_K 27.6 vs
# 28.6, but Q4_K 25.3 vs 24.8 (so Q4_K only at 8, Q4_1 only where measured); not Q5_0 (8 tokens
# 36.1 vs 35.7), Q8_0 (49.6 vs 45.6), Q5_1, Q5_K, Q2_K (51.1 vs 43.8), Q3_K (40.1 vs 40.6: noise).
PREQUANT_X_FIRST = {QType.Q4_0: 3, QType.Q6_K: 3, QType.Q4_1: 8, QType.Q4_K: 8}


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    bn: int
    bk: int  # weights per step (integer path: groups per step * group)
    splits: int
    num_warps: int = 4
    num_stages: int = 1  # Triton's software pipelining of these loads measured slower (docs/BENCHMARKS.md)
    fma: bool = False  # float formats, nt == 1: CUDA-core multiply-add into a [bn, bk] f32 accumulator
    prequant: bool = False  # integer path: x quantized by XLA before the kernel (int8_words.quantize_x)
    x_first: bool = False  # integer path: x loaded (and quantized) before the weights are decoded


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(chunks: int, programs: int) -> int:
    """The K split (a divisor of chunks) whose program count lands nearest TARGET_PROGRAMS (in
    ratio): a prime chunk count may overshoot rather than leave the GPU idle (measured when the
    integer path used this rule too: Q6_K 896 x 4864, 19 splits 21 us vs unsplit 40 us)."""
    return min(_divisors(chunks), key=lambda d: (abs(math.log(programs * d / TARGET_PROGRAMS)), d))


def _one_step_splits(chunks: int, row_programs: int) -> int:
    """Integer path: the K split that gives every program a single step (no K loop: straight-line
    code whose loads all issue at once), capped at INT8_MAX_PROGRAMS (then the largest divisor
    of chunks under the cap)."""
    return max((d for d in _divisors(chunks) if row_programs * d <= INT8_MAX_PROGRAMS), default=1)


def choose_config(qtype: QType, n: int, k: int, nt: int = 1) -> GemvConfig:
    """Block sizes for one weight shape (tuned on the H200; docs/BENCHMARKS.md).

    Decode GEMVs are latency-bound unless enough bytes are in flight. Integer path: every program
    one straight-line step, as many programs as that takes (up to INT8_MAX_PROGRAMS). Float
    formats: K split to ~TARGET_PROGRAMS programs.
    """
    npad = tiles.round_up(n, 128)
    if qtype in int8_words.SPECS:
        group = int8_words.SPECS[qtype].group
        gt = tiles.pow2_divisor(k // group, INT8_STEP_WEIGHTS // group)
        prequant = nt >= PREQUANT_MIN_NT
        bn = INT8_BN_ONE_TOKEN[group] if nt == 1 else INT8_BN_TOKENS
        chunks, steps = k // (gt * group), 1
        if prequant:
            rows = PREQUANT_ROWS.get(qtype, bn)
            if (npad // rows) * chunks >= PREQUANT_MIN_PROGRAMS:
                bn = rows
            steps = tiles.pow2_divisor(chunks, PREQUANT_STEPS.get(qtype, 1))
            while steps > 1 and (npad // bn) * (chunks // steps) < PREQUANT_MIN_PROGRAMS:
                steps //= 2
        splits = _one_step_splits(chunks // steps, npad // bn)
        x_first = nt >= (PREQUANT_X_FIRST if prequant else X_FIRST).get(qtype, MAX_NT + 1)
        return GemvConfig(bn=bn, bk=gt * group, splits=splits, prequant=prequant, x_first=x_first)
    bk = tiles.pow2_divisor(k, 256)
    bn = max(16, min(64, TILE_ELEMS // bk))
    return GemvConfig(bn=bn, bk=bk, splits=_splits(k // bk, npad // bn), fma=nt == 1)


def _dp4a(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """c + dot of the four signed bytes of a and b, per element (PTX dp4a; GPU only)."""
    from jax.experimental.pallas import triton as pltriton

    [r] = pltriton.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                          pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return r


@functools.cache
def _kernel(qtype: QType, bn: int, bk: int, k_split: int, compute_dtype, fma: bool):
    """One kernel closure per configuration (jax#40847: a shared function object can reuse a trace)."""
    fmt = get_format(qtype)
    n_k = k_split // bk

    def fma_kernel(x_ref, *refs):
        # One token: y[n] = sum_k w[n, k] x[k]. Multiply-add into a [bn, bk] accumulator (no
        # per-step reduction, no operand layout change for a dot); reduce once at the end.
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, 0, bn, k0, bk, jnp.float32)  # [bn, bk]
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            return acc + w * x_ref[pl.ds(0, 1), pl.ds(kx, bk)].astype(jnp.float32)  # [bn, bk]

        acc = jnp.zeros((bn, bk), jnp.float32)
        acc = tiles.k_steps(n_k, step, acc)
        o_ref[...] = jnp.broadcast_to(jnp.sum(acc, axis=1)[None, :], (NT_PAD, bn))

    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, 0, bn, k0, bk, compute_dtype)  # [bn, bk]
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            xt = x_ref[:, pl.ds(kx, bk)]  # [16, bk]
            return acc + lax.dot_general(xt, w, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)  # [16, bn]

        acc = jnp.zeros((NT_PAD, bn), jnp.float32)
        acc = tiles.k_steps(n_k, step, acc)
        o_ref[...] = acc

    return fma_kernel if fma else kernel


@functools.cache
def _int8_kernel(qtype: QType, ntp: int, bn: int, gt: int, n_steps: int, emulate: bool, prequant: bool,
                 scaled: bool, x_first: bool):
    """Integer path: per step of gt groups, acc[t] [bn, gt] += a * (dx * S + xo) + b * xs for each token t.

    x arrives as f32 (quantized here, per step and token; with `scaled` times a per-input scale
    of the same view, e.g. a folded RMSNorm weight) or, with `prequant`, already quantized by
    quant.int8_words.quantize_x (words + scales). With `x_first` (X_FIRST, PREQUANT_X_FIRST) x is
    loaded before the weight tiles (and quantized before they are decoded). Coarse planes (one
    value per `per` groups, e.g. a K-quant's d) arrive as whole rows and are gathered at absolute
    group numbers, so a K split need not align to their columns (loading only a program's own
    columns as a block measured no faster: Q4_K 16.2 vs 16.4 us, Q6_K equal).

    Per-group values (fields, x scales, S, accumulators) are [bn, gt] tiles, or [bn, gt, 1]
    (meeting the words by size-1 broadcasts; PREQUANT_3D formats when x comes pre-quantized, see
    _tile_shapes, which also says when one-word quant views are [bn, gt] too). Measured on
    the H200 (docs/BENCHMARKS.md): 3-D tiles lift Q4_0 / Q4_K there (8 tokens, 4096 x 14336: Q4_K
    35.2 vs 40.7 us), spill registers for the other formats and slow the in-kernel path (one
    token: Q5_0 22.0 vs 19.3, Q6_K 25.6 vs 22.3). S goes to f32 by a conversion
    instruction (exact int -> f32 by the 1.5 * 2^23 trick measured no faster there: Q5_0 19.48 vs
    19.24 us)."""
    spec = int8_words.SPECS[qtype]
    dot4 = int8_words.dp4a_emulated if emulate else _dp4a
    dims3, flat = _tile_shapes(qtype, prequant)
    col = (lambda v: v[:, :, None]) if dims3 else (lambda v: v)  # [r, gt] -> per-group shape

    def kernel(*refs):
        *in_refs, o_ref = refs
        n_x = 2 if prequant or scaled else 1  # x: f32 view (+ its scale), or quantized words + scales
        x_refs, plane_refs = in_refs[:n_x], in_refs[n_x:]
        views = dict(zip([n for n, _ in spec.views], plane_refs))
        coarse = dict(zip([n for n, _ in spec.coarse], plane_refs[len(spec.views):]))

        split_g0 = pl.program_id(1) * (n_steps * gt)  # this split's first group

        def load_x(tok, g0):  # this token's x for these groups, as stored
            if prequant:
                xw_ref, xsc_ref = x_refs
                if dims3:  # the token axis kept: x broadcasts over the rows as loaded
                    t1 = pl.ds(tok, 1)
                    words = [xw_ref[t1, pl.ds(g0, gt), slot, :] for slot in range(spec.x_slots)]
                    return (words, *(xsc_ref[t1, c, pl.ds(g0, gt), :] for c in range(3)))
                # 2-D tiles: [1, gt, ...] slices measured far slower for Q8_0 (248 vs 43 us)
                words = [xw_ref[tok, pl.ds(g0, gt), slot, :][None] for slot in range(spec.x_slots)]
                return (words, *(xsc_ref[tok, c, pl.ds(g0, gt), 0][None] for c in range(3)))
            # one load per slot: [gt, x_words, 4] f32 each
            xs = [x_refs[0][tok, pl.ds(g0, gt), :, :, slot] for slot in range(spec.x_slots)]
            if scaled:
                xs = [v * x_refs[1][0, pl.ds(g0, gt), :, :, slot] for slot, v in enumerate(xs)]
            return xs

        def token_x(raw):  # -> (x words per slot [1, gt, x_words], dx, xo, xsum [1, gt(, 1)])
            if prequant:
                return raw
            words, dx, xo, xsum = int8_words.quantize_slots(raw, spec.offset, spec.exact_round)
            return [w[None] for w in words], dx[None], xo[None], xsum[None]

        def step(j, accs):
            g0 = j * gt if isinstance(j, int) else pl.multiple_of(j * gt, gt)
            x_raw = [load_x(tok, g0) for tok in range(ntp)] if x_first else None
            t = {name: views[name][(slice(None), pl.ds(g0, gt)) + (slice(None),) * len(tail)]
                 for name, tail in spec.view_tails(dims3, flat)}  # [bn, gt, *tail]
            groups = col((split_g0 + g0 + lax.iota(jnp.int32, gt))[None, :])  # [1, gt(, 1)] absolute
            rows = col(lax.iota(jnp.int32, bn)[:, None])
            for name, per in spec.coarse:  # one value per `per` groups: gather it for each group
                t[name] = coarse[name][rows, groups // per]  # [bn, gt(, 1)]
            xq = [token_x(raw) for raw in x_raw] if x_first else None
            words, a, b = spec.fn(t, groups % 2)  # words: x_slots x [bn, gt, x_words]; a, b [bn, gt(, 1)]
            out = []
            for tok in range(ntp):  # the weight words above serve every token
                xw, dx, xo, xsum = xq[tok] if x_first else token_x(load_x(tok, g0))  # [1, gt(, x_words)]
                s = jnp.zeros(words[0].shape, jnp.int32)
                for w, x in zip(words, xw):
                    s = dot4(w, jnp.broadcast_to(x, w.shape), s)
                v = jnp.sum(s, axis=-1, keepdims=dims3).astype(jnp.float32) * dx  # [bn, gt(, 1)]
                if spec.offset:
                    v = v + xo
                v = a * v
                if b is not None:
                    v = v + b * xsum
                out.append(accs[tok] + v)
            return tuple(out)

        accs = tuple(jnp.zeros((bn, gt, 1) if dims3 else (bn, gt), jnp.float32) for _ in range(ntp))
        accs = tiles.k_steps(n_steps, step, accs)
        for tok in range(ntp):
            acc = jnp.sum(accs[tok], axis=2) if dims3 else accs[tok]
            o_ref[tok, :] = jnp.sum(acc, axis=1)

    return kernel


def _tile_shapes(qtype: QType, prequant: bool) -> tuple[bool, bool]:
    """(dims3, flat): per-group values as [bn, gt, 1] tiles (PREQUANT_3D formats, pre-quantized x);
    one-word quant views (Q2_K, Q3_K) as [bn, gt] on the other pre-quantized kernels (8 tokens:
    Q3_K 40.8 vs 65.7 us as [bn, gt, 1]; one token keeps [bn, gt, 1]: Q3_K 17.4 vs 22.0)."""
    dims3 = prequant and qtype in PREQUANT_3D
    return dims3, prequant and not dims3


def _row_block_index(n_tail: int, i, s):
    return (i, s) + (0,) * n_tail


def _gemv_int8(x, x_scale, planes, qtype: QType, cfg: GemvConfig, npad: int, interpret: bool):
    """x [nt, K] (times x_scale [K] if given) through the integer path -> partial sums
    [splits, ntp, Npad] (ntp = nt rounded up to 2^i)."""
    spec = int8_words.SPECS[qtype]
    nt, k = x.shape
    ntp = 1 << (nt - 1).bit_length()
    n_groups = k // spec.group
    gs = n_groups // cfg.splits  # groups per split
    gt = cfg.bk // spec.group  # groups per step
    assert n_groups % cfg.splits == 0 and gs % gt == 0, (cfg, k)
    x = jnp.pad(x, ((0, ntp - nt), (0, 0)))
    scaled = x_scale is not None and not cfg.prequant  # scale x inside the kernel, as it is loaded
    if cfg.prequant:
        xw, xsc = int8_words.quantize_x(qtype, x if x_scale is None else x * x_scale)  # one XLA fusion
        x_ops = (xw, xsc)  # [ntp, G, x_slots, x_words] int32, [ntp, 4, G, 1] f32
        in_specs = [pl.BlockSpec((ntp, gs, spec.x_slots, spec.x_words), lambda i, s: (0, s, 0, 0)),
                    pl.BlockSpec((ntp, 4, gs, 1), lambda i, s: (0, 0, s, 0))]
    else:
        x_ops = (int8_words.x_view(qtype, x),)  # [ntp, G, x_words, 4, x_slots]
        in_specs = [pl.BlockSpec((ntp, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))]
        if scaled:
            x_ops += (int8_words.x_view(qtype, x_scale[None]),)  # [1, G, x_words, 4, x_slots]
            in_specs.append(pl.BlockSpec((1, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0)))
    dims3, flat = _tile_shapes(qtype, cfg.prequant)
    wp = int8_words.word_planes(qtype, planes, dims3=dims3, flat_words=flat)
    arrays = []
    for name, tail in spec.view_tails(dims3, flat):
        arrays.append(wp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, gs, *tail), functools.partial(_row_block_index, len(tail))))
    for name, _ in spec.coarse:  # whole rows (n_groups / per columns): indexed by absolute group
        arrays.append(wp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, wp[name].shape[1]), lambda i, s: (i, 0)))
    kernel = _int8_kernel(qtype, ntp, cfg.bn, gt, gs // gt, interpret, cfg.prequant, scaled, cfg.x_first)
    return _split_k_call(kernel, in_specs, (*x_ops, *arrays), cfg, npad, ntp, interpret,
                         f"gemv_int8_{qtype.name.lower()}")


def _split_k_call(kernel, in_specs, operands, cfg: GemvConfig, npad: int, rows: int, interpret: bool, name: str):
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


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "interpret"))
def gemv(x: jax.Array, planes: dict, *, qtype: QType, n_out: int, x_scale: jax.Array | None = None,
         config: GemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """(x [nt, K] (nt <= 8) * x_scale [K]) . W^T -> [nt, n_out] f32, W given as its planes.

    x_scale (optional, f32 [K]) multiplies x per input feature (a folded RMSNorm weight: ops.py):
    inside the kernel as x is loaded where the kernel quantizes x itself (integer path, nt <
    PREQUANT_MIN_NT), else in the XLA fusion that prepares x."""
    nt, k = x.shape
    if not 1 <= nt <= NT_PAD:
        raise ValueError(f"gemv takes 1 .. {NT_PAD} tokens, got {nt}")
    fmt = get_format(qtype)
    cfg = config or choose_config(qtype, n_out, k, nt)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()
    if x_scale is not None:
        x_scale = x_scale.astype(jnp.float32)
    if qtype in int8_words.SPECS:
        out = _gemv_int8(x, x_scale, planes, qtype, cfg, npad, interpret)
    else:
        xs = x if x_scale is None else x * x_scale  # fused into the cast below
        x16 = tiles.cast_rows(xs, NT_PAD, fmt.compute_dtype)  # [16, K]
        in_specs = [pl.BlockSpec((NT_PAD, k_split), lambda i, s: (0, s))]
        in_specs += [pl.BlockSpec((cfg.bn, k_split // p.wpc), lambda i, s: (i, s)) for p in fmt.planes]
        kernel = _kernel(qtype, cfg.bn, cfg.bk, k_split, fmt.compute_dtype, cfg.fma and nt == 1)
        out = _split_k_call(kernel, in_specs, (x16, *arrays), cfg, npad, NT_PAD, interpret, f"gemv_{fmt.name.lower()}")
    return out.sum(axis=0)[:nt, :n_out]


def gemv_reference(x: jax.Array, planes, *, qtype: QType, n_out: int, x_scale: jax.Array | None = None) -> jax.Array:
    """The jnp reference of exactly what gemv computes: for block formats the integer formulation
    on whole arrays (same activation quantization, exact integer sums), else the float decode +
    one f32-accumulated dot."""
    if x_scale is not None:
        x = x.astype(jnp.float32) * x_scale.astype(jnp.float32)
    if qtype in int8_words.SPECS:
        return int8_words.int8_dot_reference(x, planes, qtype=qtype, n_out=n_out)
    return tiles.dequant_matmul_reference(x, planes, qtype=qtype, n_out=n_out)
