"""Decode attention (flash-decoding): nq = 1..8 new tokens of each of B sequences over their cache
slots.

Cache layout as in attention.py: [n_slots, n_kv_heads, max_len, head_dim]. Row b of the batch
lives in slot slots[b] and holds lengths[b] positions including its nq new tokens: its query j sits
at position lengths[b] - nq + j and sees keys 0 .. lengths[b] - nq + j. slots and lengths are
traced [B] int32 arrays, so one executable serves every length.

Grid (B, Hkv, k_splits): program (b, g, s) takes the nq * rep query rows of KV group g (row =
j * rep + r, padded to a power of two >= 16 for the dot) and the s-th share of the key tiles of
[0, lengths[b]) (dynamic loop bounds: it reads only its share of [0, len) rounded up to a tile,
never a power-of-two span or the whole cache). Each writes its unnormalized output with its
running max and sum; a log-sum-exp merge in jnp (a few KB per row) combines the splits.
Modelled on jax.experimental.pallas.ops.gpu.decode_attention. For short caches a second kernel
(DecodeConfig.row_programs, grid (B, Hkv, nq * rep)) gives each query row one program over all
its keys and normalizes in place: no partials, no merge launch (off: slower where timed,
ROW_PROGRAMS_MAX_LEN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import device, kv_tiles, tiles
from minfer_jax.pallas.attention import (
    HIGHEST,
    LOG2_E,
    M_INIT,
    AttentionShapeError,
    check_cache,
    check_sinks,
    initial_carry,
    merge_splits,
    online_softmax_step,
    scores,
    sink_rows,
    with_sinks,
)
from minfer_jax.pallas.kv_tiles import Cache
from minfer_jax.sizes import pow2_at_least

MAX_NQ = 8
MIN_ROWS = 16  # Triton dot tiles need >= 16 rows
# k_splits default: enough programs to keep the H200's 132 SMs loading (about 2 per SM; another
# GPU's SM count scales it, device.programs), few enough that the partials
# [B, Hkv, splits, rows, hd] f32 stay small beside the K/V they replace.
TARGET_PROGRAMS = 256
MAX_SPLITS = 64
# one sequence (B = 1): its own program target and pipeline depth; fewer, longer splits and a
# deeper pipeline timed faster there alone (attention_bench), slower at B = 8
ONE_ROW_TARGET_PROGRAMS = 128
ONE_ROW_STAGES = 4
# deterministic: the key splits of this batch size at every batch size (a row's partials and
# their merge then do not depend on the batch)
DETERMINISTIC_BATCH = 8
# caches of at most this many positions: one program per query row over all its keys, normalized
# in the kernel, so no merge launch (DecodeConfig.row_programs). 0 (off): on the H200 it took
# 17.5 us at 640 keys (7B, B = 1) against 6.2 for the split kernel and its merge
ROW_PROGRAMS_MAX_LEN = 0
# Triton pipeline stages of the split kernel's K / V loads (decode_config's default): 3 beat 2 at
# 4096 and 16384 keys, B = 1 and 8 (docs/BENCHMARKS.md, "Decode attention: a shorter merge")
NUM_STAGES = 3
# head_dim columns per merge program: more, smaller programs than one per query row shorten the
# merge, a few KB per program (0: one program per row over the whole head_dim)
MERGE_COLUMNS = 32


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles of one decode-attention executable."""

    k_splits: int
    block_k: int
    num_warps: int
    num_stages: int
    ordered: bool = False  # splits merged in a fixed order (deterministic)
    # one program per query row over all its keys, normalized in the kernel (no split, no merge)
    row_programs: bool = False


def decode_config(
    batch: int,
    n_kv_heads: int,
    k_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    deterministic: bool = False,
    max_len: int | None = None,
    row_programs: bool | None = None,
) -> DecodeConfig:
    """Defaults (TARGET_PROGRAMS, block_k 64, 4 warps, NUM_STAGES) with any given field overriding
    them. deterministic: the splits of DETERMINISTIC_BATCH rows whatever the batch, merged in a
    fixed order. max_len (the cache's): no more default splits than the cache has key tiles
    (rounded up to a power of two), except in the deterministic mode, whose splits never change.
    row_programs: DecodeConfig's; None: for caches of at most ROW_PROGRAMS_MAX_LEN positions
    outside the deterministic mode."""
    rows = DETERMINISTIC_BATCH if deterministic else batch
    block_k = block_k or 64
    target = ONE_ROW_TARGET_PROGRAMS if rows == 1 else TARGET_PROGRAMS
    splits = k_splits or max(
        1,
        min(MAX_SPLITS, pow2_at_least(-(-device.programs(target) // (rows * n_kv_heads)))),
    )
    if not k_splits and max_len and not deterministic:
        # a split past the cache's last tile only writes an empty partial for the merge to read
        # (a 128-token cache: 2 splits, not 64; docs/BENCHMARKS.md, "Decode beside llama.cpp")
        splits = min(splits, pow2_at_least(-(-max_len // block_k)))
    if row_programs is None:
        row_programs = bool(max_len) and max_len <= ROW_PROGRAMS_MAX_LEN and not deterministic
    cfg = DecodeConfig(
        k_splits=1 if row_programs else splits,
        block_k=block_k,
        num_warps=num_warps or 4,
        num_stages=num_stages or device.stages(ONE_ROW_STAGES if rows == 1 else NUM_STAGES),
        ordered=deterministic,
        row_programs=row_programs,
    )
    if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise AttentionShapeError(
            f"block_k={cfg.block_k} must be a power of two >= 16 (Triton dot tiles)"
        )
    if cfg.k_splits < 1:
        raise AttentionShapeError(f"k_splits={cfg.k_splits} must be >= 1")
    return cfg


def fit_shared_memory(cfg: DecodeConfig, rows: int, row_bytes: int) -> DecodeConfig:
    """cfg with at most the pipeline stages whose K and V tiles fit a block's shared memory
    (device.shared_memory) beside the query tile: Triton buffers stages - 1 of each. row_bytes:
    one cache row of one head (head_dim x the cache dtype's size). An f32 cache of Gemma 3's
    head_dim 256 asked the H200 for 413 KB at 4 stages (227 KB available)."""
    per_stage = 2 * cfg.block_k * row_bytes
    room = device.shared_memory() - 2 * rows * row_bytes  # the query tile, and as much again
    return dataclasses.replace(cfg, num_stages=max(1, min(cfg.num_stages, 1 + room // per_stage)))


@functools.cache
def _decode_kernel(
    rep: int,
    nq: int,
    rows: int,
    k_splits: int,
    block_k: int,
    qk_scale: float,
    grid_key: tuple,
    windowed: bool = False,
    sinks: bool = False,
    quant: tuple[bool, bool] = (False, False),
):
    """One kernel closure per configuration and grid / array shapes (grid_key: jax#40847).
    windowed: one more [B] operand, the sliding window (traced): keys q_pos - window < key <= q_pos,
    and the key loop starts at the first tile the row's first query sees. sinks: one more
    operand, the group's rows' sinks [rows] (base 2), held by split 0 (initial_carry).
    quant: K / V are 8-bit (two operands each, kv_tiles)."""

    def kernel(q_ref, *refs):
        k_refs, v_refs, (slots_ref, lengths_ref, *refs) = kv_tiles.split_refs(refs, quant)
        window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
        sink_ref, (o_ref, m_ref, l_ref) = (refs[0], refs[1:]) if sinks else (None, refs)
        b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        slot, length = slots_ref[b], lengths_ref[b]
        n_tiles = lax.div(length + block_k - 1, block_k)
        if windowed:
            window = window_ref[b]
            first = lax.div(
                jnp.maximum(length - nq - window + 1, 0), block_k
            )  # the first query's first tile
            per_split = lax.div(n_tiles - first + k_splits - 1, k_splits)
            lo = first + split * per_split
        else:
            per_split = lax.div(n_tiles + k_splits - 1, k_splits)
            lo = split * per_split
        hi = jnp.minimum(lo + per_split, n_tiles)
        q = q_ref[...]  # [rows, hd] in the cache dtype
        row_ids = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        q_pos = (
            length - nq + jnp.minimum(lax.div(row_ids, rep), nq - 1)
        )  # padded rows act as the last query

        def step(j, carry):
            k0 = pl.multiple_of(j * block_k, block_k)
            s = scores(q, kv_tiles.load_tile(k_refs, slot, h, k0, block_k, q.dtype), qk_scale)
            keys = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            seen = keys[None, :] <= q_pos[:, None]
            if windowed:
                seen = seen & (q_pos[:, None] - keys[None, :] < window)
            s = jnp.where(seen, s, -jnp.inf)
            v = kv_tiles.load_tile(v_refs, slot, h, k0, block_k, q.dtype)
            return online_softmax_step(carry, s, v)

        carry = initial_carry(
            q_ref.shape, rows, None if sink_ref is None else sink_ref[...], split == 0
        )
        acc, m, lsum = lax.fori_loop(lo, hi, step, carry)
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = lsum

    return kernel


@functools.cache
def _row_kernel(
    rep: int,
    nq: int,
    block_k: int,
    qk_scale: float,
    grid_key: tuple,
    windowed: bool,
    sinks: bool = False,
    quant: tuple[bool, bool] = (False, False),
):
    """One program per (row b, KV group g, query row r): r's scores against every key it sees,
    an online softmax over the key tiles with scalar max and sum, the normalized [hd] output
    (DecodeConfig.row_programs). Elementwise products, not dots: one query row is under Triton's
    16-row dot tiles, and a short cache makes the few tiles cheap. sinks: one more operand, the
    sinks of every group's rows [Hkv * rows] (base 2), read at this program's row."""

    def kernel(q_ref, *refs):
        k_refs, v_refs, (slots_ref, lengths_ref, *refs) = kv_tiles.split_refs(refs, quant)
        window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
        sink_ref, (o_ref,) = (refs[0], refs[1:]) if sinks else (None, refs)
        b, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        slot, length = slots_ref[b], lengths_ref[b]
        q_pos = length - nq + lax.div(r, rep)
        q = q_ref[...].astype(jnp.float32)  # [hd]
        hi = lax.div(q_pos + block_k, block_k)  # tiles holding keys 0 .. q_pos
        lo = lax.div(jnp.maximum(q_pos - window_ref[b] + 1, 0), block_k) if windowed else 0

        def step(j, carry):
            acc, m_prev, l_prev = carry
            k0 = pl.multiple_of(j * block_k, block_k)
            k = kv_tiles.load_tile(k_refs, slot, h, k0, block_k, q_ref.dtype).astype(jnp.float32)
            s = jnp.sum(k * q[None, :], axis=1) * qk_scale  # [bk], base 2
            keys = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            seen = keys <= q_pos
            if windowed:
                seen = seen & (q_pos - keys < window_ref[b])
            s = jnp.where(seen, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s))
            correction = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - m_next)
            v = kv_tiles.load_tile(v_refs, slot, h, k0, block_k, q_ref.dtype).astype(jnp.float32)
            acc = correction * acc + jnp.sum(p[:, None] * v, axis=0)
            return acc, m_next, correction * l_prev + jnp.sum(p)

        if sink_ref is None:
            carry = (jnp.zeros(q_ref.shape, jnp.float32), jnp.float32(M_INIT), jnp.float32(0.0))
        else:  # the sink: a key seen first, with a zero value (initial_carry)
            sink = sink_ref[h * pl.num_programs(2) + r]
            carry = (jnp.zeros(q_ref.shape, jnp.float32), sink, jnp.float32(1.0))
        acc, _, lsum = lax.fori_loop(lo, hi, step, carry)
        o_ref[...] = acc / jnp.where(lsum > 0, lsum, 1.0)  # a row of length 0 sees no key: zeros

    return kernel


def decode_attention(
    q: jax.Array, k_cache: Cache, v_cache: Cache, slots, lengths, **options
) -> jax.Array:
    """q [B, nq, H, hd]: the last nq positions of each row's lengths[b] (traced [B] int32, >= nq),
    in cache slot slots[b] (traced [B] int32) -> [B, nq, H, hd] float32. A row of length 0 (an
    unused batch row) reads nothing and returns zeros. options: decode_attention_grouped's
    (sm_scale, tiles, row_programs, interpret, window, sinks, deterministic, fused)."""
    if q.ndim != 4:
        raise AttentionShapeError(f"q has shape {q.shape}; expected [B, nq, H, head_dim]")
    batch, nq, n_heads, head_dim = q.shape
    check_cache(k_cache, v_cache, n_heads, head_dim)
    if not 1 <= nq <= MAX_NQ:
        raise AttentionShapeError(f"nq={nq} query tokens per row; supported 1 .. {MAX_NQ}")
    n_kv = k_cache.shape[1]
    rep, rows = n_heads // n_kv, query_rows(nq, n_heads, n_kv)
    qg = (
        q.reshape(batch, nq, n_kv, rep, head_dim)
        .transpose(0, 2, 1, 3, 4)
        .reshape(batch, n_kv, nq * rep, head_dim)
    )
    qg = jnp.pad(
        qg.astype(k_cache.dtype), ((0, 0), (0, 0), (0, rows - nq * rep), (0, 0))
    )  # [B, Hkv, rows, hd]
    return decode_attention_grouped(
        qg, k_cache, v_cache, slots, lengths, nq=nq, n_heads=n_heads, **options
    )


def query_rows(nq: int, n_heads: int, n_kv: int) -> int:
    """Rows of one KV group's query tile: its nq * rep queries, padded to a power of two >= 16."""
    return max(MIN_ROWS, pow2_at_least(nq * (n_heads // n_kv)))


def decode_attention_grouped(
    qg: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    slots,
    lengths,
    *,
    nq: int,
    n_heads: int,
    sm_scale: float | None = None,
    k_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    row_programs: bool | None = None,
    interpret: bool = False,
    window=None,
    sinks=None,
    deterministic: bool = False,
    fused: bool = True,
) -> jax.Array:
    """decode_attention with q already laid out as the kernel reads it: qg [B, Hkv, rows, hd] in
    the cache dtype (row j * rep + r: query j of head g * rep + r; rows = query_rows, the rest
    zero; as decode_qkv.write_qkv writes it) -> [B, nq, H, hd] float32. window (traced int32,
    > 0): query p sees keys p - window < key <= p only. sinks ([H] f32 or None): each head's
    attention sink, in the softmax's denominator only. deterministic: a row's result does not
    depend on the batch (decode_config). fused: the splits merged by merge_splits_kernel, else in
    jnp. The tiles and row_programs default to decode_config's. k_cache / v_cache: float arrays or
    8-bit QuantizedKV, dequantized tile by tile (kv_tiles)."""
    batch, n_kv, rows, head_dim = qg.shape
    check_cache(k_cache, v_cache, n_heads, head_dim)
    check_sinks(sinks, n_heads)
    if rows != query_rows(nq, n_heads, n_kv):
        raise AttentionShapeError(f"qg has {rows} rows; expected {query_rows(nq, n_heads, n_kv)}")
    cfg = decode_config(
        batch,
        n_kv,
        k_splits,
        block_k,
        num_warps,
        num_stages,
        deterministic,
        k_cache.shape[2],
        row_programs,
    )
    if k_cache.shape[2] % cfg.block_k:
        raise AttentionShapeError(
            f"cache max_len {k_cache.shape[2]} is not a multiple of block_k={cfg.block_k}"
        )
    if num_stages is None:
        cfg = fit_shared_memory(cfg, rows, head_dim * k_cache.dtype.itemsize)
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    slots = jnp.broadcast_to(jnp.asarray(slots, jnp.int32), (batch,))
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (batch,))
    windows = (
        () if window is None else (jnp.broadcast_to(jnp.asarray(window, jnp.int32), (batch,)),)
    )
    return _decode_attention(
        qg,
        k_cache,
        v_cache,
        slots,
        lengths,
        None if sinks is None else sink_rows(sinks, n_kv, rows),
        *windows,
        nq=nq,
        n_heads=n_heads,
        sm_scale=scale,
        cfg=cfg,
        interpret=interpret,
        fused=fused,
    )


@functools.partial(
    jax.jit, static_argnames=("nq", "n_heads", "sm_scale", "cfg", "interpret", "fused")
)
def _decode_attention(
    qg,
    k_cache,
    v_cache,
    slots,
    lengths,
    sinks,
    *windows,
    nq: int,
    n_heads: int,
    sm_scale: float,
    cfg: DecodeConfig,
    interpret: bool,
    fused: bool,
):
    """sinks: None or [Hkv, rows] base 2 (attention.sink_rows)."""
    batch, n_kv, rows, head_dim = qg.shape
    rep = n_heads // n_kv
    n_rows = nq * rep
    splits = cfg.k_splits
    tiles.silence_triton_deprecation()
    quant = (kv_tiles.quantized(k_cache), kv_tiles.quantized(v_cache))
    caches = (*kv_tiles.whole_specs(k_cache), *kv_tiles.whole_specs(v_cache))
    cache_operands = (*kv_tiles.operands(k_cache), *kv_tiles.operands(v_cache))
    per_row = pl.BlockSpec((batch,), lambda b, h, s: (0,))
    has_sinks = sinks is not None
    if cfg.row_programs:
        row = pl.BlockSpec((None, None, None, head_dim), lambda b, h, r: (b, h, r, 0))
        flat_sinks = () if sinks is None else (sinks[:, :n_rows].reshape(-1),)
        out = pl.pallas_call(
            _row_kernel(
                rep,
                nq,
                cfg.block_k,
                sm_scale * LOG2_E,
                (batch, k_cache.shape, str(k_cache.dtype)),
                bool(windows),
                has_sinks,
                quant,
            ),
            out_shape=jax.ShapeDtypeStruct((batch, n_kv, n_rows, head_dim), jnp.float32),
            grid=(batch, n_kv, n_rows),
            in_specs=[
                row,
                *caches,
                per_row,
                per_row,
                *(per_row for _ in windows),
                *(pl.BlockSpec(a.shape, lambda b, h, r: (0,)) for a in flat_sinks),
            ],
            out_specs=row,
            compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="decode_attention_rows",
        )(qg, *cache_operands, slots, lengths, *windows, *flat_sinks)
    else:
        kernel = _decode_kernel(
            rep,
            nq,
            rows,
            splits,
            cfg.block_k,
            sm_scale * LOG2_E,
            (batch, k_cache.shape, str(k_cache.dtype)),
            windowed=bool(windows),
            sinks=has_sinks,
            quant=quant,
        )
        part_shape = (batch, n_kv, splits, rows)
        group_sinks = () if sinks is None else (sinks,)
        o, m, lsum = pl.pallas_call(
            kernel,
            out_shape=[
                jax.ShapeDtypeStruct(part_shape + (head_dim,), jnp.float32),
                jax.ShapeDtypeStruct(part_shape, jnp.float32),
                jax.ShapeDtypeStruct(part_shape, jnp.float32),
            ],
            grid=(batch, n_kv, splits),
            in_specs=[
                pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
                *caches,
                per_row,
                per_row,
                *(per_row for _ in windows),
                *(pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)) for _ in group_sinks),
            ],
            out_specs=[
                pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
                pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            ],
            compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name="decode_attention",
        )(qg, *cache_operands, slots, lengths, *windows, *group_sinks)
        if fused and splits & (splits - 1) == 0:  # Triton blocks: S a power of two
            out = merge_splits_kernel(o, m, lsum, n_rows, interpret=interpret)
        else:
            out = merge_splits(o, m, lsum, cfg.ordered)[:, :, :n_rows]  # [B, Hkv, nq * rep, hd]
    out = out.reshape(batch, n_kv, nq, rep, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, nq, n_heads, head_dim)


def merge_splits_kernel(
    o: jax.Array, m: jax.Array, lsum: jax.Array, n_rows: int, *, interpret: bool = False
) -> jax.Array:
    """attention.merge_splits as one kernel: o [B, Hkv, S, rows, hd], m, lsum [B, Hkv, S, rows]
    -> [B, Hkv, n_rows, hd] f32 (the first n_rows rows). Program (b, g, r, c) merges one query
    row's S partials over MERGE_COLUMNS columns of head_dim; its sums run in one order whatever
    the batch (batch invariance)."""
    batch, n_kv, splits, _, head_dim = o.shape
    columns = tiles.pow2_divisor(head_dim, MERGE_COLUMNS or head_dim)

    def kernel(o_ref, m_ref, l_ref, out_ref):
        m = m_ref[...]  # [S]
        weight = jnp.exp2(m - jnp.max(m))
        total = jnp.sum(weight * l_ref[...])
        total = jnp.where(total > 0, total, 1.0)
        out_ref[...] = jnp.sum(weight[:, None] * o_ref[...], axis=0) / total

    per_row = pl.BlockSpec((None, None, splits, None), lambda b, g, r, c: (b, g, 0, r))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, n_kv, n_rows, head_dim), jnp.float32),
        grid=(batch, n_kv, n_rows, head_dim // columns),
        in_specs=[
            pl.BlockSpec((None, None, splits, None, columns), lambda b, g, r, c: (b, g, 0, r, c)),
            per_row,
            per_row,
        ],
        out_specs=pl.BlockSpec((None, None, None, columns), lambda b, g, r, c: (b, g, r, c)),
        compiler_params=tiles.compiler_params(4, 1),
        interpret=interpret,
        name="decode_merge",
    )(o, m, lsum)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def decode_attention_reference(
    q: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    slots,
    lengths,
    *,
    sm_scale: float | None = None,
    window=None,
    sinks=None,
) -> jax.Array:
    """The kernel's math in plain jnp over each row's whole cache slot (f32, dense softmax; an
    8-bit cache dequantized first: kv_tiles.dense)."""
    k_cache, v_cache = kv_tiles.dense(k_cache), kv_tiles.dense(v_cache)
    batch, nq, n_heads, head_dim = q.shape
    n_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    slots = jnp.broadcast_to(jnp.asarray(slots, jnp.int32), (batch,))
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (batch,))
    k = k_cache[slots].astype(jnp.float32)  # [B, Hkv, S, hd]
    v = v_cache[slots].astype(jnp.float32)
    qg = (
        q.astype(k_cache.dtype)
        .astype(jnp.float32)
        .reshape(batch, nq, n_kv, n_heads // n_kv, head_dim)
    )
    s = jnp.einsum("bjgrd,bgsd->bgrjs", qg, k, precision=HIGHEST) * scale
    q_pos = lengths[:, None] - nq + jnp.arange(nq)[None, :]  # [B, nq]
    visible = jnp.arange(max_len)[None, None, :] <= q_pos[:, :, None]  # [B, nq, S]
    if window is not None:
        visible &= q_pos[:, :, None] - jnp.arange(max_len)[None, None, :] < window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    if sinks is not None:
        s = with_sinks(s, sinks.reshape(1, n_kv, n_heads // n_kv, 1, 1))
    p = jax.nn.softmax(s, axis=-1)[..., :max_len]
    return jnp.einsum("bgrjs,bgsd->bjgrd", p, v, precision=HIGHEST).reshape(
        batch, nq, n_heads, head_dim
    )
