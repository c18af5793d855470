"""The mixture-of-experts feed-forward every MoE family shares (llama.cpp's build_moe_ffn).

For the ffn_norm'ed rows h [T, d] of a layer with Layer.moe (Config.n_experts > 0):
  logits = W_router . h                       [T, E] f32
  probs  = softmax(logits)                    (Config.expert_gating "softmax")
  ids    = top-k of probs, descending         [T, k] int32, on the device
  w      = probs[ids], / max(sum_k w, 2^-14)  where Config.expert_weights_norm (Qwen3-MoE, Mixtral)
  out    = sum_j w[:, j] * down[ids_j](silu(gate[ids_j] h) * up[ids_j] h), in slot order
  (+ sigmoid(w_shexp_gate . h) * down_shexp(silu(gate_shexp h) * up_shexp h): Qwen2-MoE)
The expert matmuls go through ops.expert_glu / ops.expert_down_sum (their routes: ops.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.model import layers
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Experts, Layer

WEIGHTS_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the chosen weights' sum to at least 2^-14


def route_tokens(logits: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (expert ids [T, k] int32, their weights [T, k] f32). Gating
    "softmax": softmax over all experts, then top-k; "softmax_weight" (gpt-oss): top-k of the raw
    logits, softmax over the chosen k."""
    logits = logits.astype(jnp.float32)
    if cfg.expert_gating == "softmax_weight":
        chosen, ids = jax.lax.top_k(logits, cfg.n_experts_used)
        return ids.astype(jnp.int32), jax.nn.softmax(chosen, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.n_experts_used)
    if cfg.expert_weights_norm:
        weights = weights / jnp.maximum(jnp.sum(weights, -1, keepdims=True), WEIGHTS_SUM_FLOOR)
    return ids.astype(jnp.int32), weights


def shared_expert(h: jax.Array, ex: Experts, impl: ops.Impl) -> jax.Array:
    """Qwen2-MoE's shared expert, gated per token by sigmoid(w . h): [T, d] (a shard's partial
    product inside shard_map: the caller's all-reduce adds it up)."""
    gate_up = jnp.concatenate([ops.matmul(h, w, impl) for w in ex.shared_gate_up], axis=-1)
    width = gate_up.shape[-1] // 2
    act = jax.nn.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert ex.shared_down is not None and ex.shared_gate_inp is not None
    gate = jax.nn.sigmoid(h @ ex.shared_gate_inp.astype(jnp.float32))[:, None]
    return gate * ops.matmul(act, ex.shared_down, impl)


def moe_ffn(
    x: residual.Stream, layer: Layer, call: layers.LayerCall, norm: jax.Array | None = None
) -> jax.Array:
    """The layer's mixture-of-experts FFN on norm(x) (norm: the pre-FFN RMSNorm's weight, default
    ffn_norm; gpt-oss's is post_attention_norm) -> [T, d], added to the residual by the caller.
    The router's and the experts' biases (gpt-oss) are added where Experts has them. Inside
    shard_map every shard holds all experts' slices of the expert width and the whole router
    (engine/sharding.py): one all-reduce adds the shards' partial outputs."""
    cfg, impl, ex = call.cfg, call.impl, layer.moe
    assert ex is not None
    h = ops.rms_norm(x.rows, layer.ffn_norm if norm is None else norm, cfg.rms_eps)
    logits = ops.matmul(h, ex.router, impl)
    if ex.router_bias is not None:
        logits = logits + ex.router_bias
    ids, weights = route_tokens(logits, cfg)
    act = ops.expert_glu(
        h, ex.gate, ex.up, ids, cfg.expert_act, impl, ex.gate_bias, ex.up_bias
    )  # [T, k, F]
    out = ops.expert_down_sum(act, ex.down, ids, weights, impl, ex.down_bias)  # [T, d]
    if ex.shared_down is not None:
        out = out + shared_expert(h, ex, impl)
    return residual.total(x, out)


def ffn(x: residual.Stream, layer: Layer, call: layers.LayerCall) -> residual.Stream:
    """x + the layer's FFN: the mixture of experts where the layer has one, else the dense gated
    FFN (SwiGLU)."""
    if layer.moe is None:
        act = layers.gated_act(x, layer, call)
        return residual.add_product(x, act, layer.w_down, "ffn_out", call.impl)
    return x + moe_ffn(x, layer, call)
