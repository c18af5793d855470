"""The pieces the family modules build their layers from (qwen2.py, llama.py, qwen3.py, gemma3.py).

Every weight matmul goes through ops.matmul / ops.norm_matmuls (the kernel routing), so a family
module only says which pieces its layer uses and in which order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer, Params
from minfer_jax.pallas import split_sums
from minfer_jax.quant.matrix import embed_rows


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """What a layer needs besides its weights (a trace-time container, not a pytree)."""

    positions: jax.Array  # [T] int32: each token's position
    # attend(q [T, H, hd], k, v [T, Hkv, hd], sinks=None) -> [T, H * hd]: cache write +
    # attention; sinks [H]: gpt-oss's per-head sink logits
    attend: Callable
    cfg: Config
    impl: ops.Impl
    # None on one device; inside shard_map the shard's hooks (sharding.TensorParallel)
    par: object = None
    # [hd / 2] Llama 3.1+ frequency divisors (rope_freqs.weight)
    rope_freqs: jax.Array | None = None
    # decode on the kernels with impl.fused_decode (decoder.forward_decode):
    # attend_projected(parts, widths, bias, inv_freq) -> [B, H * hd], the projections' partials
    # to attention in two kernels (attention.decode_attention_projected)
    attend_projected: Callable | None = None
    # decode on the kernels with impl.fused_decode, one device: the residual adds and the gated
    # activation take the projections' split-K partials (pallas/split_sums.py), and the residual
    # stream carries its rows' sums of squares to the next norm's GEMVs (Residual)
    epilogues: bool = False
    # a Gated DeltaNet layer (qwen35): recur(proj [T, ...], weights.DeltaNet) -> [T, Hv dv], the
    # mix through the layer's recurrent state (decoder.py carries it; model/deltanet.py)
    recur: Callable | None = None
    # gemma4's per-layer embedding input of this layer [T, n_pl] (gemma4.per_layer_inputs)
    layer_input: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream as add_product leaves it with LayerCall.epilogues: the rows and their
    sums of squares in pieces (split_sums.add_partials), so the next RMSNorm's GEMVs need no
    reduce of their own. A trace-time container, like LayerCall."""

    x: jax.Array  # [T, d] f32
    sumsq: jax.Array  # [T, P] f32


Hidden = jax.Array | Residual  # what a layer takes and returns


def hidden(x: Hidden) -> tuple[jax.Array, jax.Array | None]:
    """(the rows [T, d], their sums of squares in pieces or None) of a residual stream value."""
    return (x.x, x.sumsq) if isinstance(x, Residual) else (x, None)


def add_product(x: Hidden, y: jax.Array, w, which: str, call: LayerCall) -> Hidden:
    """x + y . w^T, the residual add after the o ("attn_out") or down ("ffn_out") projection:
    with call.epilogues one kernel adds the projection's partials to x and sums the squares
    (-> Residual), else the matmul (row_matmul) and an add."""
    rows, _ = hidden(x)
    if call.epilogues:
        parts = ops.matmul_parts(y, w, call.impl)
        interpret = call.impl.kernels == "interpret"
        return Residual(*split_sums.add_partials(rows, parts, interpret=interpret))
    return rows + row_matmul(call.par, which, y, w, call.impl)


def embed(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    """tokens [T] -> rows of token_embd [T, d] f32."""
    return embed_rows(params.embed, tokens)


def _inv_freq(hd: int, theta: float, freq_factors: jax.Array | None, scale: float) -> jax.Array:
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
    inv_freq = _inv_freq(hd, theta, freq_factors, scale)  # [hd/2]
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
    inv_freq = _inv_freq(hd, theta, freq_factors, scale)  # [hd/2]
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, hd/2]
    pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def project_qkv(x: Hidden, layer: Layer, cfg: Config, impl: ops.Impl):
    """attn_norm(x) [T, d] through q/k/v (+ their biases where the file has them) ->
    q [T, H, hd], k and v [T, Hkv, hd], not rotated."""
    x, sumsq = hidden(x)
    t, qd, kv = x.shape[0], cfg.q_dim, cfg.kv_dim
    qkv = jnp.concatenate(
        ops.norm_matmuls(x, layer.attn_norm, cfg.rms_eps, layer.qkv, impl, sumsq), axis=-1
    )  # [T, qd + 2kv]
    if layer.qkv_bias is not None:
        qkv = qkv + layer.qkv_bias
    q = qkv[:, :qd].reshape(t, cfg.n_heads, cfg.head_dim)
    k = qkv[:, qd : qd + kv].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    v = qkv[:, qd + kv :].reshape(t, cfg.n_kv_heads, cfg.head_dim)
    return q, k, v


def attend_neox(x: Hidden, layer: Layer, call: LayerCall) -> jax.Array:
    """Attention of a layer with NeoX RoPE and no q / k norms (Qwen2): q / k / v of attn_norm(x)
    (+ biases), rotated, through the cache -> [T, H * hd]. With call.attend_projected (fused
    decode) the projections' split-K partials go to one kernel that does the rest."""
    cfg = call.cfg
    if call.attend_projected is not None:
        rows, sumsq = hidden(x)
        parts = ops.norm_matmul_parts(
            rows, layer.attn_norm, cfg.rms_eps, layer.qkv, call.impl, sumsq
        )
        widths = tuple(w.shape[0] for w in layer.qkv)
        inv_freq = _inv_freq(cfg.head_dim, cfg.rope_theta, None, 1.0)
        return call.attend_projected(parts, widths, layer.qkv_bias, inv_freq)
    q, k, v = project_qkv(x, layer, cfg, call.impl)
    q = rope_neox(q, call.positions, cfg.rope_theta)
    k = rope_neox(k, call.positions, cfg.rope_theta)
    return call.attend(q, k, v)


def row_matmul(par, which: str, x: jax.Array, w, impl: ops.Impl) -> jax.Array:
    """o ("attn_out") and down ("ffn_out"): one device's matmul, or a shard's partial product +
    all-reduce."""
    return ops.matmul(x, w, impl) if par is None else par.row_matmul(which, x, w, impl)


def gated_ffn(x: Hidden, layer: Layer, call: LayerCall, act: str = "silu"):
    """down(act(gate(n(x))) * up(n(x))) with n = ffn_norm: SwiGLU ("silu") or GeGLU ("gelu_tanh").
    [T, d]."""
    return row_matmul(call.par, "ffn_out", gated_act(x, layer, call, act), layer.w_down, call.impl)


def gated_act(x: Hidden, layer: Layer, call: LayerCall, act: str = "silu", norm=None):
    """act(gate(n(x))) * up(n(x)) [T, d_ff], the down projection's input, n the RMSNorm with
    `norm` (None: ffn_norm; qwen35's is post_attention_norm); with call.epilogues one kernel forms
    it from the gate / up GEMVs' partials (split_sums.glu_partials)."""
    cfg, impl = call.cfg, call.impl
    rows, sumsq = hidden(x)
    norm = layer.ffn_norm if norm is None else norm
    if call.epilogues:
        parts = ops.norm_matmul_parts(rows, norm, cfg.rms_eps, layer.gate_up, impl, sumsq)
        return split_sums.glu_partials(
            tuple(parts),
            widths=tuple(w.shape[0] for w in layer.gate_up),
            d_ff=cfg.d_ff,
            act=act,
            batch=rows.shape[0],
            interpret=impl.kernels == "interpret",
        )
    gate_up = jnp.concatenate(
        ops.norm_matmuls(rows, norm, cfg.rms_eps, layer.gate_up, impl, sumsq), axis=-1
    )  # [T, 2ff]
    gate, up = gate_up[:, : cfg.d_ff], gate_up[:, cfg.d_ff :]
    return ACTIVATIONS[act](gate) * up


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (ggml_gelu; Gemma's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}  # as split_sums.ACTIVATIONS
