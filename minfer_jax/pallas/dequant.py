"""Whole-weight dequantization: planes -> a transient dense [Npad, K] matrix in the compute dtype.

Layout expected (quant.planes): each plane [Npad, K / wpc]. Output [Npad, K] in the format's
compute dtype (f16 for every block format), rows padded like the planes.

Grid (Npad / bn, K / bk): program (i, j) decodes rows [i*bn, (i+1)*bn) x weights [j*bk, (j+1)*bk)
with the GEMV/GEMM's own tile decode (tiles.load_weight_tile) and stores it. bk is a multiple of
every plane's wpc except the K-quants' per-super-block d/dmin (wpc 256 > bk), whose one covering
column is the block at column j*bk/256.

Used by the "dequant" prefill variant (ops.matmul): for many tokens, one pass that writes the
weight in f16 (2 bytes per weight, freed after the GEMM that reads it) plus the float GEMM beats
decoding every weight tile once per token block inside the GEMM. The weights stay quantized in
memory; only one matrix's f16 copy exists at a time, for the duration of one matmul.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.quant.planes import QType, decode, get_format, tile_cols

# (bn, bk, warps): one program decodes a [bn, bk] tile. H200 sweep at 4096 x 14336 (read the
# planes, write 117 MB of f16): 16 x 1024 on 4 warps Q4_0 62 us, Q4_K 66, Q6_K 73; 32 x 512: 63,
# 72, 77; 128 x 256 on 8 warps: 70, 78, 91 (docs/BENCHMARKS.md).
DEQUANT_TILE = (16, 1024, 4)


@dataclasses.dataclass(frozen=True)
class DequantConfig:
    bn: int
    bk: int
    num_warps: int = 4


def choose_config(npad: int, k: int) -> DequantConfig:
    bn, bk, warps = DEQUANT_TILE
    return DequantConfig(
        bn=tiles.pow2_divisor(npad, bn), bk=tiles.pow2_divisor(k, bk), num_warps=warps
    )


@functools.cache
def _kernel(qtype: QType, bn: int, bk: int, dtype):
    fmt = get_format(qtype)

    def kernel(*refs):
        *plane_refs, o_ref = refs
        o_ref[...] = tiles.load_weight_tile(fmt, plane_refs, 0, bn, 0, bk, dtype)  # [bn, bk]

    return kernel


def _plane_block_index(bk: int, wpc: int, i, j):
    return i, j * bk // (wpc * tile_cols(bk, wpc))


@functools.partial(jax.jit, static_argnames=("qtype", "config", "interpret"))
def dequantize(
    planes: dict, *, qtype: QType, config: DequantConfig | None = None, interpret: bool = False
) -> jax.Array:
    """The weight's planes -> [Npad, K] in the format's compute dtype."""
    fmt = get_format(qtype)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    k = arrays[0].shape[1] * fmt.planes[0].wpc
    cfg = config or choose_config(npad, k)
    assert npad % cfg.bn == 0 and k % cfg.bk == 0, (cfg, npad, k)
    tiles.silence_triton_deprecation()
    in_specs = [
        pl.BlockSpec(
            (cfg.bn, tile_cols(cfg.bk, p.wpc)), functools.partial(_plane_block_index, cfg.bk, p.wpc)
        )
        for p in fmt.planes
    ]
    return pl.pallas_call(
        _kernel(qtype, cfg.bn, cfg.bk, fmt.compute_dtype),
        out_shape=jax.ShapeDtypeStruct((npad, k), fmt.compute_dtype),
        grid=(npad // cfg.bn, k // cfg.bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((cfg.bn, cfg.bk), lambda i, j: (i, j)),
        compiler_params=tiles.compiler_params(cfg.num_warps, 1),
        interpret=interpret,
        name=f"dequant_{fmt.name.lower()}",
    )(*arrays)


def dequantize_reference(planes: dict, *, qtype: QType) -> jax.Array:
    """The jnp reference: quant.planes.decode on the whole planes, in the compute dtype."""
    return decode(qtype, planes, get_format(qtype).compute_dtype)
