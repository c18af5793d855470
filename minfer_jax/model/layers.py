"""The pieces the family modules build their layers from (qwen2.py, llama.py, qwen3.py, gemma3.py).

Every weight matmul goes through ops.matmul / ops.norm_matmuls (the kernel routing) and every
product that joins the residual stream through minfer_jax/residual.py (which decides the decode
epilogue kernels and the tensor-parallel all-reduce), so a family module only says which pieces
its layer uses and in which order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer, Params
from minfer_jax.quant.matrix import embed_rows
from minfer_jax.residual import Stream

gelu_tanh = residual.gelu_tanh  # GELU, tanh approximation (Gemma's)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """What a layer needs besides its weights and the residual stream (a trace-time container,
    not a pytree)."""

    positions: jax.Array  # [T] int32: each token's position
    # attention.Attend: attend(q [T, H, hd], k, v [T, Hkv, hd], sinks=None) -> [T, H * hd], the
    # cache write + attention; attend.neox(x, layer): a NeoX layer's whole attention
    attend: Any
    cfg: Config
    impl: ops.Impl
    # [hd / 2] Llama 3.1+ frequency divisors (rope_freqs.weight)
    rope_freqs: jax.Array | None = None
    # a Gated DeltaNet layer (qwen35): recur(proj [T, ...], weights.DeltaNet) -> [T, Hv dv], the
    # mix through the layer's recurrent state (decoder.py carries it; model/deltanet.py)
    recur: Callable | None = None
    # gemma4's per-layer embedding input of this layer [T, n_pl] (gemma4.per_layer_inputs)
    layer_input: jax.Array | None = None


def embed(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    """tokens [T] -> rows of token_embd [T, d] f32."""
    return embed_rows(params.embed, tokens)


def rope_inv_freq(hd: int, theta: float, freq_factors: jax.Array | None, scale: float) -> jax.Array:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))  # [hd/2]
    if freq_factors is not None:  # llama.cpp: theta_i / freq_factors[i]
        inv_freq = inv_freq / freq_factors.astype(jnp.float32)
    if scale != 1.0:  # linear scaling: positions * scale
        inv_freq = inv_freq * scale
    return inv_freq


YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's hparams defaults (gpt-oss reads none)


def yarn_corr_dims(hd: int, theta: float, orig_ctx: int) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair indices where YaRN's ramp from extrapolated (fast,
    below lo) to interpolated (slow, above hi) frequencies runs."""

    def corr_dim(beta: float) -> float:
        return hd * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(theta))

    return max(0.0, math.floor(corr_dim(YARN_BETA_FAST))), min(
        hd - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW))
    )


def yarn_inv_freq(
    inv_freq: jax.Array, theta: float, factor: float, orig_ctx: int
) -> tuple[jax.Array, float]:
    """YaRN as ggml's rope_yarn computes it (ext_factor 1, freq_scale 1 / factor): pair i turns at
    inv_freq (1 - r) / factor + inv_freq r, r = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1);
    and (its second value) cos and sin are scaled by mscale = 1 + 0.1 ln(factor) (llama.cpp's
    attn_factor cancels get_mscale's own, leaving ggml's)."""
    half = inv_freq.shape[0]
    lo, hi = yarn_corr_dims(2 * half, theta, orig_ctx)
    ramp = 1.0 - jnp.clip((jnp.arange(half, dtype=jnp.float32) - lo) / max(0.001, hi - lo), 0, 1)
    return inv_freq * ((1.0 - ramp) / factor + ramp), 1.0 + 0.1 * math.log(factor)


def rope_neox(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    freq_factors: jax.Array | None = None,
    scale: float = 1.0,
    yarn: tuple[float, int] | None = None,
) -> jax.Array:
    """NeoX RoPE (llama.cpp ROPE_TYPE_NEOX: Qwen2, Qwen3, Gemma 3, gpt-oss): x [T, heads, hd]
    rotated by position [T]; pairs (i, i + hd/2). yarn: (factor, original context) of YaRN
    scaling (Config.yarn), or None."""
    hd = x.shape[-1]
    inv_freq = rope_inv_freq(hd, theta, freq_factors, scale)  # [hd/2]
    mscale = 1.0
    if yarn is not None:
        inv_freq, mscale = yarn_inv_freq(inv_freq, theta, *yarn)
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, hd/2]
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_normal(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    freq_factors: jax.Array | None = None,
    scale: float = 1.0,
) -> jax.Array:
    """llama.cpp's normal RoPE (ROPE_TYPE_NORM: the Llama family): pairs (2i, 2i + 1).

    convert_hf_to_gguf permutes Llama's Q/K rows so that adjacent pairs in the file are HF's
    half-split pairs; rotating adjacent pairs of the file's weights is HF's rotation."""
    hd = x.shape[-1]
    inv_freq = rope_inv_freq(hd, theta, freq_factors, scale)  # [hd/2]
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, hd/2]
    pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def project_qkv(x: Stream, layer: Layer, cfg: Config, impl: ops.Impl):
    """attn_norm(x) [T, d] through q/k/v (+ their biases where the file has them) ->
    q [T, H, hd], k and v [T, Hkv, hd], not rotated."""
    t, qd, kv = x.rows.shape[0], cfg.q_dim, cfg.kv_dim
    qkv = jnp.concatenate(
        residual.norm_matmuls(x, layer.attn_norm, cfg.rms_eps, layer.qkv, impl), axis=-1
    )  # [T, qd + 2kv]
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    q = qkv[:, :qd].reshape(t, cfg.n_heads, cfg.head_dim)
    k = qkv[:, qd : qd + kv].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    v = qkv[:, qd + kv :].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    return q, k, v


def gated_ffn(x: Stream, layer: Layer, call: LayerCall, act: str = "silu") -> jax.Array:
    """down(act(gate(n(x))) * up(n(x))) with n = ffn_norm: SwiGLU ("silu") or GeGLU ("gelu_tanh").
    [T, d]."""
    return residual.row_product(
        x, gated_act(x, layer, call, act), layer.w_down, "ffn_out", call.impl
    )


def gated_act(
    x: Stream, layer: Layer, call: LayerCall, act: str = "silu", norm=None, d_ff: int = 0
) -> jax.Array:
    """act(gate(n(x))) * up(n(x)) [T, d_ff], the down projection's input (residual.gated_act), n
    the RMSNorm with `norm` (None: ffn_norm; qwen35's is post_attention_norm); d_ff 0: cfg.d_ff."""
    cfg = call.cfg
    norm = layer.ffn_norm if norm is None else norm
    d_ff = d_ff or cfg.d_ff
    return residual.gated_act(x, norm, cfg.rms_eps, layer.gate_up, d_ff, act, call.impl)
