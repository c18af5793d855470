"""Decode GEMV: y[nt, N] = x[nt, K] . W[N, K]^T for nt = 1 .. 8, every weight byte read once.

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN.

Grid (Npad / bn, splits). Program (i, s) owns output rows [i*bn, (i+1)*bn) and the K range
[s*K/splits, (s+1)*K/splits); it walks that range in bk steps, decodes the [bn, bk] weight tile
into the compute dtype (f16; bf16 for BF16 weights, f32 for F32) and multiplies it with all the
tokens at once on the tensor cores: x is padded to NT_PAD = 16 rows (the smallest dot the Triton
lowering accepts), so the token loop lives inside the dot, never in the grid, and each weight
byte is read exactly once. Split-K partial sums [splits, 16, Npad] are added by XLA in the
consumer's fusion; splitting pays for the 0.5B shapes, whose 896..4864-row matrices would
otherwise keep only a handful of the 132 SMs busy.

One token (nt == 1) takes one of two CUDA-core paths instead of the dot:
- "grouped" (block formats, quant/group_dot.py): planes viewed as [Npad, K/group, *per_group],
  per-group sums of raw quants times x, then y += A*S + B*X per group. No dequantized tile and
  no reshape: unpacking is broadcasting.
- "fma" (float formats): multiply-add the decoded [bn, bk] f32 tile into an f32 accumulator and
  reduce once at the end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.quant import group_dot
from minfer_jax.quant.planes import QType, get_format

NT_PAD = 16  # x rows fed to the dot: Triton needs >= 16 on every dot side
MAX_NT = 8  # largest token count routed here (ops.GEMV_MAX_NT mirrors it)
TARGET_PROGRAMS = 1024  # ~8 programs per SM on the H200's 132 SMs keep enough loads in flight
# Formats whose one-token GEMV is faster on the CUDA cores (multiply-add into an f32 tile) than
# through the tensor-core dot on the H200 (4096 x 14336 sweep, docs/BENCHMARKS.md).
FMA_FORMATS = frozenset({QType.F32, QType.F16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q2_K, QType.Q3_K,
                         QType.Q4_K, QType.Q6_K})
# One-token GEMVs through the grouped kernel: faster than both other paths on the H200 for these
# (4096 x 14336: Q4_0 882 vs 605 GB/s, Q5_0 910 vs 545, Q4_K 717 vs 547, Q5_K 825 vs 431,
# Q6_K 750 vs 623, Q8_0 1341 vs 1240). Q2_K/Q3_K measured slower grouped; Q4_1/Q5_1 not yet
# measured on the GPU, so they stay on the paths that were.
GROUPED_FORMATS = frozenset({QType.Q8_0, QType.Q4_0, QType.Q5_0, QType.Q4_K, QType.Q5_K, QType.Q6_K})
TILE_ELEMS = 8192  # bn * bk ceiling: decoded tile + int intermediates must fit in registers


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    bn: int
    bk: int
    splits: int
    num_warps: int = 4
    num_stages: int = 1  # Triton's software pipelining of these loads measured 3-5x slower (docs/BENCHMARKS.md)
    fma: bool = False  # nt == 1 only: CUDA-core multiply-add into a [bn, bk] f32 accumulator instead of the dot
    grouped: bool = False  # nt == 1 only, block formats: per-group integer sums (quant/group_dot.py)


def choose_config(qtype: QType, n: int, k: int, nt: int = 1) -> GemvConfig:
    """Block sizes for one weight shape (tuned on the H200; docs/BENCHMARKS.md).

    Decode GEMVs are latency-bound unless enough bytes are in flight: the H200 sweep put the
    optimum near 1000 programs of 32 rows x 256 weights, so small-N shapes split K.
    """
    fmt = get_format(qtype)
    npad = tiles.round_up(n, 128)
    bk = tiles.pow2_divisor(k, 256)
    bn = max(16, min(64, TILE_ELEMS // bk))
    programs = npad // bn
    chunks = k // max(bk, fmt.block)  # K splits must keep whole tiles and whole scale blocks
    splits = max(d for d in range(1, chunks + 1) if chunks % d == 0 and (d == 1 or programs * d <= TARGET_PROGRAMS))
    return GemvConfig(bn=bn, bk=bk, splits=splits, fma=nt == 1 and qtype in FMA_FORMATS,
                      grouped=nt == 1 and qtype in GROUPED_FORMATS)


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
        acc = step(0, acc) if n_k == 1 else lax.fori_loop(0, n_k, step, acc)
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
        acc = step(0, acc) if n_k == 1 else lax.fori_loop(0, n_k, step, acc)
        o_ref[...] = acc

    return fma_kernel if fma else kernel


@functools.cache
def _grouped_kernel(qtype: QType, bn: int, gt: int, n_steps: int):
    """One-token kernel over grouped plane views: acc[bn, gt] += A*S + B*X per step of gt groups."""
    spec = group_dot.SPECS[qtype]

    def kernel(x_ref, xs_ref, *refs):
        *plane_refs, o_ref = refs
        views = dict(zip([n for n, _ in spec.views], plane_refs))
        coarse = dict(zip([n for n, _ in spec.coarse], plane_refs[len(spec.views):]))

        def step(j, acc):
            g0 = j * gt if isinstance(j, int) else pl.multiple_of(j * gt, gt)
            t = {name: views[name][(slice(None), pl.ds(g0, gt)) + (slice(None),) * len(tail)]
                 for name, tail in spec.views}
            rows = lax.iota(jnp.int32, bn)[:, None]
            for name, per in spec.coarse:  # one value per `per` groups: gather it for each group
                cols = ((g0 + lax.iota(jnp.int32, gt)) // per)[None, :]
                t[name] = coarse[name][rows, cols]  # [bn, gt]
            lead = (pl.ds(g0, gt),) + (slice(None),) * (len(spec.x_view) - 1)
            if spec.x_slots:  # one load per slot of the last axis (a loaded tensor cannot be sliced)
                xv = [x_ref[lead + (c,)] for c in range(spec.x_slots)]  # each [gt, *x_view[:-1]]
            else:
                xv = [x_ref[lead + (slice(None),)]]  # [gt, *x_view]
            xs = xs_ref[pl.ds(g0, gt)]  # [gt]
            s, a, b = spec.fn(t, xv)  # [bn, gt] each
            return acc + a * s + b * xs[None, :]

        acc = jnp.zeros((bn, gt), jnp.float32)
        acc = step(0, acc) if n_steps == 1 else lax.fori_loop(0, n_steps, step, acc)
        o_ref[...] = jnp.broadcast_to(jnp.sum(acc, axis=1)[None, :], (NT_PAD, bn))

    return kernel


def _gemv_grouped(x, planes, qtype: QType, cfg: GemvConfig, npad: int, interpret: bool):
    """One token through the grouped kernel: [1, K] -> [splits, 16, Npad] partial sums."""
    spec = group_dot.SPECS[qtype]
    k = x.shape[1]
    n_groups = k // spec.group
    gs = n_groups // cfg.splits  # groups per split
    gt = cfg.bk // spec.group  # groups per step
    assert n_groups % cfg.splits == 0 and gs % gt == 0, (cfg, k)
    assert all(gs % per == 0 for _, per in spec.coarse), (cfg, k)
    gp = group_dot.grouped_planes(qtype, planes)
    xv, xs = group_dot.grouped_x(qtype, x[0])
    tail0 = lambda n: (0,) * n  # noqa: E731
    in_specs = [pl.BlockSpec((gs, *spec.x_view), lambda i, s: (s, *tail0(len(spec.x_view)))),
                pl.BlockSpec((gs,), lambda i, s: (s,))]
    arrays = []
    for name, tail in spec.views:
        arrays.append(gp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, gs, *tail), lambda i, s, n=len(tail): (i, s, *tail0(n))))
    for name, per in spec.coarse:
        arrays.append(gp[name])
        in_specs.append(pl.BlockSpec((cfg.bn, gs // per), lambda i, s: (i, s)))
    return _split_k_call(_grouped_kernel(qtype, cfg.bn, gt, gs // gt), in_specs, (xv, xs, *arrays), cfg, npad,
                         interpret, f"gemv1_{qtype.name.lower()}")


def _split_k_call(kernel, in_specs, operands, cfg: GemvConfig, npad: int, interpret: bool, name: str):
    """Grid (Npad / bn, splits) -> partial sums [splits, 16, Npad] f32 (XLA adds the splits)."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.splits, NT_PAD, npad), jnp.float32),
        grid=(npad // cfg.bn, cfg.splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, NT_PAD, cfg.bn), lambda i, s: (s, 0, i)),
        compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "interpret"))
def gemv(x: jax.Array, planes: dict, *, qtype: QType, n_out: int, config: GemvConfig | None = None,
         interpret: bool = False) -> jax.Array:
    """x [nt, K] (nt <= 8) . W^T -> [nt, n_out] f32, W given as its planes."""
    nt, k = x.shape
    if nt > NT_PAD:
        raise ValueError(f"gemv takes at most {NT_PAD} tokens, got {nt}")
    fmt = get_format(qtype)
    cfg = config or choose_config(qtype, n_out, k, nt)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()
    if cfg.grouped and nt == 1 and qtype in group_dot.SPECS:
        out = _gemv_grouped(x, planes, qtype, cfg, npad, interpret)
    else:
        x16 = tiles.cast_rows(x, NT_PAD, fmt.compute_dtype)  # [16, K]
        in_specs = [pl.BlockSpec((NT_PAD, k_split), lambda i, s: (0, s))]
        in_specs += [pl.BlockSpec((cfg.bn, k_split // p.wpc), lambda i, s: (i, s)) for p in fmt.planes]
        kernel = _kernel(qtype, cfg.bn, cfg.bk, k_split, fmt.compute_dtype, cfg.fma and nt == 1)
        out = _split_k_call(kernel, in_specs, (x16, *arrays), cfg, npad, interpret, f"gemv_{fmt.name.lower()}")
    return out.sum(axis=0)[:nt, :n_out]


# The jnp reference this kernel is tested against: the same decode on the whole matrix, one dot.
gemv_reference = tiles.dequant_matmul_reference
