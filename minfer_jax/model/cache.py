"""KV cache pytree: per layer one K and one V buffer of slots, donated through every step.

Layout `[n_slots, n_kv_heads, max_len, head_dim]` per layer: slot s holds one sequence, position p
of it sits at `[s, :, p, :]`, so an attention kernel reads contiguous `[block, head_dim]` tiles of
one KV head, and a kernel call reads one layer's buffer in place (one array per layer: slicing a
layer out of a stacked `[L, ...]` buffer made XLA copy it, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax.model.config import Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # n_layers x [n_slots, n_kv_heads, max_len, head_dim]
    v: tuple[jax.Array, ...]

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def cache_shape(cfg: Config, n_slots: int, max_len: int) -> tuple[int, int, int, int]:
    return (n_slots, cfg.n_kv_heads, max_len, cfg.head_dim)


def init_cache(cfg: Config, n_slots: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = cache_shape(cfg, n_slots, max_len)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
    )


def cache_spec(cfg: Config, n_slots: int, max_len: int, dtype) -> KVCache:
    """The cache's shapes without memory (for ahead-of-time lowering)."""
    spec = jax.ShapeDtypeStruct(cache_shape(cfg, n_slots, max_len), dtype)
    return KVCache(k=(spec,) * cfg.n_layers, v=(spec,) * cfg.n_layers)


def cache_nbytes(cfg: Config, n_slots: int, max_len: int, dtype=jnp.float32) -> int:
    return 2 * cfg.n_layers * n_slots * max_len * cfg.kv_dim * jnp.dtype(dtype).itemsize
