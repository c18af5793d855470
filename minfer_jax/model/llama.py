"""Llama family (Llama 2 / 3.x, SmolLM2, TinyLlama, Mistral 7B, DeepSeek-R1-Distill-Llama):
`general.architecture = llama`.

Layer: h = x + Wo . attn(rope(Wq.n(x)), rope(Wk.n(x)), Wv.n(x)); x' = h + Wdown .
(silu(Wgate.n(h)) * Wup.n(h)): Qwen2's layer without the q/k/v biases, with llama.cpp's normal RoPE
(adjacent pairs: convert_hf_to_gguf permutes Q/K for it), divided per frequency by rope_freqs.weight
where the file has one (Llama 3.1+), and linear RoPE scaling where the file asks for it. Tied or
untied head. Mistral's sliding window (4096) is not applied: llama.cpp ignores it for this
architecture too.
"""

from __future__ import annotations

from minfer_jax.errors import UnsupportedError
from minfer_jax.model import layers, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "llama"
MODELS = "Llama 2/3.x, SmolLM2, TinyLlama, Mistral 7B, DeepSeek-R1-Distill-Llama"

embed = layers.embed


def config_from_metadata(md) -> Config:
    if md.int("expert_count", default=0) > 0:
        raise UnsupportedError(
            f"{md.path}: mixture-of-experts Llama models (Mixtral) are not supported"
        )
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
    )
    schema.check_full_rotary(md, cfg)
    return cfg


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i).items()


def block(x: layers.Hidden, layer: Layer, i: int, call: layers.LayerCall) -> layers.Hidden:
    cfg, pos = call.cfg, call.positions
    q, k, v = layers.project_qkv(x, layer, cfg, call.impl)
    q = layers.rope_normal(q, pos, cfg.rope_theta, call.rope_freqs, cfg.rope_scale)
    k = layers.rope_normal(k, pos, cfg.rope_theta, call.rope_freqs, cfg.rope_scale)
    x = layers.add_product(x, call.attend(q, k, v), layer.wo, "attn_out", call)
    return layers.add_product(x, layers.gated_act(x, layer, call), layer.w_down, "ffn_out", call)
