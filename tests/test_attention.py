"""Chunk and decode attention kernels vs their jnp references, and each reference vs dense f64
numpy.

Caches hold random keys/values at the visible positions and large finite junk everywhere else
(past the chunk's end, past each row's length, unused slots): the results must not depend on it.
GQA ratios 7, 4 and 1, head_dim 64 and 128, key lengths 1, 17, 255 and 4097, chunks that start
mid-cache. Interpret mode is slow, so shapes are small and the 4097-key cases few.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax.errors import MinferError
from minfer_jax.pallas import attention, decode_attention, decode_qkv, device
from tests.kernel_mode import INTERPRET

# large but finite in f16 too: masking by multiplication (0 * junk, or junk scores) would show
JUNK = 3.0e4
# f32 caches: interpreted kernels differ from the references by summation order only; compiled,
# Triton's f32 dots may run in tf32.
ATOL = 2e-5 if INTERPRET else 5e-3
N_SLOTS = 4


def filled_cache(key, n_kv, max_len, head_dim, visible: dict[int, int], junk: float = JUNK):
    """k, v [N_SLOTS, n_kv, max_len, head_dim] f32: random at positions < visible[slot], junk
    elsewhere."""
    kk, kv = jax.random.split(key)
    shape = (N_SLOTS, n_kv, max_len, head_dim)
    pos = np.arange(max_len)
    mask = np.zeros((N_SLOTS, 1, max_len, 1), bool)
    for slot, n in visible.items():
        mask[slot, 0, :, 0] = pos < n
    k = jnp.where(mask, jax.random.normal(kk, shape), junk)
    v = jnp.where(mask, jax.random.normal(kv, shape), -junk)
    return k, v


def dense_attention_np(q, k, v, q_pos, scale):
    """q [n, H, hd] at absolute positions q_pos [n] over k, v [Hkv, S, hd] (keys 0 .. S-1), in
    f64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n_heads, n_kv = q.shape[1], k.shape[0]
    kh = np.repeat(k, n_heads // n_kv, axis=0)  # [H, S, hd]: query head h reads KV head h // rep
    vh = np.repeat(v, n_heads // n_kv, axis=0)
    s = np.einsum("nhd,hsd->hns", q, kh) * scale
    s = np.where(
        np.arange(k.shape[1])[None, None, :] <= np.asarray(q_pos)[None, :, None], s, -np.inf
    )
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hns,hsd->nhd", p, vh)


# (T, H, Hkv, head_dim, start, max_len, blocks): the last query sees start + T keys.
CHUNK_CASES = [
    (16, 7, 1, 64, 0, 256, {}),  # first query sees 1 key
    (16, 8, 2, 128, 1, 256, {"block_q": 16, "block_k": 16}),  # 17 keys
    (64, 2, 2, 64, 191, 256, {"block_q": 128, "block_k": 128}),  # 255 keys, ratio 1
    (64, 7, 1, 64, 4097 - 64, 4352, {}),  # 4097 keys, chunk mid-cache
    (16, 4, 1, 128, 4097 - 16, 4352, {"block_k": 128}),
    (
        32,
        7,
        1,
        128,
        4097 - 32,
        4352,
        {"k_splits": 3},
    ),  # key-split programs, merged; the 7B's ratio and hd
    (
        64,
        4,
        1,
        128,
        150,
        256,
        {"block_q": 32, "block_k": 32, "k_splits": 4},
    ),  # early row blocks: empty splits
]


@pytest.mark.slow
@pytest.mark.parametrize("t_len,n_heads,n_kv,head_dim,start,max_len,blocks", CHUNK_CASES)
def test_chunk_attention(t_len, n_heads, n_kv, head_dim, start, max_len, blocks):
    slot = 2
    key = jax.random.PRNGKey(start + head_dim)
    q = jax.random.normal(key, (t_len, n_heads, head_dim))
    visible = {slot: start + t_len}
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible)
    got = attention.chunk_attention(q, k, v, slot, start, interpret=INTERPRET, **blocks)
    ref = attention.chunk_attention_reference(q, k, v, slot, start)
    chex.assert_shape(got, (t_len, n_heads, head_dim))
    chex.assert_trees_all_close(got, ref, atol=ATOL, rtol=0)

    n_keys = start + t_len
    dense = dense_attention_np(
        q, k[slot, :, :n_keys], v[slot, :, :n_keys], start + np.arange(t_len), head_dim**-0.5
    )
    np.testing.assert_allclose(np.asarray(ref, np.float64), dense, atol=1e-5, rtol=0)

    k0, v0 = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible, junk=0.0)
    clean = attention.chunk_attention(q, k0, v0, slot, start, interpret=INTERPRET, **blocks)
    chex.assert_trees_all_equal(got, clean)  # junk keys contribute exact zeros


# (lengths, slots, nq, H, Hkv, head_dim, max_len, k_splits): row b's queries end at lengths[b].
DECODE_CASES = [
    ((1, 17, 255), (2, 0, 3), 1, 7, 1, 64, 256, None),  # default splits: most of them empty
    ((17, 255, 3), (1, 3, 0), 3, 8, 2, 128, 256, 4),
    ((4097, 8), (0, 2), 8, 2, 2, 64, 4352, 8),  # ratio 1, nq 8
    ((4097,), (3,), 1, 4, 1, 128, 4352, 16),
    ((300, 4097), (1, 2), 8, 7, 1, 128, 4352, 3),  # 56 rows padded to 64, splits not a power of two
]


@pytest.mark.slow
@pytest.mark.parametrize("lengths,slots,nq,n_heads,n_kv,head_dim,max_len,k_splits", DECODE_CASES)
def test_decode_attention(lengths, slots, nq, n_heads, n_kv, head_dim, max_len, k_splits):
    key = jax.random.PRNGKey(sum(lengths) + nq)
    batch = len(lengths)
    q = jax.random.normal(key, (batch, nq, n_heads, head_dim))
    visible = dict(zip(slots, lengths))
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible)
    slots_a, lengths_a = jnp.array(slots, jnp.int32), jnp.array(lengths, jnp.int32)
    got = decode_attention.decode_attention(
        q, k, v, slots_a, lengths_a, k_splits=k_splits, interpret=INTERPRET
    )
    ref = decode_attention.decode_attention_reference(q, k, v, slots_a, lengths_a)
    chex.assert_shape(got, (batch, nq, n_heads, head_dim))
    chex.assert_trees_all_close(got, ref, atol=ATOL, rtol=0)
    jnp_merge = decode_attention.decode_attention(
        q, k, v, slots_a, lengths_a, k_splits=k_splits, interpret=INTERPRET, fused=False
    )
    chex.assert_trees_all_close(jnp_merge, got, atol=1e-5, rtol=0)

    for b, (slot, n) in enumerate(zip(slots, lengths)):
        dense = dense_attention_np(
            q[b], k[slot, :, :n], v[slot, :, :n], n - nq + np.arange(nq), head_dim**-0.5
        )
        np.testing.assert_allclose(np.asarray(ref[b], np.float64), dense, atol=1e-5, rtol=0)

    k0, v0 = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible, junk=0.0)
    clean = decode_attention.decode_attention(
        q, k0, v0, slots_a, lengths_a, k_splits=k_splits, interpret=INTERPRET
    )
    chex.assert_trees_all_equal(got, clean)


def test_decode_attention_unused_rows_are_zero():
    """A batch row of length 0 (a free slot in a fixed-size decode batch) gives zeros, not NaN."""
    k, v = filled_cache(jax.random.PRNGKey(3), 1, 256, 64, {1: 40})
    q = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 7, 64))
    slots, lengths = jnp.array([1, 0], jnp.int32), jnp.array([40, 0], jnp.int32)
    got = decode_attention.decode_attention(
        q, k, v, slots, lengths, k_splits=2, interpret=INTERPRET
    )
    chex.assert_trees_all_equal(got[1], jnp.zeros_like(got[1]))
    ref = decode_attention.decode_attention_reference(q[:1], k, v, slots[:1], lengths[:1])
    chex.assert_trees_all_close(got[:1], ref, atol=ATOL, rtol=0)


def test_merge_splits_matches_one_softmax():
    """Merging split partials (one of them empty) equals the softmax over all keys at once."""
    rng = np.random.default_rng(0)
    s = rng.normal(size=(3, 40)) * 4  # base-2 scores of 3 rows over 40 keys
    v = rng.normal(size=(40, 8))
    parts = [(0, 16), (16, 16), (16, 40)]  # the middle split holds no keys
    o, m, lsum = [], [], []
    for lo, hi in parts:
        mi = s[:, lo:hi].max(axis=1) if hi > lo else np.full(3, attention.M_INIT)
        p = np.exp2(s[:, lo:hi] - mi[:, None])
        o.append(p @ v[lo:hi]), m.append(mi), lsum.append(p.sum(axis=1))
    got = attention.merge_splits(
        jnp.asarray(np.stack(o)[None, None], jnp.float32),
        jnp.asarray(np.stack(m)[None, None], jnp.float32),
        jnp.asarray(np.stack(lsum)[None, None], jnp.float32),
    )[0, 0]
    p = np.exp2(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got), (p / p.sum(axis=1, keepdims=True)) @ v, atol=1e-5)


@pytest.mark.parametrize("widths", [(896 + 128, 128), (896, 128, 128), (896 + 256,)])
def test_write_qkv_matches_its_reference(widths):
    """The decode q / k / v epilogue kernel: partial sums (7, 5 or 3 splits), bias, NeoX RoPE,
    cache writes (a position past the cache writes nothing) and q's attention layout are its jnp
    reference's to one f16 rounding (XLA may contract the rotation's multiply-adds differently),
    for q / k / v in one, two or three projections."""
    rng = np.random.default_rng(len(widths))
    n_heads, n_kv, hd = 14, 2, 64
    parts = tuple(
        jnp.asarray(rng.normal(size=(s, 4, -(-w // 128) * 128)), jnp.float32)
        for s, w in zip((7, 5, 3), widths)
    )
    bias = jnp.asarray(rng.normal(size=(sum(widths),)), jnp.float32)
    inv_freq = 1.0 / (1e6 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    positions, slots = jnp.array([5, 100, 128], jnp.int32), jnp.array([1, 0, 2], jnp.int32)
    k_cache = jnp.asarray(rng.normal(size=(3, n_kv, 128, hd)), jnp.float16)
    args = (parts, bias, inv_freq, positions, slots, k_cache, k_cache + 1)
    kw = dict(widths=widths, n_heads=n_heads, rows=16)
    got = decode_qkv.write_qkv(*args, interpret=INTERPRET, **kw)
    want = decode_qkv.write_qkv_reference(*args, **kw)
    atol = 1e-6 if INTERPRET else 2e-3  # compiled: the GPU's cos / sin may differ by an ulp
    chex.assert_trees_all_close(got, want, atol=atol, rtol=2e-3)
    chex.assert_trees_all_equal(got[1][2], k_cache[2])  # position 128 of 128: nothing written


@pytest.mark.parametrize("columns", [0, 32])
def test_merge_splits_kernel_matches_merge_splits(columns, monkeypatch):
    """The one-launch merge equals the jnp merge, empty splits and a row that saw no key (zeros)
    included, and keeps only the first n_rows rows, whole head_dim per program or in pieces."""
    monkeypatch.setattr(decode_attention, "MERGE_COLUMNS", columns)
    rng = np.random.default_rng(1)
    batch, n_kv, splits, rows, hd = 2, 3, 8, 16, 64
    m = rng.normal(size=(batch, n_kv, splits, rows)).astype(np.float32) * 8
    lsum = rng.uniform(0.5, 3, size=m.shape).astype(np.float32)
    o = rng.normal(size=(*m.shape, hd)).astype(np.float32)
    m[:, :, 5], lsum[:, :, 5], o[:, :, 5] = attention.M_INIT, 0, 0  # an empty split
    m[1], lsum[1], o[1] = attention.M_INIT, 0, 0  # an unused batch row
    args = [jnp.asarray(a) for a in (o, m, lsum)]
    got = decode_attention.merge_splits_kernel(*args, 7, interpret=INTERPRET)
    chex.assert_shape(got, (batch, n_kv, 7, hd))
    chex.assert_trees_all_close(got, attention.merge_splits(*args)[:, :, :7], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_equal(got[1], jnp.zeros_like(got[1]))


def test_new_start_or_lengths_do_not_retrace():
    n_kv, head_dim, max_len = 1, 64, 256
    k, v = filled_cache(jax.random.PRNGKey(5), n_kv, max_len, head_dim, {0: 200, 1: 100, 3: 256})

    @jax.jit
    @chex.assert_max_traces(n=1)
    def chunk(q, slot, start):
        return attention.chunk_attention(q, k, v, slot, start, interpret=INTERPRET)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def decode(q, slots, lengths):
        return decode_attention.decode_attention(
            q, k, v, slots, lengths, k_splits=2, interpret=INTERPRET
        )

    q = jax.random.normal(jax.random.PRNGKey(6), (16, 4, head_dim))
    for slot, start in ((0, 0), (1, 84), (3, 240)):
        got = chunk(q, slot, start)
        chex.assert_trees_all_close(
            got, attention.chunk_attention_reference(q, k, v, slot, start), atol=ATOL, rtol=0
        )
    qd = q[:2].reshape(2, 1, 4, head_dim)
    for lengths in ((1, 200), (100, 17)):
        slots, lens = jnp.array([1, 0], jnp.int32), jnp.array(lengths, jnp.int32)
        got = decode(qd, slots, lens)
        chex.assert_trees_all_close(
            got,
            decode_attention.decode_attention_reference(qd, k, v, slots, lens),
            atol=ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("bad", ["t_not_pow2", "t_too_long", "heads", "block", "max_len"])
def test_chunk_attention_rejects_unsupported_shapes(bad):
    t_len, n_heads = {"t_not_pow2": (24, 4), "t_too_long": (4096, 4), "heads": (16, 3)}.get(
        bad, (16, 4)
    )
    max_len = 200 if bad == "max_len" else 256
    q = jnp.zeros((t_len, n_heads, 64))
    k = jnp.zeros((1, 2, max_len, 64))
    with pytest.raises(
        MinferError,
        match={
            "t_not_pow2": "T=24",
            "t_too_long": "T=4096",
            "heads": "3 query heads",
            "block": "block_q=24",
            "max_len": "max_len 200",
        }[bad],
    ):
        attention.chunk_attention(
            q, k, k, 0, 0, block_q=24 if bad == "block" else None, interpret=INTERPRET
        )


def test_decode_attention_rejects_unsupported_shapes():
    k = jnp.zeros((1, 2, 256, 64))
    with pytest.raises(MinferError, match="nq=9"):
        decode_attention.decode_attention(jnp.zeros((1, 9, 4, 64)), k, k, 0, 9, interpret=INTERPRET)
    with pytest.raises(MinferError, match="head_dim 32"):
        decode_attention.decode_attention(jnp.zeros((1, 1, 4, 32)), k, k, 0, 9, interpret=INTERPRET)
    with pytest.raises(MinferError, match="block_k=48"):
        decode_attention.decode_attention(
            jnp.zeros((1, 1, 4, 64)), k, k, 0, 9, block_k=48, interpret=INTERPRET
        )


def test_decode_splits_capped_by_the_cache_tiles():
    """No more default key splits than the cache has 64-key tiles (power of two); an explicit
    k_splits and the deterministic mode's fixed splits are kept."""
    full = decode_attention.decode_config(1, 2).k_splits
    assert decode_attention.decode_config(1, 2, max_len=128).k_splits == 2
    assert decode_attention.decode_config(1, 2, max_len=640).k_splits == min(full, 16)
    assert decode_attention.decode_config(1, 2, max_len=1 << 15).k_splits == full
    assert decode_attention.decode_config(1, 2, k_splits=8, max_len=128).k_splits == 8
    det = decode_attention.decode_config(1, 2, deterministic=True)
    assert decode_attention.decode_config(1, 2, deterministic=True, max_len=128) == det


def test_decode_stages_fit_shared_memory():
    """The default pipeline stages shrink where the K / V tiles would overflow a block's shared
    memory (an f32 cache of head_dim 256 at 4 stages asked the H200 for 413 KB); on the tuned GPU
    (the CPU traces for it) the f16 caches' stages stay."""
    four = decode_attention.decode_config(1, 2, num_stages=4)
    fit = decode_attention.fit_shared_memory
    for rows, row_bytes in ((16, 256 * 4), (16, 256 * 2), (64, 128 * 2), (16, 4096)):
        cfg = fit(four, rows, row_bytes)
        buffers = (cfg.num_stages - 1) * 2 * cfg.block_k * row_bytes
        assert cfg.num_stages == 1 or buffers + rows * row_bytes <= device.shared_memory()
        assert cfg == fit(cfg, rows, row_bytes) and cfg.num_stages <= 4
    if device.current().tuned:
        assert fit(four, 16, 256 * 4).num_stages == 2
        assert fit(four, 16, 256 * 2) == fit(four, 64, 128 * 2) == four


def test_chunk_tiles_shrink_with_the_cache_row():
    """Chunk tiles keep the shared memory of 128 x 128 f16 ones: f32 caches and head_dim 256 at
    most 64 on a side, both at once 32 (64 x 64 asked the H100 for 256 KB)."""
    side = {
        (hd, size): max(
            attention.chunk_config(hd, cache_itemsize=size).block_k,
            attention.chunk_config(hd, cache_itemsize=size).block_q,
        )
        for hd in (64, 128, 256)
        for size in (2, 4)
    }
    assert side == {
        (64, 2): 64,
        (64, 4): 64,
        (128, 2): 128,
        (128, 4): 64,
        (256, 2): 64,
        (256, 4): 32,
    }


def lower_for_gpu(fn, *avals):
    """Lower fn for CUDA on any host (jax.export): runs the Pallas Triton lowering rules
    (power-of-two load/store sizes, indexers) that interpret mode skips; Triton's own compile still
    needs a GPU."""
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *avals
    ).mlir_module()


@pytest.mark.parametrize("model", [(14, 2, 64), (28, 4, 128), (40, 8, 128)])  # 0.5B, 7B, 32B heads
def test_kernels_lower_to_triton(model):
    n_heads, n_kv, head_dim = model
    f16, i32 = jnp.float16, jax.ShapeDtypeStruct((), jnp.int32)
    cache = jax.ShapeDtypeStruct((3, n_kv, 4096, head_dim), f16)
    for t_len, blocks in (
        (512, {}),
        (16, {"block_q": 16, "block_k": 16}),
        (2048, {"k_splits": 4}),
        (1024, {"block_q": 128, "block_k": 128, "num_warps": 8}),
    ):
        q = jax.ShapeDtypeStruct((t_len, n_heads, head_dim), f16)
        text = lower_for_gpu(
            lambda q, k, v, s, p, blocks=blocks: attention.chunk_attention(q, k, v, s, p, **blocks),
            q,
            cache,
            cache,
            i32,
            i32,
        )
        assert "chunk_attention" in text
    for batch, nq, splits in ((1, 1, None), (5, 8, 7), (64, 3, 2)):
        q = jax.ShapeDtypeStruct((batch, nq, n_heads, head_dim), f16)
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
        text = lower_for_gpu(
            lambda q, k, v, s, n, splits=splits: decode_attention.decode_attention(
                q, k, v, s, n, k_splits=splits
            ),
            q,
            cache,
            cache,
            rows,
            rows,
        )
        assert "decode_attention" in text


# --- sliding windows (Gemma 3's local layers): the window is an operand, one kernel for every
# layer ---


def windowed_dense_np(q, k, v, q_pos, scale, window):
    """dense_attention_np with keys q_pos - window < key <= q_pos only."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[0]
    kh, vh = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    s = np.einsum("nhd,hsd->hns", q, kh) * scale
    keys, pos = np.arange(k.shape[1])[None, None, :], np.asarray(q_pos)[None, :, None]
    s = np.where((keys <= pos) & (pos - keys < window), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hns,hsd->nhd", p, vh)


# (T, H, Hkv, head_dim, start, max_len, window, blocks)
WINDOW_CHUNK_CASES = [
    (16, 4, 1, 64, 100, 256, 8, {"block_q": 16, "block_k": 16}),  # window narrower than a tile
    (
        64,
        4,
        2,
        64,
        150,
        256,
        40,
        {"block_q": 32, "block_k": 32, "k_splits": 3},
    ),  # split share starts past 0
    (32, 4, 1, 256, 700, 1024, 512, {}),  # Gemma 3 1B's heads and window, chunk past the window
    (16, 2, 1, 64, 0, 256, 512, {}),  # window wider than the prefix: plain causal
]


@pytest.mark.parametrize(
    "t_len,n_heads,n_kv,head_dim,start,max_len,window,blocks", WINDOW_CHUNK_CASES
)
def test_chunk_attention_window(t_len, n_heads, n_kv, head_dim, start, max_len, window, blocks):
    slot = 1
    key = jax.random.PRNGKey(window + start)
    q = jax.random.normal(key, (t_len, n_heads, head_dim))
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, {slot: start + t_len})
    got = attention.chunk_attention(
        q, k, v, slot, start, interpret=INTERPRET, window=jnp.int32(window), **blocks
    )
    ref = attention.chunk_attention_reference(q, k, v, slot, start, window=window)
    chex.assert_trees_all_close(got, ref, atol=ATOL, rtol=0)
    n = start + t_len
    dense = windowed_dense_np(
        q, k[slot, :, :n], v[slot, :, :n], start + np.arange(t_len), head_dim**-0.5, window
    )
    np.testing.assert_allclose(np.asarray(ref, np.float64), dense, atol=1e-5, rtol=0)
    if window < start:  # the window changed something: not the causal result
        causal = attention.chunk_attention_reference(q, k, v, slot, start)
        assert float(jnp.max(jnp.abs(causal - ref))) > 1e-2


@pytest.mark.parametrize(
    "lengths,nq,k_splits,window",
    [((1, 40, 300), 1, 4, 16), ((300, 9), 8, 3, 64), ((700,), 1, None, 512)],
)
def test_decode_attention_window(lengths, nq, k_splits, window):
    n_heads, n_kv, head_dim, max_len = 8, 2, 64 if window < 512 else 256, 1024
    key = jax.random.PRNGKey(sum(lengths) + window)
    slots = tuple(range(len(lengths)))
    q = jax.random.normal(key, (len(lengths), nq, n_heads, head_dim))
    k, v = filled_cache(
        jax.random.fold_in(key, 1), n_kv, max_len, head_dim, dict(zip(slots, lengths))
    )
    slots_a, lengths_a = jnp.array(slots, jnp.int32), jnp.array(lengths, jnp.int32)
    got = decode_attention.decode_attention(
        q,
        k,
        v,
        slots_a,
        lengths_a,
        k_splits=k_splits,
        interpret=INTERPRET,
        window=jnp.int32(window),
    )
    ref = decode_attention.decode_attention_reference(q, k, v, slots_a, lengths_a, window=window)
    chex.assert_trees_all_close(got, ref, atol=ATOL, rtol=0)
    for b, n in enumerate(lengths):
        dense = windowed_dense_np(
            q[b], k[b, :, :n], v[b, :, :n], n - nq + np.arange(nq), head_dim**-0.5, window
        )
        np.testing.assert_allclose(np.asarray(ref[b], np.float64), dense, atol=1e-5, rtol=0)


def test_windowed_kernels_lower_to_triton():
    """Gemma 3 shapes (head_dim 256, one KV head) with a traced window, prefill and decode."""
    f16, i32 = jnp.float16, jax.ShapeDtypeStruct((), jnp.int32)
    cache = jax.ShapeDtypeStruct((2, 1, 4096, 256), f16)
    for t_len in (16, 512):
        q = jax.ShapeDtypeStruct((t_len, 4, 256), f16)
        text = lower_for_gpu(
            lambda q, k, v, s, p, w: attention.chunk_attention(q, k, v, s, p, window=w),
            q,
            cache,
            cache,
            i32,
            i32,
            i32,
        )
        assert "chunk_attention" in text
    q = jax.ShapeDtypeStruct((4, 1, 4, 256), f16)
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    text = lower_for_gpu(
        lambda q, k, v, s, n, w: decode_attention.decode_attention(q, k, v, s, n, window=w),
        q,
        cache,
        cache,
        rows,
        rows,
        i32,
    )
    assert "decode_attention" in text


@pytest.mark.parametrize(
    "lengths,nq,window",
    [((1, 17, 128, 0), 1, None), ((40, 100), 3, None), ((120, 9), 8, 16), ((128,), 1, 64)],
)
def test_decode_attention_row_programs(lengths, nq, window):
    """One program per query row, normalized in the kernel (DecodeConfig.row_programs): the
    reference's result for unused rows (zeros), several queries per row and a sliding window,
    over a short cache holding junk past each row's keys."""
    n_heads, n_kv, head_dim, max_len = 14, 2, 64, 128
    key = jax.random.PRNGKey(sum(lengths) + nq)
    slots = tuple(range(len(lengths)))
    q = jax.random.normal(key, (len(lengths), nq, n_heads, head_dim))
    visible = {s: n for s, n in zip(slots, lengths) if n}
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible)
    slots_a, lengths_a = jnp.array(slots, jnp.int32), jnp.array(lengths, jnp.int32)
    win = {} if window is None else {"window": jnp.int32(window)}
    assert decode_attention.decode_config(1, n_kv, max_len=max_len, row_programs=True).k_splits == 1
    got = decode_attention.decode_attention(
        q, k, v, slots_a, lengths_a, row_programs=True, interpret=INTERPRET, **win
    )
    used = lengths_a > 0
    ref = decode_attention.decode_attention_reference(
        q[used], k, v, slots_a[used], lengths_a[used], window=window
    )
    chex.assert_trees_all_close(got[np.asarray(used)], ref, atol=ATOL, rtol=0)
    chex.assert_trees_all_equal(got[~np.asarray(used)], jnp.zeros_like(got[~np.asarray(used)]))
