"""gpt-oss (gpt-oss-20b, gpt-oss-120b): `general.architecture = gpt-oss` (llama.cpp's
LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp).

Layer: h = x + Wo . attn(rope(Wq n(x) + bq), rope(Wk n(x) + bk), Wv n(x) + bv) + bo, with per-head
attention sinks in the softmax's denominator and scale head_dim^-0.5; then x' = h + moe(n_pa(h)),
n_pa = post_attention_norm (gpt-oss has no ffn_norm). Even layers (il % 2 == 0) attend through a
sliding window of attention.sliding_window keys with rope.freq_base_swa (default rope.freq_base);
odd layers see everything. RoPE is NeoX with YaRN (rope.scaling.*) on every layer. The MoE
(model/moe.py): router logits + bias, top-k of the raw logits, softmax over those k (no
renormalisation), experts with biases and SWIGLU_OAI (gate clamped above at 7, up to [-7, 7]
plus 1). The head is a separate output.weight.
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.errors import UnsupportedError
from minfer_jax.model import layers, moe, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "gpt-oss"
MODELS = "gpt-oss-20b, gpt-oss-120b"

SWA_PERIOD = 2  # llama.cpp: load_swa_pattern(ml, 2), layer il local iff il % 2 == 0

embed = layers.embed


def config_from_metadata(md) -> Config:
    fields = {
        **schema.common_fields(md),
        **schema.head_dim_field(md),
        **schema.rope_scaling_fields(md, yarn=True),
    }
    window = md.int("attention.sliding_window", default=0)
    if window <= 0:  # llama.cpp reads it as required
        raise UnsupportedError(f"{md.path}: gpt-oss file without attention.sliding_window")
    expert_ff = md.int("expert_feed_forward_length")
    cfg = Config(
        family=ARCHITECTURE,
        sliding_window=window,
        swa_period=SWA_PERIOD,
        rope_theta_local=md.float("rope.freq_base_swa", default=0.0),
        **fields,
        **schema.moe_fields(md, weights_norm=False, expert_ff=expert_ff, gating="softmax_weight"),
        expert_act="swiglu_oai",
    )
    if not cfg.n_experts:
        raise UnsupportedError(f"{md.path}: gpt-oss file without expert_count")
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    d, e, ff = cfg.d_model, cfg.n_experts, cfg.d_ff_expert
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes = schema.layer_shapes(cfg, i, bias=True)
        del shapes[p + "ffn_norm.weight"]  # post_attention_norm is the pre-MoE norm
        shapes.update(
            {
                p + "attn_output.bias": (d,),
                p + "attn_sinks.weight": (cfg.n_heads,),
                p + "post_attention_norm.weight": (d,),
                p + "ffn_gate_inp.bias": (e,),
                p + "ffn_gate_exps.bias": (e, ff),
                p + "ffn_up_exps.bias": (e, ff),
                p + "ffn_down_exps.bias": (e, d),
            }
        )
        yield from shapes.items()


def attention(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall):
    """q / k / v (+ biases) of attn_norm(x), NeoX + YaRN rotated with the layer's base, through the
    cache with the layer's window and sinks -> [T, H * hd]."""
    cfg, pos = call.cfg, call.positions
    theta = cfg.layer_rope_theta(i)
    q, k, v = layers.project_qkv(x, layer, cfg, call.impl)
    q = layers.rope_neox(q, pos, theta, yarn=cfg.yarn)
    k = layers.rope_neox(k, pos, theta, yarn=cfg.yarn)
    return call.attend(q, k, v, sinks=layer.sinks)


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    # sinks and YaRN: XLA's q / k / v; the o bias joins after the product and the MoE's norm is
    # XLA's: no add epilogue to take
    att = residual.row_product(x, attention(x, layer, i, call), layer.wo, "attn_out", call.impl)
    h = x + att + layer.wo_bias
    return h + moe.moe_ffn(h, layer, call, norm=layer.post_attn_norm)
