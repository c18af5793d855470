"""Qwen3 family (dense Qwen3 0.6B-32B): `general.architecture = qwen3`.

Layer: Qwen2's without the q/k/v biases and with a per-head RMSNorm on q and k before RoPE (NeoX
half-split form); head_dim is the file's attention.key_length (128), not d_model / n_heads.
"""

from __future__ import annotations

from minfer_jax import ops, residual
from minfer_jax.model import layers, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen3"
MODELS = "Qwen3 dense models"

embed = layers.embed


def config_from_metadata(md) -> Config:
    cfg = Config(
        family=ARCHITECTURE,
        **schema.common_fields(md),
        **schema.head_dim_field(md),
        **schema.rope_scaling_fields(md),
    )
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i, qk_norm=True).items()


def attention(x: residual.Stream, layer: Layer, call: layers.LayerCall):
    """q / k / v of attn_norm(x), q and k normed per head, NeoX-rotated, through the cache ->
    [T, H * hd] (Qwen3-MoE's attention too)."""
    cfg, pos = call.cfg, call.positions
    # q and k normed per head before RoPE: the q / k / v epilogue kernel (Attend.neox) has no norm
    q, k, v = layers.project_qkv(x, layer, cfg, call.impl)
    q, k = (
        ops.rms_norm(q, layer.q_norm, cfg.rms_eps),
        ops.rms_norm(k, layer.k_norm, cfg.rms_eps),
    )  # per head
    q = layers.rope_neox(q, pos, cfg.rope_theta, scale=cfg.rope_scale)
    k = layers.rope_neox(k, pos, cfg.rope_theta, scale=cfg.rope_scale)
    return call.attend(q, k, v)


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = residual.add_product(x, attention(x, layer, call), layer.wo, "attn_out", call.impl)
    ffn_in = layers.gated_act(x, layer, call)
    return residual.add_product(x, ffn_in, layer.w_down, "ffn_out", call.impl)
