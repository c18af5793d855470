"""How the attention kernels take one layer's K or V cache: a float array, or an 8-bit QuantizedKV
(quant/kv.py: values and a scale per block of a row) dequantized tile by tile in registers.

A cache is one kernel operand (the array) or two (values, scales); `operands` and `whole_specs`
lay them out for pallas_call, `split_refs` takes them back apart inside the kernel and `load_tile`
reads one [block_k, head_dim] tile of a head in the compute dtype (the float cache's, or the
QuantizedKV's `dtype`), so the kernels' softmax and dots see the same tiles either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.quant import kv
from minfer_jax.quant.kv import QuantizedKV

Cache = jax.Array | QuantizedKV


def quantized(cache: Cache) -> bool:
    return isinstance(cache, QuantizedKV)


def operands(cache: Cache) -> tuple[jax.Array, ...]:
    """The pallas_call operands of one cache: (array,) or (values, scales)."""
    return (cache.values, cache.scales) if isinstance(cache, QuantizedKV) else (cache,)


def whole_specs(cache: Cache) -> list:
    """Whole-array BlockSpecs of operands(cache) (the kernels index the cache themselves)."""
    return [pl.BlockSpec(a.shape, lambda *_, n=a.ndim: (0,) * n) for a in operands(cache)]


def split_refs(refs: tuple, quant: tuple[bool, bool]) -> tuple[tuple, tuple, tuple]:
    """refs after the query's: (K refs, V refs, the rest), K and V one ref each or two if 8-bit."""
    n_k, n_v = 1 + quant[0], 1 + quant[1]
    return refs[:n_k], refs[n_k : n_k + n_v], refs[n_k + n_v :]


def load_tile(refs: tuple, slot, head, k0, block_k: int, dtype):
    """Rows [k0, k0 + block_k) of `head` in cache slot `slot` -> [block_k, head_dim] in dtype.
    An 8-bit tile: values x their block's scale in f32, rounded once to dtype (as exact as an f16
    product: an int8 and an f16 scale multiply exactly in f32)."""
    rows = pl.ds(k0, block_k)
    if len(refs) == 1:
        return refs[0][slot, head, rows, :]
    values = refs[0][slot, head, rows, :].astype(jnp.float32)  # [bk, hd]
    scales = refs[1][slot, head, rows, :].astype(jnp.float32)  # [bk, hd / block]
    n_blocks, head_dim = scales.shape[1], values.shape[1]
    if n_blocks == 1:  # one scale per row (fp8)
        return (values * scales).astype(dtype)
    blocks = values.reshape(block_k, n_blocks, head_dim // n_blocks) * scales[:, :, None]
    return blocks.reshape(block_k, head_dim).astype(dtype)


def dense(cache: Cache) -> jax.Array:
    """The cache as the kernels see it, whole (for the *_reference functions): an 8-bit cache
    dequantized and rounded to its compute dtype, as load_tile rounds each tile."""
    if isinstance(cache, QuantizedKV):
        return kv.dequantized(cache).astype(cache.dtype)
    return cache
