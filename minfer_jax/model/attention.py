"""Attention over the slot cache: the one place that picks the XLA math or the Pallas kernels.

Two shapes of query, both reading one layer's cache `[n_slots, Hkv, S, hd]` in place:
- chunk: T queries of one sequence at positions [start, start + T) over keys [0, start + t]
  (prefill; pallas/attention.py's flash kernel reads keys up to start + T only);
- decode: one query per row b at position pos[b] over keys [0, pos[b]] of its slot
  (pallas/decode_attention.py: split over the key axis, reads [0, len) only).
On the "xla" path (CPU) both are einsums with a position mask: a chunk attends over the whole
slot, decode over a static power-of-two `span` of it (shape buckets chosen by plan.Plan).
A layer reaches its cache through an `Attend` (the decoder's, one per layer and step); a decode
step with the epilogue kernels (residual.Join) hands a NeoX layer's q / k / v partials to one
epilogue kernel (pallas/decode_qkv.py) where `takes_projected` allows: the one place that choice
is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minfer_jax import residual
from minfer_jax.model import cache as kv_cache
from minfer_jax.model import layers
from minfer_jax.model.cache import KVCache, Layer
from minfer_jax.model.config import Config
from minfer_jax.pallas import attention, decode_qkv
from minfer_jax.pallas import decode_attention as dec


def _kernels(impl) -> bool:
    return impl.kernels in ("pallas", "interpret")


def _kernel_options(cfg: Config, window: int, sinks: jax.Array | None = None) -> dict:
    """The file's softmax scale, the layer's window and its sinks, passed only where they differ
    from the kernels' defaults (head_dim^-0.5, no window, no sinks). The window reaches the kernel
    as an operand: one kernel serves every sliding-window layer."""
    options: dict = {"sm_scale": cfg.attn_scale} if cfg.attn_scale else {}
    if window:
        options["window"] = jnp.int32(window)
    if sinks is not None:
        options["sinks"] = sinks
    return options


def _softmax(scores: jax.Array, visible: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Masked softmax over the last axis of scores [Hkv, rep, ..., S]; sinks [H] (gpt-oss): each
    head's sink logit joins the denominator only (llama.cpp's soft_max_add_sinks)."""
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    n_kv, rep = scores.shape[0], scores.shape[1]
    column = sinks.astype(jnp.float32).reshape(n_kv, rep, *(1,) * (scores.ndim - 2))
    column = jnp.broadcast_to(column, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]


def chunk_attention(
    q: jax.Array,
    k_cache: Layer,
    v_cache: Layer,
    slot: jax.Array,
    start: jax.Array,
    cfg: Config,
    impl,
    window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, H, hd] at positions start + [0, T) of sequence `slot` -> [T, H * hd] f32.

    window > 0 (sliding-window layers): a query at p sees keys p - window < key <= p only.
    sinks [H] (or None): each head's attention sink logit, in the softmax's denominator only."""
    t = q.shape[0]
    if _kernels(impl):
        out = attention.chunk_attention(
            q,
            k_cache,
            v_cache,
            slot,
            start,
            interpret=impl.kernels == "interpret",
            **_kernel_options(cfg, window, sinks),
        )
        return out.reshape(t, -1)
    positions = start + jnp.arange(t, dtype=jnp.int32)

    def attend(span: int) -> jax.Array:  # over cache positions [0, span) only
        k = kv_cache.read(k_cache, (slot, slice(None), slice(0, span)))  # [Hkv, span, hd] f32
        v = kv_cache.read(v_cache, (slot, slice(None), slice(0, span)))
        qg = q.astype(jnp.float32).reshape(t, k.shape[0], -1, q.shape[-1])  # the layer's shapes
        scores = jnp.einsum("tgrd,gsd->grts", qg, k) * cfg.softmax_scale  # [Hkv, rep, T, span]
        visible = _visible(jnp.arange(span)[None, :], positions[:, None], window)  # [T, span]
        probs = _softmax(scores, visible[None, None], sinks)
        return jnp.einsum("grts,gsd->tgrd", probs, v).reshape(t, -1)

    spans = chunk_spans(t, k_cache.shape[2])
    if len(spans) == 1:
        return attend(spans[0])
    # the smallest span holding the chunk's last position: keys past it are all masked
    which = jnp.sum(jnp.asarray(spans[:-1]) < start + t)
    return jax.lax.switch(which, [lambda s=s: attend(s) for s in spans])


def chunk_spans(t: int, max_len: int) -> list[int]:
    """The key spans a chunk of t queries on the XLA path may attend over (chunk_attention picks
    the smallest that holds its last position): t, 2t, 4t, ... up to the cache's length. Reading
    the whole cache cost a 64-token chunk of the 0.5B 382 vs 281 ms at a 1024-key cache
    (docs/BENCHMARKS.md, "Int8 layer matrices for one-row dots")."""
    spans = [min(t, max_len)]
    while spans[-1] < max_len:
        spans.append(min(2 * spans[-1], max_len))
    return spans


def _visible(keys: jax.Array, positions: jax.Array, window: int) -> jax.Array:
    """Causal mask, narrowed to the last `window` positions on sliding-window layers (llama.cpp:
    a key is masked once position - key >= window)."""
    visible = keys <= positions
    if window:
        visible = visible & (positions - keys < window)
    return visible


def decode_attention(
    q: jax.Array,
    k_cache: Layer,
    v_cache: Layer,
    slots: jax.Array,
    positions: jax.Array,
    cfg: Config,
    impl,
    span: int | None = None,
    window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, H, hd], row b at position positions[b] of slot slots[b] -> [B, H * hd] f32.

    span (static, XLA path only): keys are read from slots [0, span); every position < span.
    window > 0: keys positions[b] - window < key <= positions[b] only. sinks: chunk_attention's.
    """
    b = q.shape[0]
    if _kernels(impl):
        out = dec.decode_attention(
            q[:, None],
            k_cache,
            v_cache,
            slots,
            positions + 1,
            interpret=impl.kernels == "interpret",
            deterministic=impl.deterministic,
            fused=impl.fused_decode,
            **_kernel_options(cfg, window, sinks),
        )
        return out.reshape(b, -1)
    s = k_cache.shape[2] if span is None else span
    k = kv_cache.read(k_cache, (slots, slice(None), slice(0, s)))  # [B, Hkv, span, hd] f32
    v = kv_cache.read(v_cache, (slots, slice(None), slice(0, s)))
    qg = q.astype(jnp.float32).reshape(b, k.shape[1], -1, q.shape[-1])
    scores = jnp.einsum("bgrd,bgsd->bgrs", qg, k) * cfg.softmax_scale  # [B, Hkv, rep, span]
    visible = _visible(jnp.arange(s)[None, :], positions[:, None], window)  # [B, span]
    if sinks is None:
        probs = _softmax(scores, visible[:, None, None], None)
    else:  # _softmax's sinks want [Hkv, rep, ...] first
        by_head = _softmax(scores.transpose(1, 2, 0, 3), visible[None, None], sinks)
        probs = by_head.transpose(2, 0, 1, 3)
    return jnp.einsum("bgrs,bgsd->bgrd", probs, v).reshape(b, -1)


def decode_attention_projected(
    parts: list[jax.Array],
    widths: tuple[int, ...],
    bias: jax.Array | None,
    inv_freq: jax.Array,
    k_cache: Layer,
    v_cache: Layer,
    slots: jax.Array,
    positions: jax.Array,
    cfg: Config,
    impl,
    window: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decode on the kernels (impl.fused_decode) from the q / k / v projections' split-K partials
    (ops.norm_matmul_parts; widths: each one's true columns): one kernel sums them, adds bias,
    applies NeoX RoPE with inv_freq, writes k / v at positions and lays q out for the attention
    kernel (pallas/decode_qkv.py) -> (k_cache, v_cache, [B, H * hd] f32)."""
    b, interpret = positions.shape[0], impl.kernels == "interpret"
    qg, k_cache, v_cache = decode_qkv.write_qkv(
        tuple(parts),
        bias,
        inv_freq,
        positions,
        slots,
        k_cache,
        v_cache,
        widths=widths,
        n_heads=cfg.n_heads,
        rows=dec.query_rows(1, cfg.n_heads, cfg.n_kv_heads),
        interpret=interpret,
    )
    out = dec.decode_attention_grouped(
        qg,
        k_cache,
        v_cache,
        slots,
        positions + 1,
        nq=1,
        n_heads=cfg.n_heads,
        interpret=interpret,
        deterministic=impl.deterministic,
        **_kernel_options(cfg, window),
    )
    return k_cache, v_cache, out.reshape(b, cfg.q_dim)


def takes_projected(cfg: Config, join: residual.Join, cache: KVCache) -> bool:
    """Whether a step's NeoX layers without q / k norms (Attend.neox) hand their q / k / v GEMVs'
    partials to decode_attention_projected: a decode step with the epilogue kernels, head_dim / 2
    a power of two (the epilogue kernel's tiles), and no rotated 8-bit layer (quant/kv.py: rotated
    in XLA, outside the epilogue kernel)."""
    half = cfg.head_dim // 2
    rotated = any(kv_cache.rotated(layer) for layer in (*cache.k, *cache.v))
    return join.epilogues and half & (half - 1) == 0 and not rotated


@dataclasses.dataclass(frozen=True)
class Attend:
    """One layer's attention through its cache in one step (a trace-time container; the decoder
    makes it): attend(q [T, H, hd], k, v [T, Hkv, hd], sinks=None) -> [T, H * hd], the cache
    write and the attention (sinks [H]: gpt-oss's per-head sink logits; k = v = None: a shared-KV
    layer reading its source layer's cache); `neox` a whole NeoX layer's attention from x."""

    qkv: Callable  # (q, k, v, sinks) -> [T, H * hd]
    positions: jax.Array  # [T] int32
    cfg: Config
    impl: Any  # ops.Impl
    # where takes_projected: (parts, widths, bias, inv_freq) -> [T, H * hd] through
    # decode_attention_projected
    projected: Callable | None = None

    def __call__(self, q, k, v, sinks=None) -> jax.Array:
        return self.qkv(q, k, v, sinks)

    def neox(self, x: residual.Stream, layer) -> jax.Array:
        """Attention of a layer with NeoX RoPE (the file's base, unscaled) and no q / k norms
        (Qwen2's): q / k / v of attn_norm(x) (+ biases), rotated, through the cache; or the
        projections' split-K partials to the epilogue kernel that does all that (projected)."""
        cfg = self.cfg
        if self.projected is not None:
            parts = residual.norm_matmul_parts(
                x, layer.attn_norm, cfg.rms_eps, layer.qkv, self.impl
            )
            widths = tuple(w.shape[0] for w in layer.qkv)
            inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, None, 1.0)
            return self.projected(parts, widths, layer.qkv_bias, inv_freq)
        q, k, v = layers.project_qkv(x, layer, cfg, self.impl)
        q = layers.rope_neox(q, self.positions, cfg.rope_theta)
        k = layers.rope_neox(k, self.positions, cfg.rope_theta)
        return self(q, k, v)
