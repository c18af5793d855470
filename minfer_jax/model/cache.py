"""KV cache pytree: per layer one K and one V buffer of slots, donated through every step.

Layout `[n_slots, n_kv_heads, max_len, head_dim]` per layer: slot s holds one sequence, position p
of it sits at `[s, :, p, :]`, so an attention kernel reads contiguous `[block, head_dim]` tiles of
one KV head, and a kernel call reads one layer's buffer in place (one array per layer: slicing a
layer out of a stacked `[L, ...]` buffer made XLA copy it, docs/ARCHITECTURE.md).
A hybrid model (qwen35) has K/V for its attention layers only (Config.attention_layers) and, per
Gated DeltaNet layer, each slot's conv state [K - 1, conv_dim] and delta state [Hv, dk, dv], f32
whatever the cache dtype (a recurrent state is never truncated: a new sequence starts from zeros,
decoder.py). They ride in the same pytree, so every step donates and returns them with the K/V.
An 8-bit K or V (kv_types "q8_0" / "fp8", quant/kv.py) is a QuantizedKV per layer in place of the
array: its values in that layout plus their scales; the writes below quantize, the attention
(model/attention.py) dequantizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax.model.config import Config
from minfer_jax.quant import kv
from minfer_jax.quant.kv import QuantizedKV

Layer = jax.Array | QuantizedKV  # one layer's K or V
KVTypes = tuple[str | None, str | None]  # (K, V): None for the float cache, else a kv.KV_TYPES
FLOAT_KV: KVTypes = (None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[Layer, ...]  # attention layers x [n_slots, n_kv_heads, max_len, head_dim]
    v: tuple[Layer, ...]
    conv: tuple[jax.Array, ...] = ()  # DeltaNet layers x [n_slots, K - 1, conv_dim] f32
    delta: tuple[jax.Array, ...] = ()  # DeltaNet layers x [n_slots, Hv, dk, dv] f32
    # the MTP block's (k, v [n_slots, Hkv, max_len, hd], hidden [n_slots, d] f32): its own KV cache
    # and the trunk's hidden state of each slot's last fed token (model/mtp.py); () without one
    mtp: tuple[jax.Array, ...] = ()

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


def type_names(dtype, kv_types: KVTypes) -> tuple[str, str]:
    """llama.cpp's names of the K and V cache types ("f16", "q8_0", ...)."""
    float_name = jnp.dtype(dtype).name.replace("float", "f")
    return (kv_types[0] or float_name, kv_types[1] or float_name)


def kv_label(dtype, kv_types: KVTypes) -> str:
    k, v = type_names(dtype, kv_types)
    return k if k == v else f"K {k}, V {v}"


def init_cache(
    cfg: Config,
    n_slots: int,
    max_len: int,
    dtype=jnp.float32,
    kv_types: KVTypes = FLOAT_KV,
    rotated: bool = True,
    mtp: bool = False,
) -> KVCache:
    spec = cache_spec(cfg, n_slots, max_len, dtype, kv_types, rotated, mtp)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)


def cache_spec(
    cfg: Config,
    n_slots: int,
    max_len: int,
    dtype,
    kv_types: KVTypes = FLOAT_KV,
    rotated: bool = True,
    mtp: bool = False,
) -> KVCache:
    """The cache's shapes without memory (for ahead-of-time lowering). dtype: the float cache's
    (and an 8-bit one's compute dtype); kv_types: KVTypes; rotated: kv.ROTATED_TYPES layers hold
    their rows rotated (quant/kv.py; rotate_in / rotate_out); mtp: with the MTP block's cache
    (float, of the block's one full-attention layer)."""

    def layer(kind: str | None, i: int):
        shape = cache_shape(cfg, n_slots, max_len, i)
        if kind is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return kv.spec(kind, shape, dtype, rotated and kind in kv.ROTATED_TYPES)

    kind_k, kind_v = kv_types
    n_rec = len(cfg.recurrent_layer_ids)
    states = [jax.ShapeDtypeStruct(s, jnp.float32) for s in recurrent_shapes(cfg, n_slots)]
    return KVCache(
        k=tuple(layer(kind_k, i) for i in cfg.attention_layers),  # type: ignore[misc]
        v=tuple(layer(kind_v, i) for i in cfg.attention_layers),  # type: ignore[misc]
        conv=(states[0],) * n_rec,
        delta=(states[1],) * n_rec,
        mtp=_mtp_spec(cfg, n_slots, max_len, dtype) if mtp else (),
    )


def _mtp_spec(cfg: Config, n_slots: int, max_len: int, dtype) -> tuple:
    kv = jax.ShapeDtypeStruct((n_slots, cfg.n_kv_heads, max_len, cfg.head_dim), dtype)
    return (kv, kv, jax.ShapeDtypeStruct((n_slots, cfg.d_model), jnp.float32))


def cache_nbytes(
    cfg: Config,
    n_slots: int,
    max_len: int,
    dtype=jnp.float32,
    kv_types: KVTypes = FLOAT_KV,
    rotated: bool = True,
    mtp: bool = False,
) -> int:
    """Bytes of the whole cache: 8-bit values and their scales as stored (the planner's count)."""
    spec = cache_spec(cfg, n_slots, max_len, dtype, kv_types, rotated, mtp)
    return int(sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(spec)))


def rotated(layer: Layer) -> bool:
    return isinstance(layer, QuantizedKV) and layer.rotated


def rotate_in(q, k, v, k_layer: Layer, v_layer: Layer):
    """(q, k, v) as the layers store and read them: q and k rotated where K is, v where V is
    (quant/kv.py: q.k is unchanged)."""
    if rotated(k_layer):  # k, v None: a shared-KV layer (gemma4) that only reads
        q, k = kv.rotate(q), None if k is None else kv.rotate(k)
    return q, k, kv.rotate(v) if rotated(v_layer) and v is not None else v


def rotate_out(att: jax.Array, v_layer: Layer, head_dim: int) -> jax.Array:
    """The attention's output [T, H * hd] rotated back where V is stored rotated."""
    if not rotated(v_layer):
        return att
    return kv.rotate(att.reshape(*att.shape[:-1], -1, head_dim)).reshape(att.shape)


def write_chunk(layer: Layer, rows: jax.Array, slot, start) -> Layer:
    """layer with rows [T, Hkv, hd] (any float) at positions start + [0, T) of slot `slot`
    (prefill), cast to the float cache's dtype or quantized."""
    at = (slot, 0, start, 0)  # [T, Hkv, hd] -> the slot's rows [Hkv, start:start+T]
    if not isinstance(layer, QuantizedKV):
        return jax.lax.dynamic_update_slice(
            layer, jnp.swapaxes(rows, 0, 1)[None].astype(layer.dtype), at
        )
    values, scales = kv.quantize(jnp.swapaxes(rows, 0, 1)[None], layer.kind)
    return dataclasses.replace(
        layer,
        values=jax.lax.dynamic_update_slice(layer.values, values, at),
        scales=jax.lax.dynamic_update_slice(layer.scales, scales, at),
    )


def write_rows(layer: Layer, rows: jax.Array, slots: jax.Array, positions: jax.Array) -> Layer:
    """layer with rows [B, Hkv, hd] at (slots[b], positions[b]) (decode): one row per sequence."""
    if not isinstance(layer, QuantizedKV):
        return layer.at[slots, :, positions].set(rows.astype(layer.dtype))
    values, scales = kv.quantize(rows, layer.kind)
    return dataclasses.replace(
        layer,
        values=layer.values.at[slots, :, positions].set(values),
        scales=layer.scales.at[slots, :, positions].set(scales),
    )


def read(layer: Layer, index: tuple) -> jax.Array:
    """layer[index] in f32 (index: over the leading axes, head_dim whole), dequantized."""
    if not isinstance(layer, QuantizedKV):
        return layer[index].astype(jnp.float32)
    return kv.dequantize(layer.values[index], layer.scales[index])
