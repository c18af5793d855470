"""KV cache pytree: one preallocated buffer per K and V for all layers, donated through every step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax.model.config import Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [n_layers, max_len, n_kv_heads, head_dim]
    v: jax.Array  # [n_layers, max_len, n_kv_heads, head_dim]

    @property
    def max_len(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: Config, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.n_layers, max_len, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_nbytes(cfg: Config, max_len: int, dtype=jnp.float32) -> int:
    return 2 * cfg.n_layers * max_len * cfg.kv_dim * jnp.dtype(dtype).itemsize
