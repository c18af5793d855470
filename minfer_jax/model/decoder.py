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

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.model import attention, deltanet
from minfer_jax.model import cache as kv_cache
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
    recur: Callable | None = None,
) -> tuple[residual.Stream, KVCache]:
    """Embed, run every layer (unrolled) with `attend(q, k, v, k_cache, v_cache, window, sinks)`
    -> the last layer's output, not normed. attend_projected (a decode step's; None: a chunk's):
    `attend_projected(parts, widths, bias, inv_freq, k_cache, v_cache, window)`, which a layer's
    attention.Attend takes where attention.takes_projected; with it the stream takes the decode
    epilogues where residual.start decides. A DeltaNet layer (hybrid models) calls
    `recur(proj, weights, conv_state, delta_state) -> (out, conv_state, delta_state)` on its own
    entries of cache.conv / cache.delta. par: None on one device; inside shard_map the shard's
    hooks (sharding.TensorParallel)."""
    fam = family(cfg)
    rows = fam.embed(params, tokens, cfg)  # [T, d]
    per_layer = getattr(fam, "per_layer_inputs", None)  # gemma4: [L, T, n_pl] or None
    layer_inputs = None if per_layer is None else per_layer(params, tokens, rows, cfg, impl)
    x = residual.start(rows, impl, par, decode=attend_projected is not None)
    if not attention.takes_projected(cfg, x.join, cache):
        attend_projected = None
    ks, vs = list(cache.k), list(cache.v)
    convs, deltas = list(cache.conv), list(cache.delta)
    kv_index = {layer: j for j, layer in enumerate(cfg.attention_layers)}
    rec_index = {layer: j for j, layer in enumerate(cfg.recurrent_layer_ids)}
    for i, layer in enumerate(params.layers):  # unrolled at trace time
        # a gemma4 shared-KV layer reads its source layer's cache (written earlier in this
        # step) and writes nothing: attend gets k = v = None
        j, r = kv_index.get(cfg.kv_source(i), -1), rec_index.get(i, -1)
        shared = cfg.kv_source(i) != i

        def layer_attend(q, k, v, sinks=None, i=i, j=j, shared=shared):
            if shared:  # reads what its source layer wrote this step; writes nothing
                k = v = None
            q, k, v = kv_cache.rotate_in(q, k, v, ks[j], vs[j])  # 8-bit layers: rotated
            ks[j], vs[j], att = attend(q, k, v, ks[j], vs[j], cfg.window(i), sinks)
            return kv_cache.rotate_out(att, vs[j], cfg.layer_head_dim(i))

        def layer_attend_projected(parts, widths, bias, inv_freq, i=i, j=j):
            ks[j], vs[j], att = attend_projected(
                parts, widths, bias, inv_freq, ks[j], vs[j], cfg.window(i)
            )
            return att

        def layer_recur(proj, weights, r=r):
            out, convs[r], deltas[r] = recur(proj, weights, convs[r], deltas[r])
            return out

        projected = None if attend_projected is None else layer_attend_projected
        call = LayerCall(
            positions=positions,
            attend=attention.Attend(layer_attend, positions, cfg, impl, projected),
            cfg=cfg,
            impl=impl,
            rope_freqs=params.rope_freqs,
            recur=layer_recur,
            layer_input=None if layer_inputs is None else layer_inputs[i],
        )
        x = fam.block(x, layer, i, call)
    return x, dataclasses.replace(  # any other part (the MTP block's, model/mtp.py) as it was
        cache, k=tuple(ks), v=tuple(vs), conv=tuple(convs), delta=tuple(deltas)
    )


def forward_chunk(
    params: Params,
    tokens: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    par=None,
    n_valid: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """tokens [T] of sequence `slot` at positions start + [0, T) -> final normed hidden [T, d],
    cache. n_valid: the real tokens (the rest padding, which must not reach a recurrent state);
    None: all T. A recurrent state starts from zeros at start 0 (the slot may hold another
    sequence's) and is otherwise the one the slot's previous chunk left."""
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    n_valid = tokens.shape[0] if n_valid is None else n_valid

    def recur(proj, w, conv, delta):
        fresh = start == 0
        out, c, s = deltanet.mix_chunk(
            proj,
            w,
            jnp.where(fresh, 0.0, conv[slot]),
            jnp.where(fresh, 0.0, delta[slot]),
            n_valid,
            cfg,
            impl,
        )
        return out, conv.at[slot].set(c), delta.at[slot].set(s)

    def attend(q, k, v, k_cache, v_cache, window, sinks):
        if k is not None:  # None: a shared-KV layer, reading what its source layer wrote
            k_cache = kv_cache.write_chunk(k_cache, k, slot, start)  # cast, or quantized
            v_cache = kv_cache.write_chunk(v_cache, v, slot, start)
        return (
            k_cache,
            v_cache,
            attention.chunk_attention(q, k_cache, v_cache, slot, start, cfg, impl, window, sinks),
        )

    x, cache = _layers(params, tokens, positions, cache, cfg, impl, attend, par, recur=recur)
    return ops.rms_norm(x.rows, params.out_norm, cfg.rms_eps), cache


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
    recur: Callable | None = None,
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
    impl.fused_decode on the kernels, one device: the layers' products join the residual stream
    through the split-K epilogue kernels (residual.start decides), and a NeoX layer's q / k / v
    partials go to attention.decode_attention_projected where attention.takes_projected.
    recur: a DeltaNet layer's step (_layers' `recur`) in place of one mix_step per row and slot
    (model/speculative.py: the rows of one sequence, in order).
    """
    logits, _, cache = forward_decode_hidden(
        params, tokens, slots, positions, cache, cfg, impl, span, par, recur
    )
    return logits, cache


def forward_decode_hidden(
    params: Params,
    tokens: jax.Array,
    slots: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    span: int | None = None,
    par=None,
    recur: Callable | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """forward_decode, also returning the final normed hidden states [B, d] f32 (what the head
    reads; an MTP drafter's input, model/mtp.py). Unused, XLA drops their computation."""
    if impl.deterministic and impl.kernels == "pallas" and tokens.shape[0] == 1:
        pair = [jnp.concatenate([a, a]) for a in (tokens, slots, positions)]
        logits, hidden, cache = forward_decode_hidden(
            params, *pair, cache, cfg, impl, span, par, recur
        )
        return logits[:1], hidden[:1], cache
    if impl.deterministic and impl.kernels != "pallas" and tokens.shape[0] > 1:

        def one_row(cache, row):
            token, slot, position = row
            logits, hidden, cache = forward_decode_hidden(
                params, token[None], slot[None], position[None], cache, cfg, impl, span, par
            )
            return cache, (logits[0], hidden[0])

        cache, (logits, hidden) = jax.lax.scan(one_row, cache, (tokens, slots, positions))
        return logits, hidden, cache

    def attend(q, k, v, k_cache, v_cache, window, sinks):
        if k is not None:  # None: a shared-KV layer (forward_chunk's attend)
            k_cache = kv_cache.write_rows(k_cache, k, slots, positions)  # one row per sequence
            v_cache = kv_cache.write_rows(v_cache, v, slots, positions)
        return (
            k_cache,
            v_cache,
            attention.decode_attention(
                q, k_cache, v_cache, slots, positions, cfg, impl, span, window, sinks
            ),
        )

    def recur_rows(proj, w, conv, delta):
        out, c, s = deltanet.mix_step(proj, w, conv[slots], delta[slots], cfg)
        return out, conv.at[slots].set(c), delta.at[slots].set(s)

    def attend_projected(parts, widths, bias, inv_freq, k_cache, v_cache, window):
        return attention.decode_attention_projected(
            parts, widths, bias, inv_freq, k_cache, v_cache, slots, positions, cfg, impl, window
        )

    x, cache = _layers(
        params,
        tokens,
        positions,
        cache,
        cfg,
        impl,
        attend,
        par,
        attend_projected,
        recur_rows if recur is None else recur,
    )
    normed = ops.rms_norm(x.rows, params.out_norm, cfg.rms_eps)
    if x.join.epilogues:  # the final norm applied by the head's GEMV, from the sums of squares
        [logits] = residual.norm_matmuls(x, params.out_norm, cfg.rms_eps, [params.head], impl)
        return soft_cap(logits, cfg), normed, cache
    return logits_from_hidden(params, normed, impl, cfg), normed, cache


def logits_from_hidden(params: Params, h: jax.Array, impl: ops.Impl, cfg: Config) -> jax.Array:
    """h [T, d] -> logits [T, vocab] f32 (output.weight, or token_embd when tied), soft-capped
    where the family caps them."""
    return soft_cap(ops.matmul(h, params.head, impl), cfg)


def soft_cap(logits: jax.Array, cfg: Config) -> jax.Array:
    """c tanh(logits / c) with c = Config.final_softcap (gemma4); as they are where it is 0."""
    c = cfg.final_softcap
    return logits if not c else c * jnp.tanh(logits / c)
