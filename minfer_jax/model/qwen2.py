"""Qwen2 forward pass as pure functions: tokens + positions + cache -> logits + cache.

Math (per layer): h = x + Wo . attn(rope(Wq.n(x) + bq), rope(Wk.n(x) + bk), Wv.n(x) + bv);
x' = h + Wdown . (silu(Wgate.n(h)) * Wup.n(h)), with n = RMSNorm (eps from metadata), RoPE in
NeoX half-split form (base from metadata), GQA attention over the cache with a causal mask.
Layers are unrolled at trace time: on the GPU a loop iteration costs ~8 us, more than a small
model's whole per-layer weight read (docs/ARCHITECTURE.md).

Every weight matmul goes through ops.matmul, the single place kernels are dispatched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer, Params, embed_rows


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """NeoX RoPE: x [T, heads, hd] rotated by position [T]; pairs (i, i + hd/2)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))  # [hd/2]
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, hd/2]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """q [T, H, hd] at `positions` over cache k/v [S, Hkv, hd] (slot s holds position s) -> [T, H*hd]."""
    t, s = q.shape[0], k_all.shape[0]
    qg = q.reshape(t, cfg.n_kv_heads, cfg.n_rep, cfg.head_dim)  # [T, Hkv, rep, hd]
    scores = jnp.einsum("tgrd,sgd->grts", qg, k_all.astype(jnp.float32)) * (cfg.head_dim ** -0.5)  # [Hkv, rep, T, S]
    visible = jnp.arange(s)[None, :] <= positions[:, None]  # [T, S] causal over absolute positions
    scores = jnp.where(visible[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("grts,sgd->tgrd", probs, v_all.astype(jnp.float32))  # [T, Hkv, rep, hd]
    return out.reshape(t, cfg.d_model)


def layer_forward(x: jax.Array, layer: Layer, i: int, cache: KVCache, positions: jax.Array, cfg: Config,
                  impl: ops.Impl, span: int | None = None) -> tuple[jax.Array, KVCache]:
    """Decoder layer i. x [T, d] f32; the whole cache goes in and out so XLA updates it in place.

    span (static): attend over cache slots [0, span) only; every position < span must cover all
    keys the queries can see. None: the whole cache.
    """
    t, d, kv = x.shape[0], cfg.d_model, cfg.kv_dim
    qkv = jnp.concatenate(ops.norm_matmuls(x, layer.attn_norm, cfg.rms_eps, layer.qkv, impl),
                          axis=-1) + layer.qkv_bias  # [T, d + 2kv]
    q = qkv[:, :d].reshape(t, cfg.n_heads, cfg.head_dim)
    k = qkv[:, d:d + kv].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    v = qkv[:, d + kv:].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    # Tokens occupy consecutive slots starting at positions[0] (prefill bucket or decode step).
    # One update of the full [L, S, Hkv, hd] buffer: slicing out layer i first would copy it.
    at = (i, positions[0], 0, 0)
    cache = KVCache(k=jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at),
                    v=jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at))
    s = cache.max_len if span is None else span
    x = x + ops.matmul(attention(q, cache.k[i, :s], cache.v[i, :s], positions, cfg), layer.wo, impl)

    gate_up = jnp.concatenate(ops.norm_matmuls(x, layer.ffn_norm, cfg.rms_eps, layer.gate_up, impl),
                              axis=-1)  # [T, 2ff]
    gate, up = gate_up[:, :cfg.d_ff], gate_up[:, cfg.d_ff:]
    x = x + ops.matmul(jax.nn.silu(gate) * up, layer.w_down, impl)
    return x, cache


def forward_hidden(params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, cfg: Config,
                   impl: ops.Impl, span: int | None = None) -> tuple[jax.Array, KVCache]:
    """tokens [T] at positions [T] (consecutive) -> final normed hidden [T, d] f32 and the updated cache."""
    x = embed_rows(params.embed, tokens)  # [T, d]
    for i, layer in enumerate(params.layers):  # unrolled at trace time
        x, cache = layer_forward(x, layer, i, cache, positions, cfg, impl, span)
    return ops.rms_norm(x, params.out_norm, cfg.rms_eps), cache


def logits_from_hidden(params: Params, h: jax.Array, impl: ops.Impl) -> jax.Array:
    """h [T, d] -> logits [T, vocab] f32 (output.weight, or token_embd when tied)."""
    return ops.matmul(h, params.head, impl)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, cfg: Config,
            impl: ops.Impl, span: int | None = None) -> tuple[jax.Array, KVCache]:
    """tokens [T] at consecutive positions [T] -> logits [T, vocab] f32 and the updated cache."""
    h, cache = forward_hidden(params, tokens, positions, cache, cfg, impl, span)
    return logits_from_hidden(params, h, impl), cache
