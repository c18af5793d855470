"""Chunk (prefill) attention: causal GQA flash attention of T queries over one cache slot.

Cache layout (shared with decode_attention.py and the engine): k_cache, v_cache
[n_slots, n_kv_heads, max_len, head_dim]; slot s holds one sequence, position p at [s, :, p, :].
The chunk's own K/V are already in the cache at [slot, :, start:start+T, :]; query t (absolute
position start+t) sees keys 0 .. start+t. Keys past start+T-1 may hold anything: they are masked by
position (jnp.where to -inf), never by multiplication, and no key tile past start+T is read.

Rows of a KV group: the rep = H / Hkv query heads sharing a KV head and the T positions are
flattened into one row axis, row = t * rep + r (ratios 5, 6, 7 are not powers of two), padded to
the row block. Grid (Hkv, row blocks): each program loads its [block_q, hd] query rows once and
walks the keys of its KV head in [block_k, hd] tiles (one read of a tile serves all heads of the
group whose rows are in the block), with an online softmax in base 2 and f32 accumulation. The
key loop bound is traced (start, slot reach the kernel as a small int32 array), so one executable
serves every chunk position; tiles wholly visible to every row of the block skip the mask.
Modelled on jax.experimental.pallas.ops.gpu.attention (mha_forward_kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.errors import MinferError
from minfer_jax.pallas import kv_tiles, tiles
from minfer_jax.pallas.kv_tiles import Cache
from minfer_jax.sizes import pow2_at_least, round_up

HIGHEST = (
    lax.Precision.HIGHEST
)  # references: exact f32 products on every backend (the GPU default is TF32)

LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * log2 e): scores are kept in base 2
M_INIT = float(jnp.finfo(jnp.float32).min)  # finite running max: exp2(M_INIT - m) is 0, never NaN
MIN_T, MAX_T = 16, 2048


class AttentionShapeError(MinferError):
    """Arrays handed to an attention kernel do not have the shapes or dtypes it supports."""


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tiles of one chunk-attention executable (block_q rows of a KV group, block_k keys)."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    k_splits: int = 1  # programs per row block, each on a share of the key tiles (merged in jnp)


# Per (head_dim, chunks up to 512 tokens / longer ones), the fastest measured on the H200
# (docs/BENCHMARKS.md, "Chunk attention"): key splits for the 0.5B's two KV heads, wider tiles at
# 128.
CHUNK_CONFIGS = {
    (64, 512): ChunkConfig(block_q=64, block_k=64, num_warps=4, num_stages=2, k_splits=4),
    (64, 2048): ChunkConfig(block_q=64, block_k=64, num_warps=4, num_stages=2, k_splits=4),
    (128, 512): ChunkConfig(block_q=128, block_k=128, num_warps=8, num_stages=2),
    (128, 2048): ChunkConfig(block_q=128, block_k=64, num_warps=4, num_stages=2),
}


def chunk_config(
    head_dim: int,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_splits: int | None = None,
    t_len: int = 512,
    cache_itemsize: int = 2,
) -> ChunkConfig:
    """The table's config for head_dim and chunk length with any given field overriding it.

    The table's tiles were timed on f16 caches; a cache row wider in bytes (f32 K/V, Gemma 3's
    head_dim 256) takes tiles at most 128 x 256 / (head_dim x cache_itemsize) on a side, so their
    shared memory stays that of 128 x 128 f16 ones (128 x 128 f32 tiles asked for 256 KB on the
    H200, and 64 x 64 ones of an f32 cache of head_dim 256 as much on the H100; each has 227 KB)."""
    base = CHUNK_CONFIGS.get((head_dim if head_dim <= 64 else 128, 512 if t_len <= 512 else 2048))
    side = max(16, 128 * 256 // (head_dim * cache_itemsize))
    if side < 128:
        base = dataclasses.replace(
            base, block_q=min(base.block_q, side), block_k=min(base.block_k, side)
        )
    cfg = ChunkConfig(
        block_q=block_q or base.block_q,
        block_k=block_k or base.block_k,
        num_warps=num_warps or base.num_warps,
        num_stages=num_stages or base.num_stages,
        k_splits=k_splits or base.k_splits,
    )
    if cfg.k_splits < 1:
        raise AttentionShapeError(f"k_splits={cfg.k_splits} must be >= 1")
    for name in ("block_q", "block_k"):
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise AttentionShapeError(
                f"{name}={value} must be a power of two >= 16 (Triton dot tiles)"
            )
    return cfg


def check_cache(k_cache: Cache, v_cache: Cache, n_heads: int, head_dim: int) -> None:
    """Raise AttentionShapeError unless k/v are [n_slots, Hkv, max_len, head_dim] (float arrays or
    8-bit QuantizedKV of one compute dtype) and Hkv divides n_heads."""
    shape = tuple(k_cache.shape)
    if len(shape) != 4 or shape != tuple(v_cache.shape) or k_cache.dtype != v_cache.dtype:
        raise AttentionShapeError(
            f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} "
            f"{v_cache.dtype} must share one [n_slots, n_kv_heads, max_len, head_dim] "
            "shape and dtype"
        )
    n_kv, head = k_cache.shape[1], k_cache.shape[3]
    if head != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise AttentionShapeError(
            f"head_dim {head_dim} (cache {head}) must match and be a power of two >= 16"
        )
    if n_heads % n_kv:
        raise AttentionShapeError(f"{n_heads} query heads are not a multiple of {n_kv} KV heads")


def online_softmax_step(carry, s, v):
    """One key tile of the online softmax: s [rows, bk] base-2 scores (-inf where masked),
    v [bk, hd]; carry (acc [rows, hd] f32, m [rows] running max, lsum [rows] running sum)."""
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = correction * l_prev + jnp.sum(p, axis=1)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return correction[:, None] * acc + pv, m_next, l_next


def initial_carry(acc_shape: tuple[int, ...], rows: int, sink=None, first=True):
    """The online softmax's starting (acc, m, lsum). sink [rows] (base-2 logits, or None): an
    attention sink (gpt-oss) enters as a key already seen with that score and a zero value, so
    it is in the denominator only; with key splits only the first split (first) holds it."""
    acc = jnp.zeros(acc_shape, jnp.float32)
    if sink is None:
        return acc, jnp.full((rows,), M_INIT, jnp.float32), jnp.zeros((rows,), jnp.float32)
    m = jnp.where(first, sink, M_INIT)
    return acc, m, jnp.where(first, jnp.ones_like(m), jnp.zeros_like(m))


def sink_rows(sinks: jax.Array, n_kv: int, n_rows: int) -> jax.Array:
    """Per-head sinks [H] -> base-2 per query row of each KV group [Hkv, n_rows] (row r holds
    head g * rep + r % rep, the kernels' row = t * rep + r layout; padded rows repeat it)."""
    rep = sinks.shape[0] // n_kv
    heads = jnp.arange(n_rows) % rep
    return sinks.astype(jnp.float32).reshape(n_kv, rep)[:, heads] * LOG2_E


def check_sinks(sinks, n_heads: int) -> None:
    """Raise AttentionShapeError unless sinks is None or one logit per query head [H]."""
    if sinks is not None and tuple(sinks.shape) != (n_heads,):
        raise AttentionShapeError(f"sinks {tuple(sinks.shape)} must be one per head ({n_heads},)")


def scores(q: jax.Array, k: jax.Array, qk_scale: float) -> jax.Array:
    """q [rows, hd] . k [bk, hd]^T in f32, times qk_scale (sm_scale * log2 e)."""
    return (
        lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        * qk_scale
    )


@functools.cache
def _chunk_kernel(
    rep: int,
    t_len: int,
    n_blocks: int,
    block_q: int,
    block_k: int,
    k_splits: int,
    qk_scale: float,
    grid_key: tuple,
    windowed: bool = False,
    sinks: bool = False,
    quant: tuple[bool, bool] = (False, False),
):
    """One kernel closure per configuration and grid / array shapes (grid_key: jax#40847).
    windowed: meta holds a third value, the sliding window (traced: one kernel for every layer).
    sinks: one more operand, the block's rows' sinks [block_q] (base 2; initial_carry).
    quant: K / V are 8-bit (two operands each, kv_tiles)."""
    if windowed:
        return _windowed_chunk_kernel(
            rep, t_len, n_blocks, block_q, block_k, k_splits, qk_scale, sinks, quant
        )

    def kernel(q_ref, *refs):
        k_refs, v_refs, (meta_ref, *refs) = kv_tiles.split_refs(refs, quant)
        sink_ref, (o_ref, *stat_refs) = (refs[0], refs[1:]) if sinks else (None, refs)
        h = pl.program_id(0)
        i = n_blocks - 1 - pl.program_id(1)  # the longest (last) row blocks start first
        slot, start = meta_ref[0], meta_ref[1]
        q = q_ref[...]  # [block_q, hd] in the cache dtype
        row0 = i * block_q
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        q_pos = start + jnp.minimum(
            lax.div(rows, rep), t_len - 1
        )  # padded rows act as the last query
        first_pos = start + lax.div(row0, rep)
        last_pos = start + jnp.minimum(lax.div(row0 + block_q - 1, rep), t_len - 1)
        n_open = lax.div(first_pos + 1, block_k)  # tiles every row of the block sees whole
        n_tiles = lax.div(last_pos + block_k, block_k)  # ceil((last_pos + 1) / block_k)
        lo, hi = 0, n_tiles
        if k_splits > 1:  # this program's share of the key tiles
            per_split = lax.div(n_tiles + k_splits - 1, k_splits)
            lo = pl.program_id(2) * per_split
            hi = jnp.minimum(lo + per_split, n_tiles)

        def step(j, carry, masked: bool):
            k0 = pl.multiple_of(j * block_k, block_k)
            s = scores(q, kv_tiles.load_tile(k_refs, slot, h, k0, block_k, q.dtype), qk_scale)
            if masked:
                keys = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                s = jnp.where(keys[None, :] <= q_pos[:, None], s, -jnp.inf)
            v = kv_tiles.load_tile(v_refs, slot, h, k0, block_k, q.dtype)
            return online_softmax_step(carry, s, v)

        carry = initial_carry(
            q_ref.shape,
            block_q,
            None if sink_ref is None else sink_ref[...],
            k_splits == 1 or pl.program_id(2) == 0,
        )
        carry = lax.fori_loop(
            lo, jnp.minimum(hi, n_open), functools.partial(step, masked=False), carry
        )
        acc, m, lsum = lax.fori_loop(
            jnp.maximum(lo, n_open), hi, functools.partial(step, masked=True), carry
        )
        if k_splits == 1:
            o_ref[...] = acc / lsum[:, None]
        else:  # unnormalized partials, merged by merge_splits
            o_ref[...] = acc
            stat_refs[0][...] = m
            stat_refs[1][...] = lsum

    return kernel


def _windowed_chunk_kernel(
    rep: int,
    t_len: int,
    n_blocks: int,
    block_q: int,
    block_k: int,
    k_splits: int,
    qk_scale: float,
    sinks: bool = False,
    quant: tuple[bool, bool] = (False, False),
):
    """The chunk kernel on a sliding-window layer: a query at p sees keys p - window < key <= p, so
    the key loop starts at the first tile any row of the block sees (a 16k-token prefill with a
    512 window reads ~512 keys per query, not 16k). Tiles every row sees whole skip the mask."""

    def kernel(q_ref, *refs):
        k_refs, v_refs, (meta_ref, *refs) = kv_tiles.split_refs(refs, quant)
        sink_ref, (o_ref, *stat_refs) = (refs[0], refs[1:]) if sinks else (None, refs)
        h = pl.program_id(0)
        i = n_blocks - 1 - pl.program_id(1)
        slot, start, window = meta_ref[0], meta_ref[1], meta_ref[2]
        q = q_ref[...]
        row0 = i * block_q
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        q_pos = start + jnp.minimum(lax.div(rows, rep), t_len - 1)
        first_pos = start + lax.div(row0, rep)
        last_pos = start + jnp.minimum(lax.div(row0 + block_q - 1, rep), t_len - 1)
        n_tiles = lax.div(last_pos + block_k, block_k)
        n_open = lax.div(first_pos + 1, block_k)  # tiles below: no key past any row's position
        w_lo = lax.div(jnp.maximum(first_pos - window + 1, 0), block_k)  # first tile any row sees
        w_open = lax.div(
            jnp.maximum(last_pos - window + 1, 0) + block_k - 1, block_k
        )  # from here: inside every window
        a = jnp.maximum(w_lo, jnp.minimum(w_open, n_open))
        b = jnp.maximum(
            a, n_open
        )  # [a, b): seen whole by every row; [w_lo, a) and [b, n_tiles): masked
        lo, hi = w_lo, n_tiles
        if k_splits > 1:
            per_split = lax.div(n_tiles - w_lo + k_splits - 1, k_splits)
            lo = w_lo + pl.program_id(2) * per_split
            hi = jnp.minimum(lo + per_split, n_tiles)

        def step(j, carry, masked: bool):
            k0 = pl.multiple_of(j * block_k, block_k)
            s = scores(q, kv_tiles.load_tile(k_refs, slot, h, k0, block_k, q.dtype), qk_scale)
            if masked:
                keys = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
                seen = (keys[None, :] <= q_pos[:, None]) & (q_pos[:, None] - keys[None, :] < window)
                s = jnp.where(seen, s, -jnp.inf)
            v = kv_tiles.load_tile(v_refs, slot, h, k0, block_k, q.dtype)
            return online_softmax_step(carry, s, v)

        carry = initial_carry(
            q_ref.shape,
            block_q,
            None if sink_ref is None else sink_ref[...],
            k_splits == 1 or pl.program_id(2) == 0,
        )
        carry = lax.fori_loop(lo, jnp.minimum(hi, a), functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(
            jnp.maximum(lo, a), jnp.minimum(hi, b), functools.partial(step, masked=False), carry
        )
        acc, m, lsum = lax.fori_loop(
            jnp.maximum(lo, b), hi, functools.partial(step, masked=True), carry
        )
        if k_splits == 1:
            o_ref[...] = acc / lsum[:, None]
        else:
            o_ref[...] = acc
            stat_refs[0][...] = m
            stat_refs[1][...] = lsum

    return kernel


def merge_splits(o: jax.Array, m: jax.Array, lsum: jax.Array, ordered: bool = False) -> jax.Array:
    """Log-sum-exp merge of key-split partials: o [..., S, rows, hd] unnormalized, m, lsum
    [..., S, rows] base-2 running max and sum (an empty split has m = M_INIT, lsum = 0, o = 0) ->
    [..., rows, hd]. A row that saw no key at all (an unused decode row of length 0) comes out as
    zeros, not NaN. ordered: the splits added left to right (a reduce's order may depend on the
    other axes: batch invariance; the max is exact in any order)."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    weight = jnp.exp2(m - m_all)  # [..., S, rows]
    total = tiles.sum_splits(weight * lsum, -2, ordered)
    total = jnp.where(total > 0, total, 1.0)
    return tiles.sum_splits(weight[..., None] * o, -3, ordered) / total[..., None]


def chunk_attention(
    q: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    slot,
    start,
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_splits: int | None = None,
    interpret: bool = False,
    window=None,
    sinks=None,
) -> jax.Array:
    """q [T, H, hd] at positions start .. start+T-1 of cache slot `slot` (both traced int32
    scalars) over the cache's keys 0 .. start+t -> [T, H, hd] float32. The caller keeps
    start + T <= max_len (start is traced, so it cannot be checked here).
    window (a traced int32 scalar, > 0): query p sees keys p - window < key <= p only.
    sinks ([H] f32 logits, or None): each head's attention sink, in the softmax's denominator.
    k_cache / v_cache: float arrays, or 8-bit QuantizedKV read tile by tile (kv_tiles)."""
    t_len, n_heads, head_dim = q.shape
    check_cache(k_cache, v_cache, n_heads, head_dim)
    check_sinks(sinks, n_heads)
    if t_len < MIN_T or t_len > MAX_T or t_len & (t_len - 1):
        raise AttentionShapeError(
            f"chunk length T={t_len} must be a power of two in [{MIN_T}, {MAX_T}]"
        )
    cfg = chunk_config(
        head_dim,
        block_q,
        block_k,
        num_warps,
        num_stages,
        k_splits,
        t_len=t_len,
        cache_itemsize=k_cache.dtype.itemsize,
    )
    if k_cache.shape[2] % cfg.block_k:
        raise AttentionShapeError(
            f"cache max_len {k_cache.shape[2]} is not a multiple of block_k={cfg.block_k}"
        )
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    meta = [jnp.asarray(slot, jnp.int32), jnp.asarray(start, jnp.int32)]
    if window is not None:
        meta.append(jnp.asarray(window, jnp.int32))
    return _chunk_attention(
        q, k_cache, v_cache, jnp.stack(meta), sinks, sm_scale=scale, cfg=cfg, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "cfg", "interpret"))
def _chunk_attention(
    q, k_cache, v_cache, meta, sinks, *, sm_scale: float, cfg: ChunkConfig, interpret: bool
):
    t_len, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    rep = n_heads // n_kv
    n_rows = t_len * rep
    block_q = min(cfg.block_q, pow2_at_least(n_rows))
    rows_pad = round_up(n_rows, block_q)
    n_blocks = rows_pad // block_q
    tiles.silence_triton_deprecation()

    qg = q.reshape(t_len, n_kv, rep, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, n_rows, head_dim)
    qg = jnp.pad(
        qg.astype(k_cache.dtype), ((0, 0), (0, rows_pad - n_rows), (0, 0))
    )  # [Hkv, rows_pad, hd]
    splits = cfg.k_splits
    windowed = meta.shape[0] == 3
    kernel = _chunk_kernel(
        rep,
        t_len,
        n_blocks,
        block_q,
        cfg.block_k,
        splits,
        sm_scale * LOG2_E,
        (k_cache.shape, str(k_cache.dtype)),
        windowed=windowed,
        sinks=sinks is not None,
        quant=(kv_tiles.quantized(k_cache), kv_tiles.quantized(v_cache)),
    )
    in_specs = [
        pl.BlockSpec((None, block_q, head_dim), lambda h, i, s: (h, n_blocks - 1 - i, 0)),
        *kv_tiles.whole_specs(k_cache),
        *kv_tiles.whole_specs(v_cache),
        pl.BlockSpec(meta.shape, lambda h, i, s: (0,)),
    ]
    operands = [qg, *kv_tiles.operands(k_cache), *kv_tiles.operands(v_cache), meta]
    if sinks is not None:  # each row block's sinks, beside its query rows
        in_specs.append(pl.BlockSpec((None, block_q), lambda h, i, s: (h, n_blocks - 1 - i)))
        operands.append(sink_rows(sinks, n_kv, rows_pad))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((n_kv, rows_pad, head_dim), jnp.float32)]
        out_specs = [in_specs[0]]
    else:
        part = (n_kv, splits, rows_pad)
        out_shape = [
            jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ]
        stat_spec = pl.BlockSpec((None, None, block_q), lambda h, i, s: (h, s, n_blocks - 1 - i))
        out_specs = [
            pl.BlockSpec(
                (None, None, block_q, head_dim), lambda h, i, s: (h, s, n_blocks - 1 - i, 0)
            ),
            stat_spec,
            stat_spec,
        ]
    parts = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_kv, n_blocks, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="chunk_attention",
    )(*operands)
    out = parts[0] if splits == 1 else merge_splits(*parts)  # [Hkv, rows_pad, hd]
    out = out[:, :n_rows].reshape(n_kv, t_len, rep, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(t_len, n_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def chunk_attention_reference(
    q: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    slot,
    start,
    *,
    sm_scale: float | None = None,
    window=None,
    sinks=None,
) -> jax.Array:
    """The kernel's math in plain jnp over the slot's whole cache row (f32, dense softmax):
    q [T, H, hd] at positions start .. start+T-1 -> [T, H, hd] float32 (an 8-bit cache
    dequantized first: kv_tiles.dense)."""
    k_cache, v_cache = kv_tiles.dense(k_cache), kv_tiles.dense(v_cache)
    t_len, n_heads, head_dim = q.shape
    n_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    k = k_cache[slot].astype(jnp.float32)  # [Hkv, S, hd]
    v = v_cache[slot].astype(jnp.float32)
    qg = q.astype(k_cache.dtype).astype(jnp.float32).reshape(t_len, n_kv, n_heads // n_kv, head_dim)
    s = jnp.einsum("tgrd,gsd->grts", qg, k, precision=HIGHEST) * scale
    q_pos = start + jnp.arange(t_len)
    visible = jnp.arange(max_len)[None, :] <= q_pos[:, None]  # [T, S]
    if window is not None:
        visible &= q_pos[:, None] - jnp.arange(max_len)[None, :] < window
    s = jnp.where(visible[None, None], s, -jnp.inf)
    if sinks is not None:
        s = with_sinks(s, sinks.reshape(n_kv, n_heads // n_kv, 1, 1))
    p = jax.nn.softmax(s, axis=-1)[..., :max_len]
    return jnp.einsum("grts,gsd->tgrd", p, v, precision=HIGHEST).reshape(t_len, n_heads, head_dim)


def with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """scores [..., S] with one more column, each row's sink (sinks broadcast to [..., 1]): a
    softmax over it puts the sink in the denominator; the caller drops its column."""
    column = jnp.broadcast_to(sinks.astype(scores.dtype), (*scores.shape[:-1], 1))
    return jnp.concatenate([scores, column], axis=-1)
