"""Qwen1.5-MoE / Qwen2-MoE models (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B):
`general.architecture = qwen2moe`.

Layer: Qwen2's attention (q/k/v biases, NeoX RoPE), then the mixture of experts of model/moe.py:
softmax over all experts, the top expert_used_count with their probabilities as weights (not
renormalised), SwiGLU experts of width expert_feed_forward_length (feed_forward_length / k where a
file has none), plus a shared SwiGLU expert of width expert_shared_feed_forward_length
(feed_forward_length where missing) gated per token by sigmoid(ffn_gate_inp_shexp . h). The head
is untied (llama.cpp requires output.weight).
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.errors import GGUFError
from minfer_jax.model import layers, moe, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen2moe"
MODELS = "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B"

embed = layers.embed


def config_from_metadata(md) -> Config:
    if md.tied:
        raise GGUFError(f"{md.path}: a qwen2moe file needs output.weight (llama.cpp requires it)")
    fields = schema.common_fields(md)
    k = max(1, md.int("expert_used_count", default=1))
    expert_ff = md.int("expert_feed_forward_length", default=fields["d_ff"] // k)
    shared_ff = md.int("expert_shared_feed_forward_length", default=fields["d_ff"])
    return Config(
        family=ARCHITECTURE,
        **fields,
        **schema.moe_fields(md, weights_norm=False, expert_ff=expert_ff, shared_ff=shared_ff),
    )


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i, bias=True).items()


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = residual.add_product(x, call.attend.neox(x, layer), layer.wo, "attn_out", call.impl)
    return moe.ffn(x, layer, call)
