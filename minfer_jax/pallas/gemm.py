"""Prefill GEMM: y[M, N] = x[M, K] . W[N, K]^T for M >= 9 tokens, weight tiles dequantized in-kernel.

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN; x is padded
by the wrapper to a multiple of bm rows (prefill buckets are powers of two, so usually it is).

Grid (Mpad / bm, Npad / bn), the token axis fastest so that programs running together share a
weight tile (decoded from L2 rather than HBM). Each program walks K in bk steps: the x tile
[bm, bk] and the weight tile decoded into the compute dtype [bn, bk] meet in one tensor-core dot
with f32 accumulation. No dequantized copy of the weights ever exists outside registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.quant.planes import QType, get_format


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int = 8
    num_stages: int = 2


# Tiles from the H200 sweep at 512 x 4096 x 14336 (tools/kernel_probe.py gemm, docs/BENCHMARKS.md):
# Q4_0 bk 64 with 3 pipeline stages 196 TFLOP/s (2 stages: 136; bk 128: 184); Q4_K bk 128 with
# 2 stages 151 (bk 64: 104, 3 stages: 121). Super-block formats decode a whole 256-block's
# scales per tile, so the wider K step pays for them; bn 256 or bm 256 were 30-50% slower.
SMALL_BLOCK_TILE = (64, 3)  # (bk, num_stages) for the 32-weight block formats
SUPERBLOCK_TILE = (128, 2)  # (bk, num_stages) for the K-quants (256-weight super-blocks)
FLOAT_TILE = (64, 2)  # F32/F16/BF16: not re-swept; 3 stages of f32 tiles would crowd shared memory


def choose_config(qtype: QType, m: int, n: int, k: int) -> GemmConfig:
    """Tile sizes for one GEMM shape (tuned on the H200; docs/BENCHMARKS.md)."""
    bm = min(128, max(16, tiles.pow2_divisor(tiles.round_up(m, 16), 128)))
    block = get_format(qtype).block
    bk_max, stages = SUPERBLOCK_TILE if block == 256 else SMALL_BLOCK_TILE if block == 32 else FLOAT_TILE
    return GemmConfig(bm=bm, bn=128, bk=tiles.pow2_divisor(k, bk_max), num_stages=stages)


@functools.cache
def _kernel(qtype: QType, bm: int, bn: int, bk: int, k: int, compute_dtype):
    """One kernel closure per configuration (jax#40847: a shared function object can reuse a trace)."""
    fmt = get_format(qtype)
    n_k = k // bk

    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w = tiles.load_weight_tile(fmt, plane_refs, 0, bn, k0, bk, compute_dtype)  # [bn, bk]
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            xt = x_ref[:, pl.ds(kx, bk)]  # [bm, bk]
            return acc + lax.dot_general(xt, w, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)  # [bm, bn]

        acc = jnp.zeros((bm, bn), jnp.float32)
        o_ref[...] = tiles.k_steps(n_k, step, acc)

    return kernel


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "interpret"))
def gemm(x: jax.Array, planes: dict, *, qtype: QType, n_out: int, config: GemmConfig | None = None,
         interpret: bool = False) -> jax.Array:
    """x [M, K] . W^T -> [M, n_out] f32, W given as its planes."""
    m, k = x.shape
    fmt = get_format(qtype)
    cfg = config or choose_config(qtype, m, n_out, k)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    mpad = tiles.round_up(m, cfg.bm)
    assert npad % cfg.bn == 0 and k % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()

    xp = tiles.cast_rows(x, mpad, fmt.compute_dtype)  # [Mpad, K]
    kernel = _kernel(qtype, cfg.bm, cfg.bn, cfg.bk, k, fmt.compute_dtype)
    out = tiled_call(kernel, [xp], arrays, fmt, cfg.bm, cfg.bn, cfg.num_warps, cfg.num_stages, interpret,
                     f"gemm_{fmt.name.lower()}")
    return out[:m, :n_out]


def tiled_call(kernel, token_inputs, plane_arrays, fmt, bm: int, bn: int, num_warps: int, num_stages: int,
               interpret: bool, name: str) -> jax.Array:
    """Grid (Mpad / bm, Npad / bn), token blocks fastest: token-side inputs [Mpad, cols] blocked by
    rows, planes blocked by weight rows, output [Mpad, Npad] f32. Shared by both GEMM variants."""
    mpad, npad = token_inputs[0].shape[0], plane_arrays[0].shape[0]
    k = plane_arrays[0].shape[1] * fmt.planes[0].wpc
    in_specs = [pl.BlockSpec((bm, t.shape[1]), lambda i, j: (i, 0)) for t in token_inputs]
    in_specs += [pl.BlockSpec((bn, k // p.wpc), lambda i, j: (j, 0)) for p in fmt.planes]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mpad, npad), jnp.float32),
        grid=(mpad // bm, npad // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=tiles.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*token_inputs, *plane_arrays)


# The jnp reference this kernel is tested against: the same decode on the whole matrix, one dot.
gemm_reference = tiles.dequant_matmul_reference
