"""Qwen2 forward pass as pure functions: tokens + positions + cache -> logits + cache.

Math (per layer): h = x + Wo . attn(rope(Wq.n(x) + bq), rope(Wk.n(x) + bk), Wv.n(x) + bv);
x' = h + Wdown . (silu(Wgate.n(h)) * Wup.n(h)), with n = RMSNorm (eps from metadata), RoPE in
NeoX half-split form (base from metadata), GQA attention over the cache with a causal mask.
Layers are unrolled at trace time: on the GPU a loop iteration costs ~8 us, more than a small
model's whole per-layer weight read (docs/ARCHITECTURE.md).

Two entry points share the layer math:
- `forward_chunk`: T consecutive tokens of one sequence (cache slot) from position `start`
  (prefill, in fixed-size chunks);
- `forward_decode`: one token for each of B rows, each in its own slot at its own position.
Every weight matmul goes through ops.matmul, attention through model/attention.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model import attention
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


def _qkv(x: jax.Array, layer: Layer, positions: jax.Array, cfg: Config, impl: ops.Impl):
    """x [T, d] -> q [T, H, hd], k and v [T, Hkv, hd] (q and k rotated to their positions)."""
    t, d, kv = x.shape[0], cfg.d_model, cfg.kv_dim
    qkv = jnp.concatenate(ops.norm_matmuls(x, layer.attn_norm, cfg.rms_eps, layer.qkv, impl),
                          axis=-1) + layer.qkv_bias  # [T, d + 2kv]
    q = qkv[:, :d].reshape(t, cfg.n_heads, cfg.head_dim)
    k = qkv[:, d:d + kv].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    v = qkv[:, d + kv:].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def _row_matmul(par, which: str, x: jax.Array, w, impl: ops.Impl) -> jax.Array:
    """o ("attn_out") and down ("ffn_out"): one device's matmul, or a shard's partial product + all-reduce."""
    return ops.matmul(x, w, impl) if par is None else par.row_matmul(which, x, w, impl)


def _ffn(x: jax.Array, layer: Layer, cfg: Config, impl: ops.Impl, par=None) -> jax.Array:
    gate_up = jnp.concatenate(ops.norm_matmuls(x, layer.ffn_norm, cfg.rms_eps, layer.gate_up, impl),
                              axis=-1)  # [T, 2ff]
    gate, up = gate_up[:, :cfg.d_ff], gate_up[:, cfg.d_ff:]
    return x + _row_matmul(par, "ffn_out", jax.nn.silu(gate) * up, layer.w_down, impl)


def _layers(params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, cfg: Config,
            impl: ops.Impl, attend: Callable, par=None) -> tuple[jax.Array, KVCache]:
    """Embed, run every layer (unrolled) with `attend(i, q, k, v, k_cache, v_cache)`, final norm.
    par: None on one device; inside shard_map the shard's hooks (sharding.TensorParallel)."""
    x = embed_rows(params.embed, tokens)  # [T, d]
    ks, vs = list(cache.k), list(cache.v)
    for i, layer in enumerate(params.layers):  # unrolled at trace time
        q, k, v = _qkv(x, layer, positions, cfg, impl)
        ks[i], vs[i], att = attend(q, k.astype(ks[i].dtype), v.astype(vs[i].dtype), ks[i], vs[i])
        x = _ffn(x + _row_matmul(par, "attn_out", att, layer.wo, impl), layer, cfg, impl, par)
    return ops.rms_norm(x, params.out_norm, cfg.rms_eps), KVCache(k=tuple(ks), v=tuple(vs))


def forward_chunk(params: Params, tokens: jax.Array, slot: jax.Array, start: jax.Array, cache: KVCache,
                  cfg: Config, impl: ops.Impl, par=None) -> tuple[jax.Array, KVCache]:
    """tokens [T] of sequence `slot` at positions start + [0, T) -> final normed hidden [T, d], cache."""
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(q, k, v, k_cache, v_cache):
        at = (slot, 0, start, 0)  # [T, Hkv, hd] -> the slot's rows [Hkv, start:start+T]
        k_cache = jax.lax.dynamic_update_slice(k_cache, jnp.swapaxes(k, 0, 1)[None], at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, jnp.swapaxes(v, 0, 1)[None], at)
        return k_cache, v_cache, attention.chunk_attention(q, k_cache, v_cache, slot, start, cfg, impl)

    return _layers(params, tokens, positions, cache, cfg, impl, attend, par)


def forward_decode(params: Params, tokens: jax.Array, slots: jax.Array, positions: jax.Array, cache: KVCache,
                   cfg: Config, impl: ops.Impl, span: int | None = None, par=None) -> tuple[jax.Array, KVCache]:
    """tokens [B], row b in slot slots[b] at position positions[b] -> logits [B, vocab] f32, cache.

    span (static, XLA path): attend over cache positions [0, span) only; every position < span.
    par (inside shard_map): the logits are this shard's vocabulary slice [B, vocab / TP].
    """
    def attend(q, k, v, k_cache, v_cache):
        k_cache = k_cache.at[slots, :, positions].set(k)  # one [Hkv, hd] row per sequence
        v_cache = v_cache.at[slots, :, positions].set(v)
        return k_cache, v_cache, attention.decode_attention(q, k_cache, v_cache, slots, positions, cfg, impl, span)

    h, cache = _layers(params, tokens, positions, cache, cfg, impl, attend, par)
    return logits_from_hidden(params, h, impl), cache


def logits_from_hidden(params: Params, h: jax.Array, impl: ops.Impl) -> jax.Array:
    """h [T, d] -> logits [T, vocab] f32 (output.weight, or token_embd when tied)."""
    return ops.matmul(h, params.head, impl)
