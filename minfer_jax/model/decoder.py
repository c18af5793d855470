"""The decoder every family shares: tokens + positions + cache -> hidden states / logits + cache.

Two entry points share the layer loop:
- `forward_chunk`: T consecutive tokens of one sequence (cache slot) from position `start`
  (prefill, in fixed-size chunks);
- `forward_decode`: one token for each of B rows, each in its own slot at its own position.
The layer math is the family's (`families.family(cfg).block`, chosen by the static Config); the
cache writes, attention (model/attention.py), final norm and head are here, once.
Layers are unrolled at trace time: on the GPU a loop iteration costs ~8 us, more than a small
model's whole per-layer weight read (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model import attention, layers
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.families import family
from minfer_jax.model.layers import LayerCall
from minfer_jax.model.weights import Params


def _layers(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    attend: Callable,
    par=None,
    attend_projected: Callable | None = None,
    epilogues: bool = False,
) -> tuple[layers.Hidden, KVCache]:
    """Embed, run every layer (unrolled) with `attend(q, k, v, k_cache, v_cache, window, sinks)`
    (or, where the family's layer takes it, `attend_projected(parts, widths, bias, inv_freq,
    k_cache, v_cache, window)`: LayerCall) -> the last layer's output, not normed (with epilogues a
    layers.Residual: LayerCall.epilogues). par: None on one device; inside shard_map the
    shard's hooks (sharding.TensorParallel)."""
    fam = family(cfg)
    x = fam.embed(params, tokens, cfg)  # [T, d]
    ks, vs = list(cache.k), list(cache.v)
    for i, layer in enumerate(params.layers):  # unrolled at trace time

        def layer_attend(q, k, v, sinks=None, i=i):
            ks[i], vs[i], att = attend(
                q, k.astype(ks[i].dtype), v.astype(vs[i].dtype), ks[i], vs[i], cfg.window(i), sinks
            )
            return att

        def layer_attend_projected(parts, widths, bias, inv_freq, i=i):
            ks[i], vs[i], att = attend_projected(
                parts, widths, bias, inv_freq, ks[i], vs[i], cfg.window(i)
            )
            return att

        call = LayerCall(
            positions=positions,
            attend=layer_attend,
            cfg=cfg,
            impl=impl,
            par=par,
            rope_freqs=params.rope_freqs,
            attend_projected=None if attend_projected is None else layer_attend_projected,
            epilogues=epilogues,
        )
        x = fam.block(x, layer, i, call)
    return x, KVCache(k=tuple(ks), v=tuple(vs))


def forward_chunk(
    params: Params,
    tokens: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    par=None,
) -> tuple[jax.Array, KVCache]:
    """tokens [T] of sequence `slot` at positions start + [0, T) -> final normed hidden [T, d],
    cache."""
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(q, k, v, k_cache, v_cache, window, sinks):
        at = (slot, 0, start, 0)  # [T, Hkv, hd] -> the slot's rows [Hkv, start:start+T]
        k_cache = jax.lax.dynamic_update_slice(k_cache, jnp.swapaxes(k, 0, 1)[None], at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, jnp.swapaxes(v, 0, 1)[None], at)
        return (
            k_cache,
            v_cache,
            attention.chunk_attention(q, k_cache, v_cache, slot, start, cfg, impl, window, sinks),
        )

    x, cache = _layers(params, tokens, positions, cache, cfg, impl, attend, par)
    return ops.rms_norm(x, params.out_norm, cfg.rms_eps), cache


def forward_decode(
    params: Params,
    tokens: jax.Array,
    slots: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    span: int | None = None,
    par=None,
) -> tuple[jax.Array, KVCache]:
    """tokens [B], row b in slot slots[b] at position positions[b] -> logits [B, vocab] f32, cache.

    span (static, XLA path): attend over cache positions [0, span) only; every position < span.
    par (inside shard_map): the logits are this shard's vocabulary slice [B, vocab / TP].
    impl.deterministic off the compiled kernels: the rows run one after another through the
    one-row step (a scan carrying the cache), since XLA's dots and reductions sum in an order
    that depends on the row count; the kernels keep each row's sums the same themselves (ops.py).
    On the compiled kernels a lone row runs as two identical rows (their cache writes coincide):
    XLA compiles a one-row step's fusions differently from a many-row step's, and rounds
    differently there, while every step of two or more rows gives a row the same bits
    (docs/BENCHMARKS.md, "Batch invariance").
    impl.fused_decode on the kernels (one device, head_dim / 2 a power of two): a family layer that
    takes LayerCall.attend_projected (Qwen2's) hands its q / k / v GEMVs' partials to
    attention.decode_attention_projected (decode_qkv's epilogue kernel, then the attention).
    """
    if impl.deterministic and impl.kernels == "pallas" and tokens.shape[0] == 1:
        pair = [jnp.concatenate([a, a]) for a in (tokens, slots, positions)]
        logits, cache = forward_decode(params, *pair, cache, cfg, impl, span, par)
        return logits[:1], cache
    if impl.deterministic and impl.kernels != "pallas" and tokens.shape[0] > 1:

        def one_row(cache, row):
            token, slot, position = row
            logits, cache = forward_decode(
                params, token[None], slot[None], position[None], cache, cfg, impl, span, par
            )
            return cache, logits[0]

        cache, logits = jax.lax.scan(one_row, cache, (tokens, slots, positions))
        return logits, cache

    def attend(q, k, v, k_cache, v_cache, window, sinks):
        k_cache = k_cache.at[slots, :, positions].set(k)  # one [Hkv, hd] row per sequence
        v_cache = v_cache.at[slots, :, positions].set(v)
        return (
            k_cache,
            v_cache,
            attention.decode_attention(
                q, k_cache, v_cache, slots, positions, cfg, impl, span, window, sinks
            ),
        )

    def attend_projected(parts, widths, bias, inv_freq, k_cache, v_cache, window):
        return attention.decode_attention_projected(
            parts, widths, bias, inv_freq, k_cache, v_cache, slots, positions, cfg, impl, window
        )

    epilogues = impl.fused_decode and impl.kernels != "xla" and par is None
    half = cfg.head_dim // 2  # the q/k/v epilogue kernel's tiles: a power of two
    projected = epilogues and half & (half - 1) == 0
    x, cache = _layers(
        params,
        tokens,
        positions,
        cache,
        cfg,
        impl,
        attend,
        par,
        attend_projected if projected else None,
        epilogues,
    )
    rows, sumsq = layers.hidden(x)
    if epilogues:  # the final norm applied by the head's GEMV, from the sums of squares
        [logits] = ops.norm_matmuls(rows, params.out_norm, cfg.rms_eps, [params.head], impl, sumsq)
        return logits, cache
    return logits_from_hidden(params, ops.rms_norm(rows, params.out_norm, cfg.rms_eps), impl), cache


def logits_from_hidden(params: Params, h: jax.Array, impl: ops.Impl) -> jax.Array:
    """h [T, d] -> logits [T, vocab] f32 (output.weight, or token_embd when tied)."""
    return ops.matmul(h, params.head, impl)
