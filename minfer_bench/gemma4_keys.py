"""The `gemma4.*` keys of a synthetic Gemma 4 file, as llama.cpp's converter writes them
(conversion/gemma.py, Gemma4Model.set_gguf_parameters): head dims and RoPE dims per kind of layer,
KV heads and (double-wide) FFN widths per layer as arrays, the sliding-window pattern as a bool
array. minfer_bench.synthetic writes them for a Config of family gemma4."""

from __future__ import annotations

import dataclasses

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


def _layers(n: int, every: int) -> tuple[bool, ...]:
    """Sliding-window flags: every `every`-th layer full (the real files' layer_types)."""
    return tuple(i % every != every - 1 for i in range(n))


def gemma4_real_shapes() -> dict[str, Config]:
    """Real Gemma 4 shapes, from config.json text_config values quoted in public code (two
    independent copies each): google/gemma-4-31B-it (hidden 5376, 60 layers, 32 heads, 16 KV heads
    of 256 on sliding layers, 4 of 512 on full ones with attention_k_eq_v, intermediate 21504,
    window 1024, 5 sliding : 1 full); google/gemma-4-26B-A4B-it (hidden 2816, 30 layers, 16 heads,
    8 / 2 KV heads of 256 / 512, K = V on full layers, dense intermediate 2112 beside 128 experts
    of 704 with 8 used, window 1024, 5 : 1); google/gemma-4-E4B-it (hidden 2560, 42 layers, 8
    heads, 2 KV heads of 256 / 512, intermediate 10240, per-layer embeddings of 256, the last 18
    layers sharing KV, window 512, 5 : 1, no double-wide MLP). All: vocab 262144, tied head,
    rope_theta 1e6 (full) / 1e4 (sliding), rms_norm_eps 1e-6, context 262144 (E4B 131072),
    soft-cap 30; the 26B's and 31B's layer_scalar as layer_output_scale."""
    eps = float(np.float32(1e-6))
    common = dict(
        family="gemma4",
        vocab_size=262144,
        rope_theta=1000000.0,
        rms_eps=eps,
        tied_output=True,
        head_dim=512,
        head_dim_swa=256,
        rope_freq_factors=True,
        attn_scale=1.0,
        rope_theta_local=10000.0,
        final_softcap=30.0,
        layer_out_scale=True,
    )
    return {
        "gemma-4-31b": Config(
            **common, n_layers=60, d_model=5376, n_heads=32, n_kv_heads=4, n_kv_heads_swa=16,
            d_ff=21504, context_length=262144, sliding_window=1024, swa_layers=_layers(60, 6),
            v_from_k=tuple(i % 6 == 5 for i in range(60)),
        ),
        "gemma-4-26b-a4b": Config(
            **common, n_layers=30, d_model=2816, n_heads=16, n_kv_heads=2, n_kv_heads_swa=8,
            d_ff=2112, context_length=262144, sliding_window=1024, swa_layers=_layers(30, 6),
            v_from_k=tuple(i % 6 == 5 for i in range(30)), n_experts=128, n_experts_used=8,
            d_ff_expert=704, expert_weights_norm=True, expert_act="gelu_tanh",
            expert_gate_up_fused=True,
        ),
        "gemma-4-e4b": Config(
            **common, n_layers=42, d_model=2560, n_heads=8, n_kv_heads=2, n_kv_heads_swa=2,
            d_ff=10240, context_length=131072, sliding_window=512, swa_layers=_layers(42, 6),
            v_from_k=(False,) * 42, shared_kv_layers=18, per_layer_dim=256,
        ),
    }  # fmt: skip


def gemma4_with_layers(cfg: Config, layers: int) -> Config:
    """A gemma4 Config cut (or repeated) to `layers` layers: the per-layer patterns repeat, and a
    proportional share of shared-KV layers is kept where llama.cpp's reuse rule allows it (the
    two layers before them sliding, then full), else none."""

    def cut(values: tuple) -> tuple:
        return tuple(values[i % len(values)] for i in range(layers)) if values else ()

    swa = cut(cfg.swa_layers)
    shared = cfg.shared_kv_layers * layers // cfg.n_layers
    while shared and not (layers - shared >= 2 and swa[-shared - 2] and not swa[-shared - 1]):
        shared -= 1
    return dataclasses.replace(
        cfg,
        n_layers=layers,
        swa_layers=swa,
        v_from_k=tuple(v and i < layers - shared for i, v in enumerate(cut(cfg.v_from_k))),
        layer_d_ff=cut(cfg.layer_d_ff),
        shared_kv_layers=shared,
    )
