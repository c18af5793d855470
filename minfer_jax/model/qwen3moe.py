"""Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B):
`general.architecture = qwen3moe`.

Layer: Qwen3's attention (per-head q/k RMSNorm before NeoX RoPE, head_dim from
attention.key_length), then the mixture of experts of model/moe.py in place of the FFN: softmax
over all experts, the top expert_used_count, their weights renormalised to sum 1, SwiGLU experts
of width expert_feed_forward_length (feed_forward_length / k where a file has none, as
llama.cpp), no shared expert. The head may be tied to the embedding.
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.model import layers, moe, qwen3, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen3moe"
MODELS = "Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B"

embed = layers.embed


def config_from_metadata(md) -> Config:
    fields = {
        **schema.common_fields(md),
        **schema.head_dim_field(md),
        **schema.rope_scaling_fields(md),
    }
    k = max(1, md.int("expert_used_count", default=1))
    expert_ff = md.int("expert_feed_forward_length", default=fields["d_ff"] // k)
    cfg = Config(
        family=ARCHITECTURE,
        **fields,
        **schema.moe_fields(md, weights_norm=True, expert_ff=expert_ff),
    )
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i, qk_norm=True).items()


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = residual.add_product(x, qwen3.attention(x, layer, call), layer.wo, "attn_out", call.impl)
    return moe.ffn(x, layer, call)
