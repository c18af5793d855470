"""Decode q/k/v epilogue: the q / k / v projections' outputs to the decode-attention kernel's
inputs in one launch per layer (XLA runs the same as five: q, k and v each summed and rotated,
two cache updates).

For each batch row b the kernel sums the split-K partials of the projections (gemv.gemv_int8's
`partials=True` output; an already summed matmul is one "split"), adds the biases, rotates q and
k by NeoX RoPE at positions[b] (pairs (i, i + hd/2), as model/layers.rope_neox), writes k and v
into row b's cache slot at that position (in place: the cache buffers are aliased to the
outputs; a position outside the cache writes nothing) and lays q out as decode_attention reads
it: [B, Hkv, rows, hd] in the cache dtype, query heads of KV group g in rows [0, rep), the rest
zero. Grid (B, Hkv, max(rows, rep + 2)): program (b, g, j) writes q row j of KV group g (a head
for j < rep, zeros past it), the k head for j = rep, the v head for j = rep + 1: many small
programs, all their loads in flight at once. Each sum runs in the same order whatever the batch
(batch invariance).

An 8-bit cache (quant/kv.py's QuantizedKV) is written quantized: the k or v program holds the
head's whole row, so it takes each block's (q8_0) or the row's (fp8) amax and stores the values
and their scales (kv.quantize's arithmetic); q is laid out in the cache's compute dtype.

Columns: the projections' outputs concatenated are one row's q | k | v ([H*hd | Hkv*hd |
Hkv*hd]); each part holds whole regions of it (a fused q/k/v weight, or one weight per region).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.pallas import kv_tiles, tiles
from minfer_jax.pallas.kv_tiles import Cache
from minfer_jax.quant import kv

__all__ = ["write_qkv", "write_qkv_reference"]


def _regions(widths: tuple[int, ...], q_dim: int, kv_dim: int) -> tuple[tuple[int, int], ...]:
    """(part index, column offset inside that part) of the q, k and v regions."""
    if sum(widths) != q_dim + 2 * kv_dim:
        raise ValueError(
            f"q/k/v parts are {sum(widths)} columns wide, expected {q_dim + 2 * kv_dim}"
        )
    return tuple(
        tiles.locate_region(widths, column, width)
        for column, width in ((0, q_dim), (q_dim, kv_dim), (q_dim + kv_dim, kv_dim))
    )


@functools.partial(jax.jit, static_argnames=("widths", "n_heads", "rows", "interpret"))
def write_qkv(
    parts: tuple[jax.Array, ...],
    bias: jax.Array | None,
    inv_freq: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    *,
    widths: tuple[int, ...],
    n_heads: int,
    rows: int,
    interpret: bool = False,
):
    """parts: [S_i, R_i >= B, Np_i >= widths[i]] f32 each, the first widths[i] columns of part i
    (concatenated) row b's q | k | v before bias; bias [H*hd + 2*Hkv*hd] or None; inv_freq
    [hd / 2] f32 (RoPE frequencies); positions, slots [B] int32; k_cache, v_cache
    [n_slots, Hkv, max_len, hd] (float arrays or 8-bit QuantizedKV, written quantized) ->
    (q [B, Hkv, rows, hd] cache dtype, k_cache, v_cache)."""
    n_slots, n_kv, max_len, hd = k_cache.shape
    batch, half, rep = positions.shape[0], hd // 2, n_heads // n_kv
    q_at, k_at, v_at = _regions(widths, n_heads * hd, n_kv * hd)
    splits = tuple(p.shape[0] for p in parts)
    has_bias = bias is not None
    dtype = k_cache.dtype
    tiles.silence_triton_deprecation()

    lanes = max(rows, rep + 2)  # program j: q row j (zeros past rep); j = rep: k; rep + 1: v

    k_ops, v_ops = kv_tiles.operands(k_cache), kv_tiles.operands(v_cache)
    kinds = tuple(c.kind if isinstance(c, kv.QuantizedKV) else None for c in (k_cache, v_cache))

    def kernel(*refs):
        part_refs = refs[: len(parts)]
        rest = refs[len(parts) :]
        bias_ref, rest = (rest[0], rest[1:]) if has_bias else (None, rest)
        freq_ref, pos_ref, slot_ref = rest[:3]
        q_ref, *outs = rest[3 + len(k_ops) + len(v_ops) :]  # the caches' inputs: aliased outputs
        k_refs, v_refs = outs[: len(k_ops)], outs[len(k_ops) :]
        b, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        pos, slot = pos_ref[b], slot_ref[b]

        def load(at, region_col, col):  # [half] f32: columns [col, col + half) of a region
            i, offset = at
            start = pl.multiple_of(offset + col, half)
            v = part_refs[i][0, b, pl.ds(start, half)]
            for s in range(1, splits[i]):  # left to right: the same order at every batch size
                v = v + part_refs[i][s, b, pl.ds(start, half)]
            if has_bias:
                v = v + bias_ref[pl.ds(pl.multiple_of(region_col + col, half), half)]
            return v

        def rotated(at, region_col, col):
            angle = pos.astype(jnp.float32) * freq_ref[...]
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            x1, x2 = load(at, region_col, col), load(at, region_col, col + half)
            return x1 * cos - x2 * sin, x2 * cos + x1 * sin

        def store(ref, index, lo, hi):
            ref[(*index, pl.ds(0, half))] = lo.astype(dtype)
            ref[(*index, pl.ds(half, half))] = hi.astype(dtype)

        def store_row(refs, kind, index, lo, hi):  # one head's k or v row, quantized if 8-bit
            if kind is None:
                store(refs[0], index, lo, hi)
            else:
                store_quantized(refs, kind, index, lo, hi, half)

        @pl.when(j < rep)
        def _():
            store(q_ref, (j,), *rotated(q_at, 0, (g * rep + j) * hd))

        @pl.when((j >= rep) & (j < rows))
        def _():
            zeros = jnp.zeros((half,), jnp.float32)
            store(q_ref, (j,), zeros, zeros)

        in_cache = (pos >= 0) & (pos < max_len)

        @pl.when((j == rep) & in_cache)
        def _():
            store_row(k_refs, kinds[0], (slot, g, pos), *rotated(k_at, n_heads * hd, g * hd))

        @pl.when((j == rep + 1) & in_cache)
        def _():
            v_col = (n_heads + n_kv) * hd
            lo, hi = load(v_at, v_col, g * hd), load(v_at, v_col, g * hd + half)
            store_row(v_refs, kinds[1], (slot, g, pos), lo, hi)

    whole = lambda a: pl.BlockSpec(a.shape, lambda b, g, j: (0,) * a.ndim)  # noqa: E731
    operands = (*parts, *((bias.astype(jnp.float32),) if has_bias else ()))
    operands += (inv_freq.astype(jnp.float32), positions, slots, *k_ops, *v_ops)
    cache_ops = (*k_ops, *v_ops)
    n_in = len(operands)
    q, *written = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((batch, n_kv, rows, hd), dtype),
            *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache_ops),
        ],
        grid=(batch, n_kv, lanes),
        in_specs=[whole(a) for a in operands],
        out_specs=[
            pl.BlockSpec((None, None, rows, hd), lambda b, g, j: (b, g, 0, 0)),
            *(whole(a) for a in cache_ops),
        ],
        input_output_aliases={n_in - len(cache_ops) + i: 1 + i for i in range(len(cache_ops))},
        compiler_params=tiles.compiler_params(1, 1),
        interpret=interpret,
        name="decode_qkv",
    )(*operands)
    return q, _rebuilt(k_cache, written[: len(k_ops)]), _rebuilt(v_cache, written[len(k_ops) :])


def _rebuilt(cache: Cache, arrays) -> Cache:
    """The cache from the kernel's written operands (kv_tiles.operands' order)."""
    if isinstance(cache, kv.QuantizedKV):
        return kv.QuantizedKV(arrays[0], arrays[1], cache.dtype)
    return arrays[0]


def store_quantized(refs, kind: str, index: tuple, lo: jax.Array, hi: jax.Array, half: int):
    """A head's row (lo, hi: its two [half] f32 halves) quantized as kv.quantize does, into
    (values, scales) refs at index (slot, head, position): q8_0 one scale per 32 columns of each
    half, fp8 one scale for the row."""
    values_ref, scales_ref = refs
    if kind == kv.Q8_0:
        n_blocks = half // kv.Q8_0_BLOCK
        for i, x in enumerate((lo, hi)):
            blocks = x.reshape(n_blocks, kv.Q8_0_BLOCK)
            d = kv.scale_of(jnp.max(jnp.abs(blocks), axis=1), kind)
            values = kv.quantize_with(blocks, d[:, None], kind).reshape(half)
            values_ref[(*index, pl.ds(i * half, half))] = values
            scales_ref[(*index, pl.ds(i * n_blocks, n_blocks))] = d.astype(kv.SCALE_DTYPE)
        return
    d = kv.scale_of(jnp.maximum(jnp.max(jnp.abs(lo)), jnp.max(jnp.abs(hi))), kind)
    values_ref[(*index, pl.ds(0, half))] = kv.quantize_with(lo, d, kind)
    values_ref[(*index, pl.ds(half, half))] = kv.quantize_with(hi, d, kind)
    scales_ref[(*index, pl.ds(0, 1))] = jnp.broadcast_to(d, (1,)).astype(kv.SCALE_DTYPE)


def write_qkv_reference(
    parts, bias, inv_freq, positions, slots, k_cache, v_cache, *, widths, n_heads, rows
):
    """write_qkv's math in plain jnp (partials added left to right, rotation as
    model/layers.rope_neox, cache rows set by scatter)."""
    n_kv, hd = k_cache.shape[1], k_cache.shape[3]
    batch, rep, q_dim, kv_dim = positions.shape[0], n_heads // n_kv, n_heads * hd, n_kv * hd
    sums = [tiles.sum_splits(p, 0, ordered=True)[:batch, :w] for p, w in zip(parts, widths)]
    qkv = jnp.concatenate(sums, axis=-1)
    if bias is not None:
        qkv = qkv + bias
    angle = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]

    def rope(x):  # [B, heads, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    q = rope(qkv[:, :q_dim].reshape(batch, n_heads, hd))
    k = rope(qkv[:, q_dim : q_dim + kv_dim].reshape(batch, n_kv, hd))
    v = qkv[:, q_dim + kv_dim :].reshape(batch, n_kv, hd)
    at = jnp.where(positions >= 0, positions, k_cache.shape[2])  # outside: dropped, not wrapped
    k_cache, v_cache = (_set_rows(c, x, slots, at) for c, x in ((k_cache, k), (v_cache, v)))
    qg = q.reshape(batch, n_kv, rep, hd).astype(k_cache.dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - rep), (0, 0)))
    return qg, k_cache, v_cache


def _set_rows(cache: Cache, rows: jax.Array, slots: jax.Array, at: jax.Array) -> Cache:
    """cache with rows [B, Hkv, hd] at (slots[b], at[b]), quantized if 8-bit (at past the cache:
    dropped)."""
    if not isinstance(cache, kv.QuantizedKV):
        return cache.at[slots, :, at].set(rows.astype(cache.dtype), mode="drop")
    values, scales = kv.quantize(rows, cache.kind)
    return kv.QuantizedKV(
        cache.values.at[slots, :, at].set(values, mode="drop"),
        cache.scales.at[slots, :, at].set(scales, mode="drop"),
        cache.dtype,
    )
