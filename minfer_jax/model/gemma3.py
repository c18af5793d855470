"""Gemma 3 text models (1B, and the language part of 4B / 12B / 27B): `general.architecture =
gemma3`.

Layer (llama.cpp's gemma3 graph): h = x + n_pa(Wo . attn(rope(n_q(Wq.n(x))), rope(n_k(Wk.n(x))),
Wv.n(x))); x' = h + n_pf(Wdown . (gelu_tanh(Wgate.n(h)) * Wup.n(h))), n_* RMSNorms (the GGUF
converter folds Gemma's 1 + w into the weights), q/k normed per head. The embedding rows are
scaled by sqrt(d_model). Five of every six layers are local: they attend to the last
attention.sliding_window positions with RoPE base 10000; every sixth layer is global with the
file's rope.freq_base (and its linear scaling). Attention scale: head_dim^-0.5, except the 27B
(62 layers), which llama.cpp scales by (d_model / n_heads)^-0.5 (query_pre_attn_scalar 168).
The head is tied to the embedding.
"""

from __future__ import annotations

import math

import jax

from minfer_jax import ops, residual
from minfer_jax.errors import UnsupportedError
from minfer_jax.model import layers, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer, Params

ARCHITECTURE = "gemma3"
MODELS = "Gemma 3 text models"

SWA_PERIOD = 6  # llama.cpp: set_swa_pattern(6), every sixth layer global
LOCAL_ROPE_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa
LAYERS_27B = 62


def config_from_metadata(md) -> Config:
    fields = {
        **schema.common_fields(md),
        **schema.head_dim_field(md),
        **schema.rope_scaling_fields(md),
    }
    window = md.int("attention.sliding_window", default=0)
    if window <= 0:
        raise UnsupportedError(f"{md.path}: gemma3 file without attention.sliding_window")
    default_scale = (
        (fields["d_model"] / fields["n_heads"]) ** -0.5 if fields["n_layers"] == LAYERS_27B else 0.0
    )
    cfg = Config(
        family=ARCHITECTURE,
        sliding_window=window,
        swa_period=SWA_PERIOD,
        rope_theta_local=LOCAL_ROPE_THETA,
        attn_scale=md.float("attention.scale", default=default_scale),
        **fields,
    )
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i, qk_norm=True, post_norms=True).items()


def embed(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    return layers.embed(params, tokens, cfg) * math.sqrt(cfg.d_model)


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    cfg, pos, eps = call.cfg, call.positions, call.cfg.rms_eps
    theta, scale = cfg.layer_rope_theta(i), cfg.layer_rope_scale(i)
    q, k, v = layers.project_qkv(x, layer, cfg, call.impl)
    q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)  # per head
    q, k = (
        layers.rope_neox(q, pos, theta, scale=scale),
        layers.rope_neox(k, pos, theta, scale=scale),
    )
    # q / k normed per head: XLA's q / k / v (Attend.neox has no norm); each product is normed
    # before its add: no add epilogue (its gated activation takes one)
    att = residual.row_product(x, call.attend(q, k, v), layer.wo, "attn_out", call.impl)
    x = x + ops.rms_norm(att, layer.post_attn_norm, eps)
    return x + ops.rms_norm(
        layers.gated_ffn(x, layer, call, act="gelu_tanh"), layer.post_ffn_norm, eps
    )
