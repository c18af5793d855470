"""Qwen2 family (Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen): `general.architecture =
qwen2`.

Layer: h = x + Wo . attn(rope(Wq.n(x) + bq), rope(Wk.n(x) + bk), Wv.n(x) + bv);
x' = h + Wdown . (silu(Wgate.n(h)) * Wup.n(h)), with n = RMSNorm (eps from metadata), RoPE in
NeoX half-split form (base from metadata), GQA attention over the cache with a causal mask.
The layer loop, cache writes and head are model/decoder.py's, shared by every family.
"""

from __future__ import annotations

from minfer_jax import residual
from minfer_jax.model import layers, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen2"
MODELS = "Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen"

embed = layers.embed


def config_from_metadata(md) -> Config:
    return Config(**schema.common_fields(md))


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from schema.layer_shapes(cfg, i, bias=True).items()


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = residual.add_product(x, call.attend.neox(x, layer), layer.wo, "attn_out", call.impl)
    ffn_in = layers.gated_act(x, layer, call)
    return residual.add_product(x, ffn_in, layer.w_down, "ffn_out", call.impl)
