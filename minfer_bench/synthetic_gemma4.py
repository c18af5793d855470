"""Small synthetic Gemma 4 (`gemma4`) models for the parity tests: F32 weights with the pieces
llama.cpp's gemma4 graph has, each in a small form.

`GEMMA4_TINY` names the variants:
- "gemma4-tiny": dense, 6 layers (sliding / full alternating), sliding head 64 with 2 KV heads,
  full head 128 with 1 KV head and K = V (no attn_v), the last 2 layers sharing the KV of layers
  2 and 3 with double-wide FFNs, per-layer embeddings of 32, layer output scales, a tied head,
  a 32-token window and a soft-cap of 10 (so that it bends the logits);
- "gemma4moe-tiny": 4 layers (3 sliding, 1 full with its own attn_v), 8 experts (2 used) of 128
  beside a dense MLP of 256 (the converter's fused ffn_gate_up_exps), an untied head, the
  default soft-cap 30.
`gemma4_model(name, seed)` builds one in memory (a GGUFModel as load_gguf returns it), and
synthetic.write_gguf writes it (its `gemma4.*` keys: minfer_bench.gemma4_keys).
"""

from __future__ import annotations

import zlib

import numpy as np

from minfer_jax.files.gguf import QType, RawTensor
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import expected_shapes
from minfer_jax.model.gguf_model import GGUFModel

from minfer_bench.gemma4_keys import proportional_rope_factors
from minfer_bench.synthetic import _metadata

_EPS = float(np.float32(1e-6))
_TINY = dict(
    family="gemma4",
    d_model=256,
    n_heads=4,
    context_length=2048,
    vocab_size=320,
    rope_theta=1000000.0,
    rms_eps=_EPS,
    head_dim=128,
    head_dim_swa=64,
    rope_freq_factors=True,
    attn_scale=1.0,
    sliding_window=32,
    rope_theta_local=10000.0,
)
GEMMA4_TINY: dict[str, Config] = {
    "gemma4-tiny": Config(
        **_TINY,
        n_layers=6,
        n_kv_heads=1,
        n_kv_heads_swa=2,
        d_ff=256,
        tied_output=True,
        swa_layers=(True, False, True, False, True, False),
        shared_kv_layers=2,
        layer_d_ff=(256, 256, 256, 256, 512, 512),
        v_from_k=(False, True, False, True, False, False),
        per_layer_dim=32,
        final_softcap=10.0,
        layer_out_scale=True,
    ),
    "gemma4moe-tiny": Config(
        **_TINY,
        n_layers=4,
        n_kv_heads=2,
        n_kv_heads_swa=2,
        d_ff=256,
        tied_output=False,
        swa_layers=(True, True, True, False),
        v_from_k=(False,) * 4,
        final_softcap=30.0,
        n_experts=8,
        n_experts_used=2,
        d_ff_expert=128,
        expert_weights_norm=True,
        expert_act="gelu_tanh",
        expert_gate_up_fused=True,
    ),
}
MATRIX_RMS = 0.05
ROUTER_RMS = 2.0  # router logits of std ~2: few near ties between the k-th and k+1-th expert


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor's random values, by what it holds. The q / k norms carry head_dim^-1/4 each:
    attention scale 1 then gives scores of unit spread, as a trained Gemma 4's (llama.cpp's scale
    1.0 leaves it to them); unit norms would make every softmax nearly one-hot."""
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return shape[0] ** -0.25 * (1.0 + 0.1 * rng.standard_normal(shape))
    if name.endswith("norm.weight") or name.endswith(".scale") or "_norm_" in name:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith("layer_output_scale.weight"):
        return rng.uniform(0.5, 1.0, shape)
    if name.endswith("ffn_gate_inp.weight"):
        return ROUTER_RMS * rng.standard_normal(shape)
    return MATRIX_RMS * rng.standard_normal(shape)


def _tensor(tname: str, shape: tuple[int, ...], seed: int, cfg: Config) -> RawTensor:
    if tname == "rope_freqs.weight":
        return RawTensor(tname, QType.F32, shape, proportional_rope_factors(cfg.head_dim))
    rng = np.random.default_rng([seed, zlib.crc32(tname.encode())])
    return RawTensor(tname, QType.F32, shape, _values(tname, shape, rng).astype(np.float32))


def gemma4_model(name: str, seed: int = 0) -> GGUFModel:
    """The model GEMMA4_TINY[name] with random F32 weights (each tensor from (seed, its name))."""
    if name not in GEMMA4_TINY:
        raise ValueError(f"unknown synthetic gemma4 model {name!r}")
    cfg = GEMMA4_TINY[name]
    tensors = {n: _tensor(n, s, seed, cfg) for n, s in expected_shapes(cfg).items()}
    return GGUFModel(
        path=f"synthetic:{name}",
        config=cfg,
        metadata=_metadata(cfg, f"synthetic {name}", 0),
        tensors=tensors,
        file_size=sum(t.nbytes for t in tensors.values()),
    )
