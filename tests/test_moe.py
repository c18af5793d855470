"""Mixture-of-experts families (qwen3moe, qwen2moe, Mixtral-style llama) against llama.cpp.

Expected values in tests/data/llama_cpp/<arch>-tiny-<type>.json (+ .npz: llama.cpp's logits for the
F32 files), made by tools/llama_cpp_reference.py with llama-cpp-python on the CPU: random prompts
of 16 and 96 ids followed by llama.cpp's 32 greedy tokens, values at every position.
- F32 files (llama.cpp with an f32 KV cache: its math without its rounding): our logits within
  0.02 standard deviation of llama.cpp's at every position up to the first near tie of a router
  (the float64 forward's k-th and (k+1)-th expert probabilities closer than NEAR_TIE: there either
  side's rounding may pick the other expert), and our argmax equal to llama.cpp's there wherever
  its top-2 margin is clear.
- F16 / Q8_0 files (llama.cpp's f16 KV cache and 8-bit activations): our argmax equal to
  llama.cpp's wherever its top-2 margin exceeds twice both sides' distances from the float64
  forward at that position (a flip needs a margin within the errors).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.errors import GGUFError
from minfer_jax.files.gguf import MetadataView

from minfer_bench import float64_reference
from minfer_bench.synthetic import synthetic_model

DATA = Path(__file__).parent / "data" / "llama_cpp"
ARCHS = ("qwen3moe", "qwen2moe", "mixtral")
NEAR_TIE = 1e-5  # router probability gap below which llama.cpp and we may choose differently
STD_LIMIT = 0.02


def _expected(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@functools.cache
def _model(spec: str, seed: int):
    gm = synthetic_model(spec, seed=seed)
    return gm, minfer_jax.load(gguf_model=gm, ctx_size=256)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_llama_cpp_up_to_the_first_router_tie(arch):
    expected = _expected(f"{arch}-tiny-f32")
    lcpp_logits = np.load(DATA / f"{arch}-tiny-f32.npz")
    gm, model = _model(expected["spec"], expected["seed"])
    checked = 0
    for i, p in enumerate(expected["prompts"]):
        ours = np.asarray(model.logits(p["ids"]))
        lcpp = lcpp_logits[f"logits{i}"].astype(np.float32)
        gaps = np.asarray(p["f64_router_gap"])
        cut = int(np.argmax(gaps < NEAR_TIE)) if (gaps < NEAR_TIE).any() else len(gaps)
        assert cut >= p["n_prompt"] // 2, cut  # most of every prompt is checked
        std = np.std(ours[:cut] - lcpp[:cut], axis=-1)
        assert std.max() < STD_LIMIT, (int(std.argmax()), float(std.max()))
        ref = float64_reference.forward(gm, p["ids"])
        assert np.max(np.abs(ours[:cut] - ref[:cut])) < 1e-4  # f32 vs float64, same experts
        clear = np.asarray(p["margin"])[:cut] > 1e-3
        np.testing.assert_array_equal(
            ours[:cut].argmax(-1)[clear], np.asarray(p["argmax"])[:cut][clear]
        )
        checked += cut
    print(f"{arch} F32: {checked} positions within {STD_LIMIT} std of llama.cpp")


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_argmax_matches_llama_cpp_where_its_margin_is_clear(arch, qtype):
    expected = _expected(f"{arch}-tiny-{qtype}")
    gm, model = _model(expected["spec"], expected["seed"])
    agree = total = tested = 0
    for p in expected["prompts"]:
        ours = np.asarray(model.logits(p["ids"]))
        ref = float64_reference.forward(gm, p["ids"])
        ours_err = np.max(np.abs(ours - ref), axis=-1)
        assert ours_err.max() < 1e-4  # exact dequantization, f32: the float64 forward's experts
        margin, want = np.asarray(p["margin"]), np.asarray(p["argmax"])
        clear = margin > 2 * (np.asarray(p["llama_cpp_f64_max"]) + ours_err)
        np.testing.assert_array_equal(ours.argmax(-1)[clear], want[clear])
        agree += int((ours.argmax(-1) == want).sum())
        total += len(want)
        tested += int(clear.sum())
    print(f"{arch} {qtype}: argmax = llama.cpp's at {agree}/{total}, {tested} clear")
    assert tested >= total // 2 and agree >= 0.9 * total


def test_moe_config_from_metadata():
    """expert_* keys -> Config; qwen*moe's expert width falls back to feed_forward_length / k,
    qwen2moe's shared width to feed_forward_length, Mixtral's expert width is feed_forward_length;
    a file with experts but none used is refused (llama.cpp's check)."""
    from minfer_jax.model import llama, qwen2moe, qwen3moe

    base = {
        "block_count": 2,
        "embedding_length": 256,
        "attention.head_count": 4,
        "feed_forward_length": 1024,
        "context_length": 2048,
        "expert_count": 16,
        "expert_used_count": 4,
    }

    def view(arch, **extra):
        meta = {f"{arch}.{k}": v for k, v in {**base, **extra}.items()}
        return MetadataView(meta, "m.gguf", arch, 512, False)

    c = qwen3moe.config_from_metadata(view("qwen3moe"))
    assert (c.n_experts, c.n_experts_used, c.d_ff_expert) == (16, 4, 256)
    assert c.expert_weights_norm
    c = qwen2moe.config_from_metadata(view("qwen2moe", expert_feed_forward_length=128))
    assert (c.d_ff_expert, c.d_ff_shared, c.expert_weights_norm) == (128, 1024, False)
    c = llama.config_from_metadata(view("llama"))
    assert (c.n_experts, c.d_ff_expert, c.expert_weights_norm) == (16, 1024, True)
    assert llama.config_from_metadata(view("llama", expert_count=0)).n_experts == 0
    with pytest.raises(Exception, match="no expert layers are used"):
        qwen3moe.config_from_metadata(view("qwen3moe", expert_used_count=0))
    with pytest.raises(Exception, match="n_experts_used"):
        qwen3moe.config_from_metadata(view("qwen3moe", expert_used_count=17))
    with pytest.raises(GGUFError, match="output.weight"):
        qwen2moe.config_from_metadata(MetadataView({}, "m.gguf", "qwen2moe", 512, True))


def test_real_shape_q4_k_m_mixes_are_llama_quantizes():
    """The Q4_K_M mixes of the real-shape specs follow llama-quantize's MoE rules, as
    tools/quant_mix_vs_llama_cpp.py found them equal to llama.cpp's on every tensor: the router
    F32; with eight experts attn_k / attn_v Q8_0 and attn_output Q5_K; expert ffn_down Q6_K on
    the use_more_bits layers (the layer index read from the name)."""
    from minfer_bench.quant_mix import tensor_types
    from minfer_bench.synthetic import SYNTHETIC_CONFIGS

    mix = tensor_types(SYNTHETIC_CONFIGS["mixtral-8x7b"], "q4_k_m")
    assert mix["blk.0.ffn_gate_inp.weight"].name == "F32"
    assert {mix[f"blk.5.attn_{r}.weight"].name for r in ("k", "v")} == {"Q8_0"}
    assert mix["blk.5.attn_output.weight"].name == "Q5_K"
    assert mix["blk.5.ffn_gate_exps.weight"].name == "Q4_K"
    downs = [mix[f"blk.{i}.ffn_down_exps.weight"].name for i in range(32)]
    assert downs[:4] == ["Q6_K"] * 4 and downs[4] == "Q4_K" and downs[-1] == "Q6_K"
    qwen = tensor_types(SYNTHETIC_CONFIGS["qwen3-30b-a3b"], "q4_k_m")
    assert qwen["blk.7.attn_output.weight"].name == "Q4_K"  # 128 experts: no bump
    assert qwen["blk.0.ffn_gate_inp.weight"].name == "F32"


def test_other_moe_architectures_are_one_unsupported_error_naming_them():
    from minfer_jax.errors import UnsupportedError
    from minfer_jax.model.families import for_architecture

    for arch in ("deepseek2", "mamba"):  # gpt-oss, qwen35moe, gemma4 are supported
        with pytest.raises(UnsupportedError, match=f"unsupported architecture '{arch}'"):
            for_architecture(arch, "m.gguf")
