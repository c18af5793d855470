"""Llama family (Llama 2 / 3.x, SmolLM2, TinyLlama, Mistral 7B, DeepSeek-R1-Distill-Llama, and
Mixtral 8x7B / 8x22B): `general.architecture = llama`.

Layer: h = x + Wo . attn(rope(Wq.n(x)), rope(Wk.n(x)), Wv.n(x)); x' = h + Wdown .
(silu(Wgate.n(h)) * Wup.n(h)): Qwen2's layer without the q/k/v biases, with llama.cpp's normal RoPE
(adjacent pairs: convert_hf_to_gguf permutes Q/K for it), divided per frequency by rope_freqs.weight
where the file has one (Llama 3.1+), and linear RoPE scaling where the file asks for it. Tied or
untied head. Mistral's sliding window (4096) is not applied: llama.cpp ignores it for this
architecture too. With expert_count > 0 (Mixtral) the FFN is model/moe.py's mixture of experts:
softmax, top expert_used_count, weights renormalised, SwiGLU experts of width feed_forward_length.
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.model import layers, moe, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "llama"
MODELS = "Llama 2/3.x, SmolLM2, TinyLlama, Mistral 7B, DeepSeek-R1-Distill-Llama, Mixtral"

embed = layers.embed


def config_from_metadata(md) -> Config:
    fields = {
        **schema.common_fields(md),
        **schema.head_dim_field(md),
        **schema.rope_scaling_fields(md),
    }
    cfg = Config(
        family=ARCHITECTURE,
        rope_freq_factors="rope_freqs.weight" in md.tensor_names,
        attn_scale=md.float("attention.scale", default=0.0),
        **fields,
        **schema.moe_fields(md, weights_norm=True, expert_ff=fields["d_ff"]),
    )
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i).items()


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    cfg, pos = call.cfg, call.positions
    q, k, v = layers.project_qkv(x, layer, cfg, call.impl)
    q = layers.rope_normal(q, pos, cfg.rope_theta, call.rope_freqs, cfg.rope_scale)
    k = layers.rope_normal(k, pos, cfg.rope_theta, call.rope_freqs, cfg.rope_scale)
    # normal (adjacent-pair) RoPE: the q / k / v epilogue kernel rotates NeoX pairs only
    x = residual.add_product(x, call.attend(q, k, v), layer.wo, "attn_out", call.impl)
    return moe.ffn(x, layer, call)
