"""The `gemma4.*` keys of a synthetic Gemma 4 file, as llama.cpp's converter writes them
(conversion/gemma.py, Gemma4Model.set_gguf_parameters): head dims and RoPE dims per kind of layer,
KV heads and (double-wide) FFN widths per layer as arrays, the sliding-window pattern as a bool
array. minfer_bench.synthetic writes them for a Config of family gemma4."""

from __future__ import annotations

import numpy as np

from minfer_jax.model.config import Config


def gemma4_metadata(cfg: Config) -> dict:
    a, n = cfg.family, cfg.n_layers
    swa_hd = cfg.head_dim_swa or cfg.head_dim
    meta = {
        f"{a}.attention.sliding_window_pattern": [cfg.is_local(i) for i in range(n)],
        f"{a}.attention.sliding_window": cfg.sliding_window,
        f"{a}.embedding_length_per_layer_input": cfg.per_layer_dim,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.key_length_swa": swa_hd,
        f"{a}.attention.value_length_swa": swa_hd,
        f"{a}.rope.dimension_count": cfg.head_dim,
        f"{a}.rope.dimension_count_swa": swa_hd,
        f"{a}.attention.head_count_kv": [cfg.layer_kv_heads(i) for i in range(n)],
        f"{a}.attention.shared_kv_layers": cfg.shared_kv_layers,
        f"{a}.rope.freq_base_swa": float(np.float32(cfg.rope_theta_local)),
        f"{a}.final_logit_softcapping": float(np.float32(cfg.final_softcap)),
    }
    if cfg.layer_d_ff:
        meta[f"{a}.feed_forward_length"] = list(cfg.layer_d_ff)
    return meta


def proportional_rope_factors(head_dim: int, rotated: float = 0.25) -> np.ndarray:
    """rope_freqs.weight as the converter writes it for the full layers' "proportional" RoPE
    (partial_rotary_factor 0.25): 1 for the first head_dim * rotated / 2 pairs, 1e30 after."""
    n_rot = int(head_dim * rotated / 2)
    return np.array([1.0] * n_rot + [1e30] * (head_dim // 2 - n_rot), np.float32)
