"""Synthetic models: llama.cpp's type mix, sane random blocks, GGUF round trip, spec errors."""

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants

from minfer_jax.errors import MinferError, UnsupportedError
from minfer_jax.files.gguf import FLOAT_TYPES, SUPPORTED_TYPES
from minfer_jax.model.from_gguf import expected_shapes, load_gguf
from tests.configs import tiny_config

from minfer_bench.quant_mix import FTYPES, QType, SyntheticSpecError, tensor_types
from minfer_bench.synthetic import (
    SYNTHETIC_CONFIGS,
    placeholder_vocab,
    random_raw_tensor,
    synthetic_model,
    synthetic_model_from_config,
    write_gguf,
)

QUANT_TYPES = sorted(SUPPORTED_TYPES - FLOAT_TYPES)


tiny = tiny_config


def layer_types(types, suffix, n_layers):
    return [types[f"blk.{i}.{suffix}"] for i in range(n_layers)]


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# ----------------------------------------------------------------------------------- configs


def test_configs_are_the_qwen25_shapes():
    c = {
        k: v for k, v in SYNTHETIC_CONFIGS.items() if v.family == "qwen2"
    }  # other families: test_families.py
    assert [
        (k, v.n_layers, v.d_model, v.n_heads, v.n_kv_heads, v.d_ff, v.vocab_size, v.tied_output)
        for k, v in c.items()
    ] == [
        ("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True),
        ("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True),
        ("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, True),
        ("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False),
        ("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False),
    ]
    assert all(
        v.context_length == 32768 and v.rope_theta == 1e6 and v.rms_eps == float(np.float32(1e-6))
        for v in c.values()
    )


# ----------------------------------------------------------------------------------- type mix


@pytest.mark.real_model
def test_q4_k_m_mix_reproduces_the_real_file(real_model):
    # The real file is a Qwen2.5-Coder-0.5B conversion with an output.weight: same shapes, untied.
    cfg = dataclasses.replace(SYNTHETIC_CONFIGS["qwen2.5-0.5b"], tied_output=False)
    assert cfg == real_model.config
    real = {n: t.qtype for n, t in real_model.tensors.items()}
    # It was quantized by a llama-quantize that walked layers in string order (blk.10 before blk.2).
    assert tensor_types(cfg, "q4_k_m", layer_order="lexicographic") == real
    # Current llama.cpp walks them numerically: same multiset of types, other layers get the Q6_K.
    numeric = tensor_types(cfg, "q4_k_m")
    assert Counter(numeric.values()) == Counter(real.values())
    assert numeric != real


def test_7b_q4_k_m_mix():
    cfg = SYNTHETIC_CONFIGS["qwen2.5-7b"]
    t = tensor_types(cfg, "Q4_K_M")
    assert list(t) == list(expected_shapes(cfg))
    n = cfg.n_layers
    more = [use_more_bits(i, n) for i in range(n)]
    assert sum(more) == 14
    for suffix in ("attn_v.weight", "ffn_down.weight"):
        assert layer_types(t, suffix, n) == [QType.Q6_K if m else QType.Q4_K for m in more]
    assert layer_types(t, "attn_v.weight", n)[:3] == [QType.Q6_K] * 3
    assert t["blk.3.attn_v.weight"] == QType.Q4_K and t["blk.5.ffn_down.weight"] == QType.Q6_K
    for suffix in (
        "attn_q.weight",
        "attn_k.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
    ):
        assert set(layer_types(t, suffix, n)) == {QType.Q4_K}
    assert t["output.weight"] == QType.Q6_K
    assert t["token_embd.weight"] == QType.Q4_K  # untied: no output rule
    assert {t[k] for k in t if k.endswith(("_norm.weight", ".bias"))} == {QType.F32}


def test_tied_models_quantize_token_embd_like_the_output():
    t = tensor_types(SYNTHETIC_CONFIGS["qwen2.5-1.5b"], "q4_k_m")
    assert "output.weight" not in t and t["token_embd.weight"] == QType.Q6_K
    # 896 does not divide Q4_K's 256-blocks: the output rule says Q8_0 directly
    assert (
        tensor_types(SYNTHETIC_CONFIGS["qwen2.5-0.5b"], "q4_k_m")["token_embd.weight"] == QType.Q8_0
    )


def test_q4_0_and_q8_0_mixes():
    cfg = SYNTHETIC_CONFIGS["qwen2.5-7b"]
    t = tensor_types(cfg, "q4_0")
    assert t.pop("output.weight") == QType.Q6_K  # output -> Q6_K unless the default is Q8_0
    assert {v for k, v in t.items() if k.endswith("weight") and "_norm" not in k} == {QType.Q4_0}
    t = tensor_types(cfg, "q8_0")
    assert {v for k, v in t.items() if k.endswith("weight") and "_norm" not in k} == {QType.Q8_0}
    # tied 0.5B under q4_0: token_embd follows the output rule (Q6_K), which falls back to Q8_0
    # (896 % 256)
    t = tensor_types(SYNTHETIC_CONFIGS["qwen2.5-0.5b"], "q4_0")
    assert t["token_embd.weight"] == QType.Q8_0 and t["blk.0.attn_v.weight"] == QType.Q4_0
    assert (
        tensor_types(SYNTHETIC_CONFIGS["qwen2.5-1.5b"], "q4_0")["token_embd.weight"] == QType.Q6_K
    )


def test_other_k_mixes():
    cfg = SYNTHETIC_CONFIGS["qwen2.5-14b"]
    n = cfg.n_layers
    more = [use_more_bits(i, n) for i in range(n)]
    t = tensor_types(cfg, "q5_k_m")
    assert layer_types(t, "ffn_down.weight", n) == [QType.Q6_K if m else QType.Q5_K for m in more]
    assert t["blk.7.attn_q.weight"] == QType.Q5_K and t["output.weight"] == QType.Q6_K
    t = tensor_types(cfg, "q4_k_s")
    assert layer_types(t, "attn_v.weight", n) == [QType.Q5_K] * 4 + [QType.Q4_K] * (n - 4)
    assert layer_types(t, "ffn_down.weight", n) == [QType.Q5_K] * (n // 8) + [QType.Q4_K] * (
        n - n // 8
    )
    t = tensor_types(cfg, "q6_k")
    assert {v for k, v in t.items() if k.endswith("weight") and "_norm" not in k} == {QType.Q6_K}
    t = tensor_types(cfg, "q3_k_m")
    assert t["blk.0.attn_v.weight"] == QType.Q5_K and t["blk.2.attn_v.weight"] == QType.Q4_K
    assert t["blk.0.attn_output.weight"] == QType.Q4_K and t["blk.0.attn_q.weight"] == QType.Q3_K
    t = tensor_types(cfg, "q2_k")  # n_gqa = 5 >= 4
    assert t["blk.9.attn_v.weight"] == QType.Q4_K and t["blk.9.ffn_down.weight"] == QType.Q3_K
    t = tensor_types(cfg, "f16")
    assert (
        t["output.weight"] == t["blk.0.attn_v.weight"] == QType.F16
        and t["blk.0.attn_norm.weight"] == QType.F32
    )


def test_fallback_when_rows_do_not_divide_256():
    cfg = tiny(
        d_model=320, n_heads=5, n_kv_heads=1, d_ff=640
    )  # 320 % 256, 640 % 256 != 0; both % 32 == 0
    t = tensor_types(cfg, "q4_k_m")
    assert t["blk.1.attn_q.weight"] == t["blk.1.ffn_gate.weight"] == QType.Q5_0  # Q4_K -> Q5_0
    assert not use_more_bits(0, 3) and use_more_bits(2, 3)
    assert t["blk.0.attn_v.weight"] == t["blk.0.ffn_down.weight"] == QType.Q5_0  # Q4_K -> Q5_0
    assert t["blk.2.attn_v.weight"] == t["blk.2.ffn_down.weight"] == QType.Q8_0  # Q6_K -> Q8_0
    assert t["output.weight"] == QType.Q8_0 and t["token_embd.weight"] == QType.Q5_0
    assert tensor_types(cfg, "q5_k_s")["blk.1.attn_q.weight"] == QType.Q5_1  # Q5_K -> Q5_1
    assert tensor_types(cfg, "q2_k")["blk.1.attn_q.weight"] == QType.Q4_0  # Q2_K -> Q4_0 (current)
    legacy = tensor_types(cfg, "q2_k", fallback="legacy")  # older llama.cpp: IQ4_NL
    assert legacy["blk.1.attn_q.weight"] == QType.IQ4_NL
    # a row that does not even divide the fallback's 32-blocks: F16
    t = tensor_types(tiny(d_ff=80), "q4_k_m")
    assert t["blk.0.ffn_down.weight"] == t["blk.2.ffn_down.weight"] == QType.F16
    assert t["blk.0.ffn_up.weight"] == QType.Q4_K
    # ... unless the output rule already chose Q8_0: llama.cpp has no fallback for it and aborts
    with pytest.raises(UnsupportedError, match="no tensor type fallback"):
        tensor_types(tiny(d_model=48, n_heads=4, n_kv_heads=2, d_ff=96), "q4_k_m")


def test_bad_ftype():
    with pytest.raises(SyntheticSpecError, match="q4_k_m"):
        tensor_types(tiny(), "iq2_xxs")


# ----------------------------------------------------------------------------------- random blocks


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_random_blocks_dequantize_finite_and_small(qtype):
    t = random_raw_tensor("blk.0.ffn_up.weight", qtype, (48, 1024), np.random.default_rng(7))
    block, size = GGML_QUANT_SIZES[qtype]
    assert t.data.dtype == np.uint8 and t.data.shape == (48, 1024 // block * size)
    w = quants.dequantize(t.data, qtype)
    assert w.shape == (48, 1024)
    assert np.isfinite(w).all()
    assert np.abs(w).max() < 0.25
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    assert 0.012 < rms < 0.03
    assert abs(float(w.mean())) < 2e-3


def test_synthetic_model_tensors_are_sane():
    m = synthetic_model("qwen2.5-0.5b:q4_k_m", layers=2)
    assert m.path == "synthetic:qwen2.5-0.5b:q4_k_m:layers=2"
    assert m.config == dataclasses.replace(SYNTHETIC_CONFIGS["qwen2.5-0.5b"], n_layers=2)
    assert {n: t.qtype for n, t in m.tensors.items()} == tensor_types(m.config, "q4_k_m")
    assert m.metadata["general.architecture"] == "qwen2" and m.metadata["general.file_type"] == 15
    for name in (
        "token_embd.weight",
        "blk.0.attn_v.weight",
        "blk.1.ffn_down.weight",
        "blk.1.attn_k.weight",
    ):
        t = m.tensors[name]
        assert t.shape == expected_shapes(m.config)[name]
        w = quants.dequantize(np.asarray(t.data[:64]), t.qtype)
        assert np.isfinite(w).all() and np.abs(w).max() < 0.25
    norm = m.tensors["blk.0.attn_norm.weight"].data
    bias = m.tensors["blk.0.attn_q.bias"].data
    assert (
        norm.dtype == np.float32
        and abs(float(norm.mean()) - 1) < 0.01
        and np.abs(norm - 1).max() < 0.2
    )
    assert bias.dtype == np.float32 and np.abs(bias).max() < 0.2
    assert m.file_size == sum(t.nbytes for t in m.tensors.values())


def test_deterministic_and_layer_prefix_shared():
    a = synthetic_model_from_config(tiny(), "q4_k_m", seed=1)
    b = synthetic_model_from_config(tiny(), "q4_k_m", seed=1, threads=1)
    c = synthetic_model_from_config(tiny(), "q4_k_m", seed=2)
    assert all(np.array_equal(a.tensors[n].data, b.tensors[n].data) for n in a.tensors)
    assert not np.array_equal(
        a.tensors["blk.0.attn_q.weight"].data, c.tensors["blk.0.attn_q.weight"].data
    )
    short = synthetic_model_from_config(tiny(n_layers=2), "q8_0", seed=1)
    full = synthetic_model_from_config(tiny(), "q8_0", seed=1)
    assert np.array_equal(
        short.tensors["blk.1.ffn_up.weight"].data, full.tensors["blk.1.ffn_up.weight"].data
    )


# ---------------------------------------------------------------------------------- GGUF round trip


def assert_same_model(got, want):
    assert got.config == want.config
    assert list(got.tensors) == list(want.tensors)
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert (g.qtype, g.shape, g.data.dtype, g.data.shape) == (
            t.qtype,
            t.shape,
            t.data.dtype,
            t.data.shape,
        ), name
        assert np.array_equal(
            np.asarray(g.data).view(np.uint8), np.asarray(t.data).view(np.uint8)
        ), name


def test_write_gguf_round_trip_every_type(tmp_path):
    cfg = tiny()
    mats, vecs = itertools.cycle(sorted(SUPPORTED_TYPES)), itertools.cycle(sorted(FLOAT_TYPES))
    types = {n: next(vecs) if len(s) == 1 else next(mats) for n, s in expected_shapes(cfg).items()}
    assert set(types.values()) == SUPPORTED_TYPES
    model = synthetic_model_from_config(cfg, types, seed=5)
    path = tmp_path / "every_type.gguf"
    write_gguf(model, path, progress=False)
    got = load_gguf(path)
    assert_same_model(got, model)
    meta = got.metadata
    assert meta["general.architecture"] == "qwen2" and meta["tokenizer.ggml.model"] == "gpt2"
    assert (
        meta["tokenizer.ggml.pre"] == "qwen2"
        and len(meta["tokenizer.ggml.tokens"]) == cfg.vocab_size
    )
    assert len(set(meta["tokenizer.ggml.tokens"])) == cfg.vocab_size
    assert meta["tokenizer.ggml.tokens"][10] == "Ċ"  # byte-level '\n'
    assert meta["tokenizer.ggml.eos_token_id"] < cfg.vocab_size


def test_write_gguf_round_trip_tied_mix(tmp_path):
    model = synthetic_model_from_config(tiny(tied_output=True, vocab_size=512), "q4_k_m", seed=0)
    path = tmp_path / "tied.gguf"
    write_gguf(model, path, progress=False)
    got = load_gguf(path)
    assert got.config.tied_output and "output.weight" not in got.tensors
    assert_same_model(got, model)
    assert got.metadata["general.file_type"] == FTYPES["q4_k_m"]


def test_write_gguf_keeps_a_given_tokenizers_optional_keys(tmp_path):
    """A given tokenizer section is written as it is: ids it has (eot, unknown, add_eos) kept,
    ones it lacks (padding, add_bos) not invented."""
    model = synthetic_model_from_config(tiny(vocab_size=512), "q8_0", seed=0)
    tokens, types, merges = placeholder_vocab(512)
    tok = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.unknown_token_id": 4,
        "tokenizer.ggml.add_eos_token": True,
    }
    path = tmp_path / "tok.gguf"
    write_gguf(model, path, progress=False, tokenizer=tok)
    meta = load_gguf(path).metadata
    assert {k: meta[k] for k in tok if not isinstance(tok[k], list)} == {
        k: v for k, v in tok.items() if not isinstance(v, list)
    }
    assert "tokenizer.ggml.padding_token_id" not in meta
    assert "tokenizer.ggml.add_bos_token" not in meta


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec", ["qwen2.5-9b:q4_k_m", "qwen2.5-7b:q4_k_x", "qwen2.5-7b:q4_k_m:extra", "", "llama-7b"]
)
def test_bad_spec(spec):
    with pytest.raises(SyntheticSpecError) as e:
        synthetic_model(spec)
    assert isinstance(e.value, MinferError) and isinstance(e.value, ValueError)
    assert "qwen2.5-7b" in str(e.value) and "q4_k_m" in str(e.value) and "q8_0" in str(e.value)


def test_bad_layers_and_type_table():
    with pytest.raises(SyntheticSpecError):
        synthetic_model("qwen2.5-0.5b:q8_0", layers=0)
    types = tensor_types(tiny(), "q8_0")
    types.pop("output.weight")
    with pytest.raises(SyntheticSpecError, match="output.weight"):
        synthetic_model_from_config(tiny(), types)
    types = tensor_types(tiny(), "q8_0")
    types["blk.0.attn_norm.weight"] = QType.Q8_0
    with pytest.raises(UnsupportedError):
        synthetic_model_from_config(tiny(), types)


# ------------------------------------------------------------------- the families' tokenizers

# llama.cpp's ids (llama-cpp-python, vocab_only) of code, non-ASCII, a lower-upper pair and a
# decomposed accent for each family's synthetic file (tools/llama_cpp_reference.py families)
FAMILY_IDS = Path(__file__).parent / "data" / "llama_cpp" / "synthetic-families-tokenizer.json"


def _family_files(tmp_path):
    from minfer_bench.synthetic_gemma4 import gemma4_model
    from minfer_bench.synthetic_qwen35 import qwen35_model

    models = {
        "qwen35": qwen35_model("qwen35-tiny"),
        "qwen35moe": qwen35_model("qwen35moe-tiny"),
        "gpt-oss": synthetic_model("gpt-oss-tiny:f32"),
        "gemma4": gemma4_model("gemma4-tiny"),
    }
    for family, model in models.items():
        write_gguf(model, tmp_path / f"{family}.gguf", progress=False)
        yield family, str(tmp_path / f"{family}.gguf")


def test_synthetic_files_tokenize_as_their_family_and_as_llama_cpp(tmp_path):
    """Each family's file names its real files' tokenizer (qwen35 as ggml-vocab-qwen35, gemma4's
    own model and no pre-tokenizer as ggml-vocab-gemma-4, gpt-oss's gpt-4o), splits text as that
    pre-tokenizer does, and llama.cpp (llama-cpp-python on the same file, stored) gives our ids."""
    from minfer_jax.files.tokenizer import Tokenizer
    from tests.cut_vocab import cut_vocab_meta

    real = {}  # (tokenizer model, pre-tokenizer) of llama.cpp's vocabulary files
    for name in ("qwen35", "gemma-4"):
        meta = cut_vocab_meta(f"ggml-vocab-{name}")
        real[name] = (meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre"))
    kinds = {
        "qwen35": real["qwen35"], "qwen35moe": real["qwen35"], "gemma4": real["gemma-4"],
        "gpt-oss": ("gpt2", "gpt-4o"),
    }  # fmt: skip
    # whether "oW" and "e" + U+0301 stay in one piece: qwen35 keeps both, gpt-4o (llama.cpp's
    # rewrite of its regex) splits both, qwen2 (the old placeholder's) would split the accent off
    merged = {"gpt-oss": (False, False), "qwen35": (True, True)}
    merged["qwen35moe"] = merged["qwen35"]
    expected = json.loads(FAMILY_IDS.read_text())["families"]
    for family, path in _family_files(tmp_path):
        meta = load_gguf(path).metadata
        got = (meta["tokenizer.ggml.model"], meta.get("tokenizer.ggml.pre"))
        assert got == kinds[family], family
        assert len(meta["tokenizer.ggml.tokens"]) == expected[family]["n_tokens"], family
        tok = Tokenizer.from_model(load_gguf(path))
        cases = expected[family]["cases"]
        for case in cases:
            ours = tok.encode(case["text"], add_special=False)
            assert ours == case["ids"], (family, case["text"])
            assert tok.decode(ours) == case["text"]
        spelled = [tok.id_to_token(i) for i in tok.encode(cases[2]["text"], add_special=False)]
        if family == "gemma4":  # '▁' for a space, byte fallback, BOS always
            assert spelled[:3] == ["h", "e", "l"] and "▁" in spelled, spelled
            assert [tok.id_to_token(i) for i in tok.encode("Ω", add_special=False)] == [
                "<0xCE>", "<0xA9>",
            ]  # fmt: skip
            assert tok.encode("a")[0] == meta["tokenizer.ggml.bos_token_id"]
            continue
        accent = "e" + tok.id_to_token("\u0301".encode()[0])  # id b: byte b's character
        assert ("oW" in spelled, accent in spelled) == merged[family], (family, spelled)
