"""Attention sinks (gpt-oss): a per-head logit in the softmax's denominator only.

The chunk and decode kernels (split programs with the jnp and the kernel merge, the row programs,
windowed or not) against their jnp references, and the references against dense f64 numpy with
the sink written out: max(max_j z_j, s_h), sum_j exp(z_j - max) + exp(s_h - max). Sinks both above
and below the scores (some rows dominated by their sink). `MINFER_TEST_KERNELS=compiled` runs the
same tests through the Triton lowering on a GPU.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax.model import attention as model_attention
from minfer_jax.model.config import Config
from minfer_jax.pallas import attention, decode_attention
from tests.kernel_mode import INTERPRET
from tests.test_attention import ATOL, filled_cache


def sink_dense_np(q, k, v, q_pos, scale, sinks, window=0):
    """q [n, H, hd] at positions q_pos over k, v [Hkv, S, hd] with sinks [H], in f64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[0]
    kh, vh = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    s = np.einsum("nhd,hsd->hns", q, kh) * scale
    keys, pos = np.arange(k.shape[1])[None, None, :], np.asarray(q_pos)[None, :, None]
    seen = keys <= pos
    if window:
        seen &= pos - keys < window
    s = np.where(seen, s, -np.inf)
    sink = np.asarray(sinks, np.float64)[:, None, None]  # [H, 1, 1]
    top = np.maximum(s.max(axis=-1, keepdims=True), sink)
    p = np.exp(s - top)
    return np.einsum("hns,hsd->nhd", p / (p.sum(axis=-1, keepdims=True) + np.exp(sink - top)), vh)


def head_sinks(key, n_heads):
    """Sinks spread from well below to well above typical scores (-4 .. 6)."""
    return jnp.linspace(-4.0, 6.0, n_heads) + 0.1 * jax.random.normal(key, (n_heads,))


# (T, H, Hkv, head_dim, start, max_len, window, blocks)
CHUNK_CASES = [
    (32, 8, 2, 64, 40, 128, 0, {"block_q": 32, "block_k": 32, "k_splits": 3}),  # split merge
    (16, 4, 1, 64, 60, 128, 24, {"block_q": 16, "block_k": 16}),  # windowed
]


@pytest.mark.parametrize("t_len,n_heads,n_kv,head_dim,start,max_len,window,blocks", CHUNK_CASES)
def test_chunk_attention_sinks(t_len, n_heads, n_kv, head_dim, start, max_len, window, blocks):
    slot = 1
    key = jax.random.PRNGKey(start + window)
    q = jax.random.normal(key, (t_len, n_heads, head_dim))
    sinks = head_sinks(jax.random.fold_in(key, 2), n_heads)
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, {slot: start + t_len})
    win = {"window": jnp.int32(window)} if window else {}
    got = attention.chunk_attention(
        q, k, v, slot, start, interpret=INTERPRET, sinks=sinks, **win, **blocks
    )
    ref = attention.chunk_attention_reference(
        q, k, v, slot, start, sinks=sinks, window=window or None
    )
    chex.assert_trees_all_close(got, ref, atol=ATOL, rtol=0)
    n = start + t_len
    dense = sink_dense_np(
        q, k[slot, :, :n], v[slot, :, :n], start + np.arange(t_len), head_dim**-0.5, sinks, window
    )
    np.testing.assert_allclose(np.asarray(ref, np.float64), dense, atol=1e-5, rtol=0)
    plain = attention.chunk_attention_reference(q, k, v, slot, start, window=window or None)
    assert float(jnp.max(jnp.abs(plain - ref))) > 1e-2  # the sinks changed the result


# (lengths, nq, H, Hkv, k_splits, window, row_programs)
DECODE_CASES = [
    ((1, 40, 130), 1, 8, 2, 4, 0, False),  # most splits empty for the short rows
    ((9, 70), 3, 4, 1, 3, 16, False),  # windowed; splits not a power of two: the jnp merge
    ((1, 17, 90, 0), 1, 14, 2, None, 8, True),  # row programs, an unused row (zeros)
]


@pytest.mark.parametrize("lengths,nq,n_heads,n_kv,k_splits,window,row_programs", DECODE_CASES)
def test_decode_attention_sinks(lengths, nq, n_heads, n_kv, k_splits, window, row_programs):
    head_dim, max_len = 64, 256
    key = jax.random.PRNGKey(sum(lengths) + nq)
    slots = tuple(range(len(lengths)))
    q = jax.random.normal(key, (len(lengths), nq, n_heads, head_dim))
    sinks = head_sinks(jax.random.fold_in(key, 2), n_heads)
    visible = {s: n for s, n in zip(slots, lengths) if n}
    k, v = filled_cache(jax.random.fold_in(key, 1), n_kv, max_len, head_dim, visible)
    slots_a, lengths_a = jnp.array(slots, jnp.int32), jnp.array(lengths, jnp.int32)
    options = dict(k_splits=k_splits, row_programs=row_programs, interpret=INTERPRET, sinks=sinks)
    if window:
        options["window"] = jnp.int32(window)
    got = decode_attention.decode_attention(q, k, v, slots_a, lengths_a, **options)
    used = np.asarray(lengths_a) > 0
    ref = decode_attention.decode_attention_reference(
        q[used], k, v, slots_a[used], lengths_a[used], sinks=sinks, window=window or None
    )
    chex.assert_trees_all_close(got[used], ref, atol=ATOL, rtol=0)
    chex.assert_trees_all_equal(got[~used], jnp.zeros_like(got[~used]))
    if not row_programs:
        jnp_merge = decode_attention.decode_attention(
            q, k, v, slots_a, lengths_a, fused=False, **options
        )
        chex.assert_trees_all_close(jnp_merge, got, atol=1e-5, rtol=0)
    for b, n in enumerate(lengths):
        if n:
            q_pos = n - nq + np.arange(nq)
            scale = head_dim**-0.5
            dense = sink_dense_np(q[b], k[b, :, :n], v[b, :, :n], q_pos, scale, sinks, window)
            row = int(np.flatnonzero(used)[: b + 1].size - 1)
            np.testing.assert_allclose(np.asarray(ref[row], np.float64), dense, atol=1e-5, rtol=0)


def test_sinks_must_be_one_per_head():
    k, v = filled_cache(jax.random.PRNGKey(0), 2, 128, 64, {0: 8})
    q = jnp.zeros((16, 4, 64))
    with pytest.raises(attention.AttentionShapeError, match="one per head"):
        attention.chunk_attention(q, k, v, 0, 0, interpret=True, sinks=jnp.zeros((2,)))


@pytest.mark.parametrize("window", [6])
def test_xla_path_sinks(window):
    """The XLA path (CPU) puts the sink in the denominator the same way, chunk and decode."""
    with jax.default_matmul_precision("highest"):  # a GPU's default f32 dot is TF32
        _check_xla_path_sinks(window)


def test_xla_chunk_attention_reads_the_span_holding_its_end():
    """The XLA path's chunk reads keys [0, span) for the smallest span of chunk_spans that holds
    its last position: the reference's output at every start (span 8, 16, 32 and 64)."""
    assert model_attention.chunk_spans(64, 1280) == [64, 128, 256, 512, 1024, 1280]
    assert model_attention.chunk_spans(16, 8) == [8]
    with jax.default_matmul_precision("highest"):
        cfg, impl = _xla_config(), type("Impl", (), {"kernels": "xla"})()
        k, v = filled_cache(jax.random.PRNGKey(7), 2, 64, 16, {1: 64})
        q = jax.random.normal(jax.random.PRNGKey(8), (8, 4, 16))
        for start in (0, 8, 20, 56):
            got = model_attention.chunk_attention(q, k, v, 1, jnp.int32(start), cfg, impl)
            ref = attention.chunk_attention_reference(q, k, v, 1, start)
            chex.assert_trees_all_close(got, ref.reshape(8, 64), atol=1e-5, rtol=0)


def _xla_config() -> Config:
    return Config(
        n_layers=1,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        context_length=64,
        vocab_size=16,
        rope_theta=1e4,
        rms_eps=1e-6,
        tied_output=True,
        head_dim=16,
    )


def _check_xla_path_sinks(window):
    cfg = _xla_config()
    key = jax.random.PRNGKey(window)
    k, v = filled_cache(key, 2, 64, 16, {1: 20})
    sinks = head_sinks(jax.random.fold_in(key, 2), 4)
    impl = type("Impl", (), {"kernels": "xla"})()
    q = jax.random.normal(jax.random.fold_in(key, 3), (8, 4, 16))
    got = model_attention.chunk_attention(q, k, v, 1, 12, cfg, impl, window, sinks)
    ref = attention.chunk_attention_reference(q, k, v, 1, 12, sinks=sinks, window=window or None)
    chex.assert_trees_all_close(got, ref.reshape(8, 64), atol=1e-5, rtol=0)
    positions = jnp.array([19, 5], jnp.int32)
    slots = jnp.array([1, 1], jnp.int32)
    got = model_attention.decode_attention(
        q[:2], k, v, slots, positions, cfg, impl, 32, window, sinks
    )
    ref = decode_attention.decode_attention_reference(
        q[:2, None], k, v, slots, positions + 1, sinks=sinks, window=window or None
    )
    chex.assert_trees_all_close(got, ref.reshape(2, 64), atol=1e-5, rtol=0)


def test_sink_kernels_lower_to_triton():
    """The kernels with sinks lower for a GPU (gpt-oss-20b's heads: 64 query, 8 KV, hd 64)."""
    from tests.test_attention import lower_for_gpu

    f16, i32 = jnp.float16, jax.ShapeDtypeStruct((), jnp.int32)
    cache = jax.ShapeDtypeStruct((2, 8, 4096, 64), f16)
    sinks = jax.ShapeDtypeStruct((64,), jnp.float32)
    for t_len in (16, 512):
        q = jax.ShapeDtypeStruct((t_len, 64, 64), f16)
        text = lower_for_gpu(
            lambda q, k, v, s, p, w, z: attention.chunk_attention(q, k, v, s, p, window=w, sinks=z),
            q,
            cache,
            cache,
            i32,
            i32,
            i32,
            sinks,
        )
        assert "chunk_attention" in text
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    q = jax.ShapeDtypeStruct((4, 1, 64, 64), f16)
    text = lower_for_gpu(
        lambda q, k, v, s, n, z: decode_attention.decode_attention(q, k, v, s, n, sinks=z),
        q,
        cache,
        cache,
        rows,
        rows,
        sinks,
    )
    assert "decode_attention" in text
