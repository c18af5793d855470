"""Synthetic models (Qwen2.5, Llama 3.1, SmolLM2, Qwen3, Gemma 3): real shapes and llama.cpp's
per-tensor quant mix, random weights.

GPU benchmarks need models of the real Qwen2.5 sizes without shipping gigabytes of weights; the
speed of a quantized matmul does not depend on the weight values. This module builds such models
in memory (a `GGUFModel` like `load_gguf` returns, with no file behind it) and can write them out
as GGUF files:

- `SYNTHETIC_CONFIGS`: the hyper-parameters of Qwen2.5 0.5B/1.5B/3B/7B/14B (Instruct), Llama-3.1-8B,
  SmolLM2-135M, Qwen3-8B, Gemma-3-1B, and tiny models of each new family for tests.
- `quant_mix.tensor_types(cfg, ftype)`: which GGML type each tensor gets under a llama.cpp file
  type ("q4_k_m", "q4_0", "q8_0", ...), mirroring llama.cpp's `src/llama-quant.cpp`.
- `random_raw_tensor(name, qtype, shape, rng)`: random quant blocks whose f16 scale fields are
  overwritten with small values, so dequantized weights are finite, ~zero-mean, RMS ~0.02.
- `synthetic_model("qwen2.5-7b:q4_k_m", seed=0, layers=None)` and
  `synthetic_model_from_config(cfg, types, seed)`: the in-memory model; `synthetic_shapes(spec)`
  its tensor types and shapes without the weights.
- `write_gguf(model, path)`: the same model as a GGUF file (round-trips through `load_gguf`).

The model carries no tokenizer vocabulary (only the special token ids): benchmarks feed token ids;
a written file gets the family's placeholder tokenizer (synthetic_vocab).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, LlamaFileType

from minfer_jax.errors import UnsupportedError
from minfer_jax.files.gguf import FLOAT_TYPES, SUPPORTED_TYPES, RawTensor
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import expected_shapes
from minfer_jax.model.gguf_model import GGUFModel

from minfer_bench.gemma4_keys import (
    gemma4_metadata,
    gemma4_real_shapes,
    gemma4_vector,
    gemma4_with_layers,
    proportional_rope_factors,
)
from minfer_bench.quant_mix import (
    DEFAULT_TYPE,
    FTYPES,
    QType,
    SyntheticSpecError,
    parse_ftype,
    tensor_types,
)
from minfer_bench.qwen35_configs import QWEN35_CONFIGS
from minfer_bench.synthetic_vocab import placeholder_tokenizer as placeholder_tokenizer
from minfer_bench.synthetic_vocab import placeholder_vocab as placeholder_vocab
from minfer_bench.synthetic_vocab import special_tokens_metadata

# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------

# GGUF stores rms_norm_eps as float32; load_gguf hands back float32(1e-6) = 9.999999974752427e-07.
# Keeping the same value here makes a synthetic Config equal to the one read back from its file.
_EPS_1E6 = float(np.float32(1e-6))


def _qwen25(n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab, tied) -> Config:
    return Config(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        context_length=32768,
        vocab_size=vocab,
        rope_theta=1000000.0,
        rms_eps=_EPS_1E6,
        tied_output=tied,
    )


# Qwen2.5 Instruct hyper-parameters, from the HF config.json of Qwen/Qwen2.5-{size}-Instruct
# (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# vocab_size, tie_word_embeddings; max_position_embeddings 32768, rope_theta 1e6). Checked against
# public copies of those files: the Qwen2.5-{3B,7B,14B,32B} config.json copies in
# citsjtu2020/LLM-Prof sglang/Model_Config.md, the Qwen2.5-{0.5B..72B} preset table in Invergent's
# models/qwen25.cpp (create_qwen25_config), and Qwen2.5-{32B,72B}-Instruct config.json copies
# (max_position_embeddings 32768, rms_norm_eps 1e-06). vocab_size is the embedding row count of
# the real files: 151936 for 0.5B/1.5B/3B (tied: no output.weight), 152064 for 7B/14B (untied).
# rms_norm_eps is 1e-6 for every Instruct model; note the 14B *base* model's config says 1e-5.
SYNTHETIC_CONFIGS: dict[str, Config] = {
    #                         layers d_model heads kv  d_ff   vocab   tied
    "qwen2.5-0.5b": _qwen25(24, 896, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen25(28, 1536, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": _qwen25(36, 2048, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": _qwen25(28, 3584, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen25(48, 5120, 40, 8, 13824, 152064, False),
}

# Other families, from the HF config.json of the models named (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size, rope_theta,
# rms_norm_eps, tie_word_embeddings, sliding_window): meta-llama/Llama-3.1-8B-Instruct (rope_freqs
# from its llama3 rope_scaling: factor 8, low/high frequency factors 1 / 4, original context 8192),
# Qwen/Qwen3-8B, google/gemma-3-1b-it (sliding_window 512, every sixth layer global), and
# HuggingFaceTB/SmolLM2-135M-Instruct (the real file of tests/test_families.py). The "-tiny" ones
# are small models of the same families for tests (gemma3-tiny: 7 layers, so one global layer).
_EPS_1E5 = float(np.float32(1e-5))
_GEMMA3_LOCAL = dict(family="gemma3", swa_period=6, rope_theta_local=10000.0)
# fmt: off
SYNTHETIC_CONFIGS.update({
    #               layers d_model heads kv d_ff  context vocab  rope_theta eps       tied
    "llama3.1-8b":  Config(32, 4096, 32, 8, 14336, 131072, 128256, 500000.0,  _EPS_1E5, False,
                           family="llama", rope_freq_factors=True),
    "smollm2-135m": Config(30, 576,  9,  3, 1536,  8192,   49152,  100000.0,  _EPS_1E5, True,
                           family="llama"),
    "qwen3-8b":     Config(36, 4096, 32, 8, 12288, 40960,  151936, 1000000.0, _EPS_1E6, False,
                           family="qwen3", head_dim=128),
    "gemma3-1b":    Config(26, 1152, 4,  1, 6912,  32768,  262144, 1000000.0, _EPS_1E6, True,
                           head_dim=256, sliding_window=512, **_GEMMA3_LOCAL),
    "llama-tiny":   Config(2,  256,  4,  2, 512,   2048,   512,    500000.0,  _EPS_1E5, False,
                           family="llama", rope_freq_factors=True),
    "qwen3-tiny":   Config(2,  256,  4,  2, 512,   2048,   512,    1000000.0, _EPS_1E6, False,
                           family="qwen3", head_dim=128),
    "gemma3-tiny":  Config(7,  256,  2,  1, 512,   2048,   512,    1000000.0, _EPS_1E6, True,
                           head_dim=128, sliding_window=32, **_GEMMA3_LOCAL),
})
# fmt: on


def _moe_configs() -> dict[str, Config]:
    """Mixture-of-experts models. Real shapes from the HF config.json of Qwen/Qwen3-30B-A3B
    (hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 used,
    moe_intermediate_size 768, intermediate_size 6144, max_position_embeddings 40960, rope_theta
    1e6, vocab 151936, untied) and mistralai/Mixtral-8x7B-Instruct-v0.1 (hidden 4096, 32 layers,
    32 heads, 8 KV heads, 8 experts, 2 used, intermediate_size 14336, rope_theta 1e6, rms 1e-5,
    vocab 32000, untied). The "-tiny" ones are small models of each MoE family for tests: every
    width a multiple of 256 (IQ4_XS blocks), E / k = 16 / 4, 8 / 2 (+ shared expert), 8 / 2."""
    qwen3moe = dict(family="qwen3moe", head_dim=128, expert_weights_norm=True)
    mixtral = dict(family="llama", expert_weights_norm=True)
    # gpt-oss: YaRN factor 32 over 4096 positions on every layer, even layers sliding
    gptoss = dict(
        family="gpt-oss",
        swa_period=2,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
        expert_gating="softmax_weight",
        expert_act="swiglu_oai",
    )
    qwen35moe = dict(
        family="qwen35moe",
        d_ff_shared=512,
        expert_weights_norm=True,
        rope_dims=64,
        recurrent_layers=tuple((i + 1) % 4 != 0 for i in range(40)),
        ssm_conv_kernel=4,
        ssm_state=128,
        ssm_groups=16,
        ssm_v_heads=32,
    )
    # fmt: off
    return {
        #                 layers d_model heads kv d_ff  context vocab  rope_theta eps       tied
        "qwen3-30b-a3b":  Config(48, 2048, 32, 4, 6144, 40960, 151936, 1000000.0, _EPS_1E6, False,
                                 n_experts=128, n_experts_used=8, d_ff_expert=768, **qwen3moe),
        "mixtral-8x7b":   Config(32, 4096, 32, 8, 14336, 32768, 32000, 1000000.0, _EPS_1E5, False,
                                 n_experts=8, n_experts_used=2, d_ff_expert=14336, **mixtral),
        "qwen3moe-tiny":  Config(2,  256,  4,  2, 1024, 2048,  512,    1000000.0, _EPS_1E6, False,
                                 n_experts=16, n_experts_used=4, d_ff_expert=256, **qwen3moe),
        "qwen2moe-tiny":  Config(2,  256,  4,  2, 512,  2048,  512,    1000000.0, _EPS_1E6, False,
                                 family="qwen2moe", n_experts=8, n_experts_used=2,
                                 d_ff_expert=256, d_ff_shared=512),
        "mixtral-tiny":   Config(2,  256,  4,  2, 256,  2048,  512,    1000000.0, _EPS_1E5, False,
                                 n_experts=8, n_experts_used=2, d_ff_expert=256, **mixtral),
        # Qwen/Qwen3.6-35B-A3B (model card): 40 layers, 3 DeltaNet then 1 gated attention, hidden
        # 2048, DeltaNet 16 q/k and 32 v heads of 128, attention 16 / 2 heads of 256 with RoPE on
        # 64 dims, 256 experts of 512, 8 used + a shared one of 512, vocab 248320, context
        # 262144; rope_theta 1e7 and an untied head as Qwen3.5; no MTP block (not run here)
        "qwen3.6-35b-a3b": Config(40, 2048, 16, 2, 512, 262144, 248320, 10000000.0, _EPS_1E6,
                                  False, head_dim=256, n_experts=256, n_experts_used=8,
                                  d_ff_expert=512, **qwen35moe),
        "gpt-oss-20b":    Config(24, 2880, 64, 8, 2880, 131072, 201088, 150000.0, _EPS_1E5, False,
                                 head_dim=64, sliding_window=128, n_experts=32, n_experts_used=4,
                                 d_ff_expert=2880, **gptoss),
        "gpt-oss-tiny":   Config(4,  256,  8,  2, 256,  4096,  512,    150000.0,  _EPS_1E5, False,
                                 head_dim=64, sliding_window=32, n_experts=8, n_experts_used=2,
                                 d_ff_expert=256, **gptoss),
    }
    # fmt: on


SYNTHETIC_CONFIGS.update(_moe_configs())
SYNTHETIC_CONFIGS.update(QWEN35_CONFIGS)
SYNTHETIC_CONFIGS.update(gemma4_real_shapes())  # Gemma-4-31B, 26B-A4B, E4B (gemma4_keys.py)
# gemma3-1b with every layer global (no sliding window): the A/B of sliding-window prefill, in
# memory (bench.py --synthetic); a gemma3 GGUF must name its window, so its file does not load.
SYNTHETIC_CONFIGS["gemma3-1b-global"] = dataclasses.replace(
    SYNTHETIC_CONFIGS["gemma3-1b"], sliding_window=0
)


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float = 8.0,
    low: float = 1.0,
    high: float = 4.0,
    original_context: int = 8192,
) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf computes it for Llama 3.1's "llama3" rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = original_context / low, original_context / high
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# Qwen2.5 special token ids (tokenizer.ggml.* of the real files).

# --------------------------------------------------------------------------------------------
# Random tensors
# --------------------------------------------------------------------------------------------

# Byte offsets of the f16 scale fields inside one block (ggml-common.h block_* layouts):
# role "d" is the scale; "m" (Q4_1/Q5_1) the additive min; "dmin" (K-quants) the min's scale.
_SCALE_FIELDS: dict[QType, tuple[tuple[str, int], ...]] = {
    QType.Q4_0: (("d", 0),),  # d, qs[16]
    QType.Q4_1: (("d", 0), ("m", 2)),  # d, m, qs[16]
    QType.Q5_0: (("d", 0),),  # d, qh[4], qs[16]
    QType.Q5_1: (("d", 0), ("m", 2)),  # d, m, qh[4], qs[16]
    QType.Q8_0: (("d", 0),),  # d, qs[32]
    QType.Q2_K: (("d", 80), ("dmin", 82)),  # scales[16], qs[64], d, dmin
    QType.Q3_K: (("d", 108),),  # hmask[32], qs[64], scales[12], d
    QType.Q4_K: (("d", 0), ("dmin", 2)),  # d, dmin, scales[12], qs[128]
    QType.Q5_K: (("d", 0), ("dmin", 2)),  # d, dmin, scales[12], qh[32], qs[128]
    QType.Q6_K: (("d", 208),),  # ql[128], qh[64], scales[16], d
    QType.IQ4_NL: (("d", 0),),  # d, qs[16]
    QType.IQ4_XS: (("d", 0),),  # d, scales_h, scales_l[4], qs[128] (random 6-bit scales)
}

# The min field as a multiple of d that makes random blocks zero-mean on average:
#   Q4_1/Q5_1: w = d*q + m, q uniform on [0, 15] / [0, 31] -> m = -7.5 d / -15.5 d
#   Q2_K/Q4_K/Q5_K: w = d*sc*q - dmin*mn with sc, mn uniform and identically distributed
#   -> dmin = E[q] d = 1.5 d / 7.5 d / 15.5 d.
_MIN_RATIO = {
    QType.Q4_1: -7.5,
    QType.Q5_1: -15.5,
    QType.Q2_K: 1.5,
    QType.Q4_K: 7.5,
    QType.Q5_K: 15.5,
}

# target RMS of the dequantized random weights (real Qwen2.5 matrices: ~0.01-0.05)
WEIGHT_RMS = 0.02
_unit_rms: dict[QType, float] = {}


def _overwrite_scales(
    blocks: np.ndarray, qtype: QType, d_bits: np.ndarray, m_bits: np.ndarray | None
) -> None:
    """Store f16 bit patterns into every block's scale fields. blocks: uint8 [n, type_size].

    Every block size and field offset is even, so the fields are whole columns of a uint16 view.
    """
    cols = blocks.view(np.uint16)
    for role, off in _SCALE_FIELDS[qtype]:
        cols[:, off // 2] = d_bits if role == "d" else m_bits


def _random_scales(
    qtype: QType, n: int, rng: np.random.Generator, unit: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """f16 bits of n block scales |d| = unit * U[0.5, 1.5) and of their min field (or None).

    Drawn from a 1024-entry table (f32 -> f16 conversion of tens of millions of values is the
    slow part otherwise); formats without a min get a random sign (bit 10 of the draw -> bit 15).
    """
    table = np.float32(unit) * (
        np.float32(0.5) + (np.arange(1024, dtype=np.float32) + np.float32(0.5)) / 1024
    )
    r = rng.bit_generator.random_raw(-(-n // 4)).view(np.uint16)[:n]
    idx = r & np.uint16(1023)
    d_bits = table.astype(np.float16).view(np.uint16)[idx]
    if qtype in _MIN_RATIO:
        m_bits = (table * np.float32(_MIN_RATIO[qtype])).astype(np.float16).view(np.uint16)[idx]
        return d_bits, m_bits
    d_bits |= (r & np.uint16(1024)) << np.uint16(
        5
    )  # random sign: removes the -d/2 mean of q - 2^(b-1)
    return d_bits, None


def _unit_scale_rms(qtype: QType) -> float:
    """RMS of dequantized random blocks of `qtype` with d = 1 (computed once with gguf.quants)."""
    if qtype not in _unit_rms:
        from gguf import quants

        block, size = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(12345)
        blocks = rng.integers(0, 256, size=(4096 * 32 // block + 64, size), dtype=np.uint8)
        one = np.ones(blocks.shape[0], np.float16)
        mn = (one * np.float16(_MIN_RATIO[qtype])) if qtype in _MIN_RATIO else None
        _overwrite_scales(
            blocks, qtype, one.view(np.uint16), None if mn is None else mn.view(np.uint16)
        )
        w = quants.dequantize(blocks.reshape(1, -1), qtype)
        _unit_rms[qtype] = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
    return _unit_rms[qtype]


def _float_data(values: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 values -> the array layout load_gguf hands out for a float type."""
    if qtype == QType.F32:
        return values.astype(np.float32, copy=False)
    if qtype == QType.F16:
        return values.astype(np.float16)
    if qtype == QType.BF16:  # uint8 [..., 2*cols], round-to-nearest-even to the top 16 bits
        bits = values.astype(np.float32, copy=False).view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(*values.shape[:-1], values.shape[-1] * 2)
    raise AssertionError(qtype)


SINK_SCALE = 2.0  # gpt-oss attn_sinks.weight: random logits that move the attention visibly


def random_raw_tensor(
    name: str, qtype: QType, shape: tuple[int, ...], rng: np.random.Generator
) -> RawTensor:
    """A tensor of random content laid out exactly as load_gguf would return it.

    Block formats: every byte random (quants, sub-block scales, high bits), then each block's f16
    scale fields overwritten: |d| = WEIGHT_RMS / rms(unit block) * U[0.5, 1.5) (random sign for
    the formats without a min, positive for the others), and the min field (m / dmin) a fixed
    multiple of d that centres the block (see _MIN_RATIO). Dequantized weights are then finite,
    ~zero-mean, RMS ~WEIGHT_RMS = 0.02 and |w| < ~0.12 for every format. For reference, |d| lands
    around 3e-3 (Q4_0/Q4_1), 1.5e-3 (Q5_0/Q5_1), 2.7e-4 (Q8_0), 1.4e-3 (Q2_K), 4.6e-4 (Q3_K),
    7.8e-5 (Q4_K), 3.8e-5 (Q5_K) and 1.5e-5 (Q6_K; a subnormal f16, as in real Q6_K files).
    Float types: vectors named *_norm.weight ~ 1 + N(0, 0.02); attention sinks N(0, SINK_SCALE)
    (so that they weigh in the softmax); other tensors N(0, 0.02).
    """
    qtype = QType(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype in FLOAT_TYPES:
        if name.endswith("_norm.weight"):
            values = 1.0 + WEIGHT_RMS * rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith("ssm_a"):  # DeltaNet's -exp(A_log) < 0: states decay, never grow
            values = -np.exp(rng.standard_normal(shape, dtype=np.float32))
        elif name.endswith("attn_sinks.weight"):  # gpt-oss's sink logits: of the scores' order
            values = SINK_SCALE * rng.standard_normal(shape, dtype=np.float32)
        else:
            values = WEIGHT_RMS * rng.standard_normal(shape, dtype=np.float32)
        return RawTensor(name, qtype, shape, _float_data(values, qtype))
    if qtype not in _SCALE_FIELDS and qtype != QType.MXFP4:
        raise UnsupportedError(
            f"{name}: cannot generate random {qtype.name} data "
            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
        )
    block, size = GGML_QUANT_SIZES[qtype]
    if len(shape) < 1 or shape[-1] % block:
        raise SyntheticSpecError(
            f"{name}: shape {shape} rows are not a whole number of {qtype.name} blocks of {block}"
        )
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    n_bytes = int(np.prod(byte_shape))
    # Raw 64-bit draws viewed as bytes: ~3x faster than rng.integers(0, 256, dtype=uint8).
    data = (
        rng.bit_generator.random_raw(-(-n_bytes // 8)).view(np.uint8)[:n_bytes].reshape(byte_shape)
    )
    blocks = data.reshape(-1, size)
    if qtype == QType.MXFP4:
        _random_e8m0(blocks, rng)
    else:
        d_bits, m_bits = _random_scales(
            qtype, blocks.shape[0], rng, WEIGHT_RMS / _unit_scale_rms(qtype)
        )
        _overwrite_scales(blocks, qtype, d_bits, m_bits)
    return RawTensor(name, qtype, shape, data)


# MXFP4 (no f16 scale: an E8M0 byte, d = 2^(e - 128)): random codebook nibbles have RMS 5.85 at
# d = 1, so e = 119 or 120 (d = 2^-9, 2^-8) gives RMS ~0.018 around WEIGHT_RMS
_MXFP4_E = (119, 120)


def _random_e8m0(blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Store random E8M0 scale bytes of _MXFP4_E in every MXFP4 block [n, 17]."""
    blocks[:, 0] = rng.choice(np.array(_MXFP4_E, np.uint8), blocks.shape[0])


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _metadata(cfg: Config, name: str, file_type: int) -> dict:
    a = cfg.family
    meta = {
        "general.architecture": a,
        "general.type": "model",
        "general.name": name,
        "general.file_type": int(file_type),
        "general.quantization_version": 2,
        f"{a}.block_count": cfg.n_layers,
        f"{a}.context_length": cfg.context_length,
        f"{a}.embedding_length": cfg.d_model,
        f"{a}.feed_forward_length": cfg.d_ff,
        f"{a}.attention.head_count": cfg.n_heads,
        f"{a}.attention.head_count_kv": cfg.n_kv_heads,
        f"{a}.rope.freq_base": float(np.float32(cfg.rope_theta)),
        f"{a}.attention.layer_norm_rms_epsilon": float(np.float32(cfg.rms_eps)),
    }
    meta.update(_family_metadata(cfg))
    meta.update(_moe_metadata(cfg))
    meta.update(special_tokens_metadata(cfg.vocab_size, cfg.family))
    return meta


def _family_metadata(cfg: Config) -> dict:
    """The `{arch}.*` keys beyond Qwen2's that the family's config_from_metadata reads."""
    a, meta = cfg.family, {}
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        meta[f"{a}.attention.key_length"] = meta[f"{a}.attention.value_length"] = cfg.head_dim
    if cfg.family != "qwen2":
        meta[f"{a}.rope.dimension_count"] = cfg.rope_dims or cfg.head_dim
    if cfg.sliding_window:
        meta[f"{a}.attention.sliding_window"] = cfg.sliding_window
    if cfg.yarn_factor:
        meta[f"{a}.rope.scaling.type"] = "yarn"
        meta[f"{a}.rope.scaling.factor"] = float(np.float32(cfg.yarn_factor))
        meta[f"{a}.rope.scaling.original_context_length"] = cfg.yarn_orig_ctx
    if cfg.family == "gpt-oss" and cfg.rope_theta_local:
        meta[f"{a}.rope.freq_base_swa"] = float(np.float32(cfg.rope_theta_local))
    if cfg.recurrent_layers:
        meta.update(_hybrid_metadata(cfg))
    if cfg.family == "gemma4":
        meta.update(gemma4_metadata(cfg))
    return meta


def _moe_metadata(cfg: Config) -> dict:
    """The `{arch}.expert_*` keys of a mixture-of-experts model (Mixtral's expert width is its
    feed_forward_length: llama.cpp reads no expert_feed_forward_length for `llama`)."""
    a = cfg.family
    if not cfg.n_experts:
        return {}
    meta = {f"{a}.expert_count": cfg.n_experts, f"{a}.expert_used_count": cfg.n_experts_used}
    if a != "llama":
        meta[f"{a}.expert_feed_forward_length"] = cfg.d_ff_expert
    if cfg.d_ff_shared:
        meta[f"{a}.expert_shared_feed_forward_length"] = cfg.d_ff_shared
    return meta


def _hybrid_metadata(cfg: Config) -> dict:
    """A qwen35 file's DeltaNet keys (as the converter writes them: the layer pattern as an array
    over every block, MTP blocks false) and its MTP block count."""
    a = cfg.family
    return {
        f"{a}.ssm.conv_kernel": cfg.ssm_conv_kernel,
        f"{a}.ssm.state_size": cfg.ssm_state,
        f"{a}.ssm.group_count": cfg.ssm_groups,
        f"{a}.ssm.time_step_rank": cfg.ssm_v_heads,
        f"{a}.ssm.inner_size": cfg.ssm_v_heads * cfg.ssm_state,
        f"{a}.attention.recurrent_layers": list(cfg.recurrent_layers) + [False] * cfg.mtp_layers,
        # t / h / w sizes covering every pair, as Qwen3.6's [11, 11, 10, 0] of 32 pairs
        f"{a}.rope.dimension_sections": [
            -(-cfg.rope_dims // 6),
            -(-cfg.rope_dims // 6),
            cfg.rope_dims // 2 - 2 * -(-cfg.rope_dims // 6),
            0,
        ],
        f"{a}.nextn_predict_layers": cfg.mtp_layers,
    }


def _guess_file_type(types: Mapping[str, QType]) -> int:
    """general.file_type for an explicit type table: the ftype whose default covers attn_q."""
    q = next((t for n, t in types.items() if n.endswith("attn_q.weight")), QType.F32)
    for ft, default in DEFAULT_TYPE.items():
        if default == q:
            return int(ft)
    return int(LlamaFileType.GUESSED)


def synthetic_model_from_config(
    cfg: Config,
    types: str | LlamaFileType | Mapping[str, QType] = "q4_k_m",
    seed: int = 0,
    *,
    name: str | None = None,
    threads: int | None = None,
) -> GGUFModel:
    """A random-weight model of shape `cfg`, in memory.

    types: a file type (mix from `tensor_types(cfg, types)`) or an explicit {tensor name: type}
    table covering every tensor of `expected_shapes(cfg)`. Each tensor's content depends only on
    (seed, tensor name), so a model with fewer layers shares its layers with the full one.
    rms_eps/rope_theta are rounded to float32, as a GGUF file stores them.
    """
    cfg = dataclasses.replace(
        cfg, rms_eps=float(np.float32(cfg.rms_eps)), rope_theta=float(np.float32(cfg.rope_theta))
    )
    shapes = expected_shapes(cfg)
    if isinstance(types, Mapping):
        type_map = {n: QType(t) for n, t in types.items()}
        missing = [n for n in shapes if n not in type_map]
        extra = [n for n in type_map if n not in shapes]
        if missing or extra:
            raise SyntheticSpecError(
                f"type table does not match the config: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        for n, t in type_map.items():
            allowed = FLOAT_TYPES if len(shapes[n]) == 1 else SUPPORTED_TYPES
            if t not in allowed:
                raise UnsupportedError(f"{n}: type {t.name} is not supported for this tensor")
        file_type = _guess_file_type(type_map)
        label = "custom"
    else:
        ft = parse_ftype(types)
        type_map = tensor_types(cfg, ft)
        file_type = int(ft)
        label = ft.name.removeprefix("MOSTLY_").removeprefix("ALL_")

    def build(tname: str) -> RawTensor:
        if tname == "rope_freqs.weight":  # frequency divisors: real values, not noise
            factors = (
                proportional_rope_factors(cfg.head_dim)
                if cfg.family == "gemma4"
                else llama3_rope_factors(cfg.head_dim, cfg.rope_theta)
            )
            return RawTensor(tname, QType.F32, shapes[tname], factors)
        rng = np.random.default_rng([seed, zlib.crc32(tname.encode())])
        scale = gemma4_vector(tname, shapes[tname], rng) if cfg.family == "gemma4" else None
        if scale is not None:  # gemma4's scale vectors (F32): values of a sane forward
            return RawTensor(tname, QType.F32, shapes[tname], scale)
        return random_raw_tensor(tname, type_map[tname], shapes[tname], rng)

    # numpy's generators and casts release the GIL on large arrays: a thread per core helps.
    workers = threads or min(8, os.cpu_count() or 1)
    names = sorted(shapes, key=lambda n: -int(np.prod(shapes[n])))  # big tensors first
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            built = dict(zip(names, pool.map(build, names)))
    else:
        built = {n: build(n) for n in names}
    tensors = {n: built[n] for n in shapes}
    tag = name or f"{cfg.n_layers}L-d{cfg.d_model}:{label.lower()}"
    return GGUFModel(
        path=f"synthetic:{tag}",
        config=cfg,
        metadata=_metadata(cfg, f"synthetic {tag}", file_type),
        tensors=tensors,
        file_size=sum(t.nbytes for t in tensors.values()),
    )


def parse_spec(spec: str) -> tuple[str, str]:
    """'Qwen2.5-7B:Q4_K_M' -> ('qwen2.5-7b', 'q4_k_m'); the file type defaults to q4_k_m."""
    parts = str(spec).strip().lower().split(":")
    if parts and parts[0] == "synthetic":
        parts = parts[1:]
    if len(parts) == 1:
        parts.append("q4_k_m")
    if len(parts) != 2 or parts[0] not in SYNTHETIC_CONFIGS or parts[1] not in FTYPES:
        raise SyntheticSpecError(
            f"bad synthetic model spec {spec!r}: expected '<config>:<ftype>' with config one of "
            f"{', '.join(SYNTHETIC_CONFIGS)} and ftype one of {', '.join(FTYPES)} "
            "(e.g. 'qwen2.5-7b:q4_k_m')"
        )
    return parts[0], parts[1]


def synthetic_model(spec: str, *, seed: int = 0, layers: int | None = None) -> GGUFModel:
    """An in-memory random-weight model of one of SYNTHETIC_CONFIGS, e.g.
    synthetic_model("qwen2.5-7b:q4_k_m").

    spec is '<config>:<ftype>' (case-insensitive, optional 'synthetic:' prefix): config a key of
    SYNTHETIC_CONFIGS, ftype a key of FTYPES. `layers` overrides the layer count (the type mix is
    then the one llama.cpp would choose for that many layers). The path is
    'synthetic:<config>:<ftype>[:layers=N][:seed=S]'.
    """
    cfg_name, ftype, cfg = _spec_config(spec, layers)
    tag = (
        f"{cfg_name}:{ftype}"
        + (f":layers={layers}" if layers is not None else "")
        + (f":seed={seed}" if seed else "")
    )
    return synthetic_model_from_config(cfg, ftype, seed, name=tag)


def _spec_config(spec: str, layers: int | None) -> tuple[str, str, Config]:
    """(config name, ftype, Config with `layers` layers where given) of a synthetic spec."""
    cfg_name, ftype = parse_spec(spec)
    cfg = SYNTHETIC_CONFIGS[cfg_name]
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
            raise SyntheticSpecError(f"layers must be a positive int, got {layers!r}")
        # a hybrid's layer pattern repeats (qwen35moe: 3 DeltaNet, 1 attention)
        pattern = cfg.recurrent_layers
        recurrent = tuple(pattern[i % len(pattern)] for i in range(layers)) if pattern else ()
        cfg = (
            gemma4_with_layers(cfg, layers)
            if cfg.family == "gemma4"
            else dataclasses.replace(cfg, n_layers=layers, recurrent_layers=recurrent)
        )
    return cfg_name, ftype, cfg


def matrices_in(cfg: Config, qtype: QType) -> dict[str, QType]:
    """A type table of `cfg` with every matrix but the token embedding in qtype and the rest F32."""
    return {
        n: QType(qtype) if len(s) == 2 and n != "token_embd.weight" else QType.F32
        for n, s in expected_shapes(cfg).items()
    }


def one_format_model(config_name: str, qtype: QType, seed: int = 0) -> GGUFModel:
    """A random-weight model of SYNTHETIC_CONFIGS[config_name] whose matrices are one weight format
    (matrices_in; tools/llama_cpp_reference.py synthetic --matrix-type)."""
    cfg = SYNTHETIC_CONFIGS[config_name]
    name = f"{config_name}:{QType(qtype).name.lower()}-matrices"
    return synthetic_model_from_config(cfg, matrices_in(cfg, qtype), seed, name=name)


def synthetic_shapes(spec: str, layers: int | None = None) -> tuple[dict, dict, bool, str]:
    """(tensor types, tensor shapes, tied head, label) of synthetic_model(spec, layers=layers),
    without generating its weights."""
    cfg_name, ftype, cfg = _spec_config(spec, layers)
    label = f"synthetic:{cfg_name}:{ftype}" + (f":layers={layers}" if layers is not None else "")
    return tensor_types(cfg, ftype), expected_shapes(cfg), cfg.tied_output, label


# --------------------------------------------------------------------------------------------
# GGUF writer
# --------------------------------------------------------------------------------------------


def write_gguf(
    model: GGUFModel, path: str | os.PathLike, progress: bool = True, tokenizer: dict | None = None
) -> None:
    """Write `model` as a GGUF file that load_gguf reads back identically
    (config, types, shapes, bytes).

    tokenizer: tokenizer.* metadata to write (e.g. a real model's, chat template included) instead
    of the placeholder vocab.

    Metadata: general.architecture/name/file_type/quantization_version, the family's
    hyper-parameters (`<architecture>.*`) from model.config, and the family's placeholder tokenizer
    (minfer_bench.synthetic_vocab: its real files' tokenizer kind and pre-tokenizer, a vocabulary
    that spells any text, bos/eos/padding ids). Tensor bytes are written as they are (quantized
    blocks through raw_dtype; byte-shaped uint8 rows are turned back into element shapes by
    gguf-py).

    What llama.cpp makes of it: the keys and tensors are those its loader for the family requires
    (llama-bench runs these files), and a gpt2 vocab needs tokenizer.ggml.merges plus a token for
    every byte-level character ('\\n' included), which this vocab has. Still missing for real use:
    a real vocabulary and merge list (text tokenizes to single bytes), tokenizer.chat_template,
    and of course real weights -- generation produces noise, which is all a speed benchmark needs.
    """
    import gguf

    cfg = model.config
    meta = model.metadata
    w = gguf.GGUFWriter(os.fspath(path), arch=cfg.family)
    w.add_type("model")
    w.add_name(str(meta.get("general.name", "synthetic")))
    w.add_block_count(cfg.n_layers + cfg.mtp_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_head_count(cfg.n_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    family_keys = _family_metadata(cfg) | _moe_metadata(cfg)
    if f"{cfg.family}.feed_forward_length" not in family_keys:  # gemma4's may be per layer
        w.add_feed_forward_length(cfg.d_ff)
    if f"{cfg.family}.attention.head_count_kv" not in family_keys:
        w.add_head_count_kv(cfg.n_kv_heads)
    for key, value in family_keys.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_file_type(int(meta.get("general.file_type", LlamaFileType.GUESSED)))
    w.add_quantization_version(int(meta.get("general.quantization_version", 2)))

    _write_tokenizer(
        w, placeholder_tokenizer(cfg.vocab_size, cfg.family) if tokenizer is None else tokenizer
    )

    for name, t in model.tensors.items():
        data = np.ascontiguousarray(t.data)
        if t.qtype in (QType.F32, QType.F16) and data.dtype != np.uint8:
            w.add_tensor(name, data)  # dtype gives the type
        else:
            w.add_tensor(name, data, raw_dtype=t.qtype)  # uint8 byte rows
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
    finally:
        w.close()


def _write_tokenizer(w, meta: dict) -> None:
    """tokenizer.* metadata (a real model's, or the placeholder vocab) into a GGUFWriter."""
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:  # gemma4's files have none
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if meta.get("tokenizer.ggml.merges"):
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    optional = {  # written where the source has them
        "tokenizer.ggml.padding_token_id": w.add_pad_token_id,
        "tokenizer.ggml.unknown_token_id": w.add_unk_token_id,
        "tokenizer.ggml.eot_token_id": w.add_eot_token_id,
        "tokenizer.ggml.eom_token_id": w.add_eom_token_id,
        "tokenizer.ggml.add_bos_token": w.add_add_bos_token,
        "tokenizer.ggml.add_eos_token": w.add_add_eos_token,
    }
    for key, add in optional.items():
        if key in meta:
            add(meta[key])
    if "tokenizer.ggml.scores" in meta:  # SentencePiece vocabularies (a real model's)
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])
