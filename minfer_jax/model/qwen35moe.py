"""Qwen3.5 / 3.6 mixture-of-experts models (Qwen3.6-35B-A3B, Qwen3.5-122B-A10B):
`general.architecture = qwen35moe`, a hybrid.

llama.cpp's models/qwen35moe.cpp: qwen35's layers (model/qwen35.py: Gated DeltaNet on three of
every four, gated attention on the fourth, MTP blocks loaded but not run) with the mixture of
experts of model/moe.py in place of the dense FFN, on rms(x) . post_attention_norm: softmax over
all experts, the top expert_used_count renormalised to sum 1 (sum floored at 2^-14), SwiGLU
experts of width expert_feed_forward_length (feed_forward_length / k where a file has none), plus
the shared SwiGLU expert of width expert_shared_feed_forward_length (feed_forward_length where
missing), gated per token by sigmoid(ffn_gate_inp_shexp . h). llama.cpp requires the shared expert.
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.errors import GGUFError
from minfer_jax.model import layers, moe, qwen35, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen35moe"
MODELS = "Qwen3.5 / 3.6 MoE models (Qwen3.6-35B-A3B)"

embed = layers.embed
tensor_shapes = qwen35.tensor_shapes  # qwen35.layer_shapes puts the experts in place of the FFN


def config_from_metadata(md) -> Config:
    ff = md.int("feed_forward_length", default=0)  # real files may leave it out
    k = max(1, md.int("expert_used_count", default=1))
    expert_ff = md.int("expert_feed_forward_length", default=0) or ff // k
    shared_ff = md.int("expert_shared_feed_forward_length", default=0) or ff
    if not expert_ff or not shared_ff:
        raise GGUFError(
            f"{md.path}: a qwen35moe file needs expert_feed_forward_length and "
            "expert_shared_feed_forward_length, or feed_forward_length to fall back on"
        )
    moe_fields = schema.moe_fields(md, weights_norm=True, expert_ff=expert_ff, shared_ff=shared_ff)
    if not moe_fields:
        raise GGUFError(f"{md.path}: a qwen35moe file needs expert_count > 0")
    return qwen35.config_from_metadata(
        md, family=ARCHITECTURE, d_ff_default=ff or expert_ff, **moe_fields
    )


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = qwen35.add_mixer(x, layer, call)
    # the pre-FFN norm is post_attention_norm, as qwen35's
    return x + moe.moe_ffn(x, layer, call, norm=layer.post_attn_norm)
