"""Real-shape dense Qwen3.5 / 3.6 (`qwen35`) hyper-parameters for synthetic files
(synthetic.SYNTHETIC_CONFIGS adds them; bench.py's `--synthetic qwen3.6-27b:q4_k_m`). The MoE
Qwen3.6-35B-A3B stays with the other mixture-of-experts configs in synthetic.py."""

from __future__ import annotations

import numpy as np

from minfer_jax.model.config import Config

# Qwen/Qwen3.6-27B (its model card, as quoted by the Qwen3.6-27B-FP8 and -GGUF cards; config.json
# via eadst.com/blog/325): 64 layers of 16 x (3 Gated DeltaNet + 1 gated attention), hidden 5120,
# DeltaNet 16 q/k and 48 v heads of 128, attention 24 / 4 heads of 256 with RoPE on 64 dims, FFN
# 17408, vocab 248320 (padded), context 262144, rope_theta 1e7, untied head; conv kernel 4 and
# rms 1e-6 as every Qwen3.5; its MTP block is not written (not run here). llama.cpp calls it 27B
# by the 64 layers (src/models/qwen35.cpp).
QWEN36_27B = Config(
    n_layers=64,
    d_model=5120,
    n_heads=24,
    n_kv_heads=4,
    d_ff=17408,
    context_length=262144,
    vocab_size=248320,
    rope_theta=10000000.0,
    rms_eps=float(np.float32(1e-6)),
    tied_output=False,
    family="qwen35",
    head_dim=256,
    rope_dims=64,
    recurrent_layers=tuple((i + 1) % 4 != 0 for i in range(64)),
    ssm_conv_kernel=4,
    ssm_state=128,
    ssm_groups=16,
    ssm_v_heads=48,
)

QWEN35_CONFIGS = {"qwen3.6-27b": QWEN36_27B}
