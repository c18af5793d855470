"""KV cache pytree: per layer one K and one V buffer of slots, donated through every step.

Layout `[n_slots, n_kv_heads, max_len, head_dim]` per layer: slot s holds one sequence, position p
of it sits at `[s, :, p, :]`, so an attention kernel reads contiguous `[block, head_dim]` tiles of
one KV head, and a kernel call reads one layer's buffer in place (one array per layer: slicing a
layer out of a stacked `[L, ...]` buffer made XLA copy it, docs/ARCHITECTURE.md).
A hybrid model (qwen35) has K/V for its attention layers only (Config.attention_layers) and, per
Gated DeltaNet layer, each slot's conv state [K - 1, conv_dim] and delta state [Hv, dk, dv], f32
whatever the cache dtype (a recurrent state is never truncated: a new sequence starts from zeros,
decoder.py). They ride in the same pytree, so every step donates and returns them with the K/V.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax.model.config import Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # attention layers x [n_slots, n_kv_heads, max_len, head_dim]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...] = ()  # DeltaNet layers x [n_slots, K - 1, conv_dim] f32
    delta: tuple[jax.Array, ...] = ()  # DeltaNet layers x [n_slots, Hv, dk, dv] f32

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def cache_shape(
    cfg: Config, n_slots: int, max_len: int, layer: int | None = None
) -> tuple[int, int, int, int]:
    """One layer's K (or V) buffer; layer None: the full-attention layers' (gemma4's sliding
    layers may have another head dim and KV head count: Config.layer_head_dim)."""
    if layer is None:
        return (n_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
    return (n_slots, cfg.layer_kv_heads(layer), max_len, cfg.layer_head_dim(layer))


def recurrent_shapes(cfg: Config, n_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state, delta state) shapes of one DeltaNet layer's slots."""
    conv = (n_slots, max(cfg.ssm_conv_kernel - 1, 0), cfg.ssm_conv_dim)
    return conv, (n_slots, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state)


def init_cache(cfg: Config, n_slots: int, max_len: int, dtype=jnp.float32) -> KVCache:
    spec = cache_spec(cfg, n_slots, max_len, dtype)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)


def cache_spec(cfg: Config, n_slots: int, max_len: int, dtype) -> KVCache:
    """The cache's shapes without memory (for ahead-of-time lowering)."""
    specs = tuple(
        jax.ShapeDtypeStruct(cache_shape(cfg, n_slots, max_len, i), dtype)
        for i in cfg.attention_layers
    )
    n_rec = len(cfg.recurrent_layer_ids)
    states = [jax.ShapeDtypeStruct(s, jnp.float32) for s in recurrent_shapes(cfg, n_slots)]
    return KVCache(
        k=specs,
        v=specs,
        conv=(states[0],) * n_rec,
        delta=(states[1],) * n_rec,
    )


def cache_nbytes(cfg: Config, n_slots: int, max_len: int, dtype=jnp.float32) -> int:
    spec = cache_spec(cfg, n_slots, max_len, dtype)
    return int(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(spec)))
