"""The real-shape synthetic Qwen3.6-27B (dense `qwen35`, minfer_bench/qwen35_configs.py): its
tensors, the Q4_K_M type mix tools/quant_mix_vs_llama_cpp.py found equal to llama-quantize's, and
a narrowed copy that loads and runs."""

from __future__ import annotations

import dataclasses

import numpy as np

import minfer_jax

from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model_from_config, synthetic_shapes


def test_qwen36_27b_shapes_and_q4_k_m_mix():
    cfg = SYNTHETIC_CONFIGS["qwen3.6-27b"]
    assert cfg.family == "qwen35" and not cfg.n_experts and cfg.n_layers == 64
    assert sum(cfg.recurrent_layers) == 48 and cfg.recurrent_layers[:4] == (True,) * 3 + (False,)
    types, shapes, tied, _ = synthetic_shapes("qwen3.6-27b:q4_k_m")
    assert not tied
    want_shapes = {
        "token_embd.weight": (248320, 5120),
        "output.weight": (248320, 5120),
        "blk.0.attn_qkv.weight": (2 * 16 * 128 + 48 * 128, 5120),  # q, k: 16 heads; v: 48
        "blk.0.attn_gate.weight": (48 * 128, 5120),
        "blk.0.ssm_out.weight": (5120, 48 * 128),
        "blk.0.ssm_a": (48,),
        "blk.3.attn_q.weight": (2 * 24 * 256, 5120),  # the query and its output gate
        "blk.3.attn_k.weight": (4 * 256, 5120),
        "blk.3.attn_output.weight": (5120, 24 * 256),
        "blk.63.ffn_down.weight": (5120, 17408),
    }
    assert {n: shapes[n] for n in want_shapes} == want_shapes
    assert "blk.0.attn_q.weight" not in shapes and "blk.3.attn_qkv.weight" not in shapes
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    assert 26.5e9 < n_params < 27.5e9  # the card's 27B, less the MTP block and the vision tower
    want_types = {
        "token_embd.weight": "Q4_K",
        "output.weight": "Q6_K",
        "blk.0.attn_qkv.weight": "Q6_K",  # attn_v's rules, more bits on the first layers
        "blk.9.attn_qkv.weight": "Q4_K",
        "blk.0.ssm_conv1d.weight": "F32",
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.9.ffn_down.weight": "Q4_K",
        "blk.3.attn_v.weight": "Q6_K",
        "blk.3.attn_output.weight": "Q4_K",
    }
    assert {n: types[n].name for n in want_types} == want_types


def test_qwen36_27b_narrowed_loads_and_runs():
    cfg = SYNTHETIC_CONFIGS["qwen3.6-27b"]
    small = dataclasses.replace(
        cfg,
        n_layers=4,
        recurrent_layers=cfg.recurrent_layers[:4],
        d_model=256,
        d_ff=512,
        vocab_size=512,
    )
    gm = synthetic_model_from_config(small, "q4_k_m")
    logits = minfer_jax.load(gguf_model=gm, ctx_size=64).logits(list(range(8)))
    assert logits.shape == (8, 512) and np.isfinite(logits).all()
