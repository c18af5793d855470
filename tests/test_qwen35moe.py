"""Qwen3.5 / 3.6 MoE (`qwen35moe`): a synthetic file (synthetic_qwen35's "qwen35moe-tiny":
qwen35's DeltaNet and gated-attention layers, 8 experts of which 2 are used, the shared expert, an
MTP block) against llama.cpp's logits (tests/data/llama_cpp/qwen35moe-*.json, made by
tools/llama_cpp_reference.py hybrid: llama-cpp-python 0.3.36 on the CPU, f32 KV cache) at every
position of a random prompt and llama.cpp's greedy continuation, all F32 and with Q8_0 experts;
the metadata's fallbacks; generate() alone and in a batch."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.errors import GGUFError
from minfer_jax.files.gguf import MetadataView
from minfer_jax.model import qwen35moe
from minfer_jax.model.from_gguf import load_gguf

from minfer_bench.synthetic import write_gguf
from minfer_bench.synthetic_qwen35 import QWEN35_TINY, qwen35_model

DATA = Path(__file__).parent / "data" / "llama_cpp"
NAME = "qwen35moe-tiny"
# F32: ours measured 8.8e-5 of the logit std at every position (no router near-tie among them; the
# issue's bar is 0.02). A missing shared-expert gate, no renormalisation or the wrong pre-FFN norm
# move the logits by far more.
TOLERANCE = 1e-3


@functools.cache
def _file(name: str, tmp: str) -> str:
    path = f"{tmp}/{name.replace(':', '-')}.gguf"
    write_gguf(qwen35_model(name), path, progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("qwen35moe"))
    return lambda name: _file(name, tmp)


@functools.cache
def _model(path: str):
    return minfer_jax.load(path, ctx_size=256, prefill_chunk=64)


def _expected(stem: str) -> list[dict]:
    return json.loads((DATA / f"{stem}.json").read_text())["prompts"]


def _logits(p: dict) -> np.ndarray:
    seq = p["ids"] + p["greedy"]
    steps = np.frombuffer(base64.b64decode(p["logits_i16"]), "<i2").reshape(len(seq), -1)
    return steps * p["logit_step"]


def test_f32_logits_match_llama_cpp_at_every_position(files):
    """170 tokens (two delta-rule chunk edges, three prefill chunks) and 24, each + 16 greedy."""
    path = files(NAME)
    assert load_gguf(path).config == QWEN35_TINY[NAME]
    model = _model(path)
    for p in _expected(NAME):
        got = model.logits(p["ids"] + p["greedy"])
        err = float(np.max(np.abs(got - _logits(p)))) / p["std"]
        print(f"{NAME} F32 {len(p['ids'])} tokens: max |ours - llama.cpp| = {err:.2e} x std")
        assert err < TOLERANCE
        n = len(p["ids"])
        assert got[n - 1 : -1].argmax(-1).tolist() == p["greedy"]


def test_q8_0_experts_stay_near_llama_cpp(files):
    """Q8_0 expert tensors (the rest F32): llama.cpp rounds the activations to 8 bits too, so a
    router choice flips here and there (measured: the std of the difference 0.02-0.035 of the
    logit std at the median position, up to 0.4 where a flip happens; argmax equal at 95-97% of
    the positions). A misread expert block gives ~0.3 everywhere."""
    name = f"{NAME}:q8_0-experts"
    gm = load_gguf(files(name))
    assert gm.tensors["blk.0.ffn_down_exps.weight"].qtype.name == "Q8_0"
    model = _model(files(name))
    for p in _expected(f"{NAME}-q8_0-experts"):
        got, want = model.logits(p["ids"] + p["greedy"]), _logits(p)
        per_position = np.std(got - want, axis=-1) / p["std"]
        agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
        print(f"Q8_0 experts: median {np.median(per_position):.3f} x std, argmax {agree:.2f}")
        assert np.median(per_position) < 0.05 and agree >= 0.9


def _view(**keys) -> MetadataView:
    """The tiny file's metadata (block_count as write_gguf writes it: trunk + MTP) with `keys`
    changed (None: left out)."""
    cfg = QWEN35_TINY[NAME]
    meta = {**qwen35_model(NAME).metadata, "qwen35moe.block_count": cfg.n_layers + cfg.mtp_layers}
    meta.update({f"qwen35moe.{k}": v for k, v in keys.items()})
    kept = {k: v for k, v in meta.items() if v is not None}
    return MetadataView(kept, "m.gguf", "qwen35moe", cfg.vocab_size, False)


def test_config_from_metadata_and_llama_cpps_fallbacks():
    """The expert width falls back to feed_forward_length / k and the shared width to
    feed_forward_length (llama.cpp's qwen35moe.cpp); feed_forward_length itself may be absent
    where both widths are given; a file without experts is refused."""
    assert qwen35moe.config_from_metadata(_view()) == QWEN35_TINY[NAME]
    cfg = qwen35moe.config_from_metadata(
        _view(expert_feed_forward_length=None, expert_shared_feed_forward_length=None)
    )
    assert (cfg.d_ff_expert, cfg.d_ff_shared, cfg.expert_weights_norm) == (256, 512, True)
    cfg = qwen35moe.config_from_metadata(_view(feed_forward_length=None))
    assert (cfg.d_ff_expert, cfg.d_ff_shared) == (128, 256)
    with pytest.raises(GGUFError, match="expert_feed_forward_length"):
        qwen35moe.config_from_metadata(
            _view(feed_forward_length=None, expert_feed_forward_length=None)
        )
    with pytest.raises(GGUFError, match="expert_count"):
        qwen35moe.config_from_metadata(_view(expert_count=None))


def test_generate_alone_and_in_a_batch_gives_llama_cpps_greedy_tokens(files):
    """generate() (decode steps carrying conv and delta states, experts chosen per token) and
    generate_batch() (170 tokens in three chunks; rows of one decode batch) give llama.cpp's
    greedy continuation of each prompt, up to the end-of-text token (the long one's third)."""
    model = _model(files(NAME))
    eos = qwen35_model(NAME).metadata["tokenizer.ggml.eos_token_id"]

    def until_eos(tokens: list[int], n: int) -> list[int]:
        return tokens[: tokens.index(eos)][:n] if eos in tokens else tokens[:n]

    long, short = _expected(NAME)
    got = minfer_jax.generate(model, short["ids"], max_new_tokens=len(short["greedy"]))
    assert got.tokens == until_eos(short["greedy"], 16) and len(got.tokens) == 16
    results = minfer_jax.generate_batch(model, [long["ids"], short["ids"]], max_new_tokens=12)
    assert [r.tokens for r in results] == [until_eos(long["greedy"], 12), short["greedy"][:12]]


def test_real_shape_q4_k_m_mix_is_llama_quantizes_and_runs():
    """synthetic 'qwen3.6-35b-a3b:q4_k_m' (bench.py's spec): the mix tools/quant_mix_vs_llama_cpp.py
    found equal to llama-quantize's on every tensor (narrowed to d_model 256 and 16 experts):
    attn_qkv takes attn_v's rules (Q6_K on the use_more_bits layers), ssm_conv1d and the routers
    stay F32, expert and shared ffn_down Q6_K by the layer in the name. The mix, narrowed and cut
    to 4 layers, loads and gives finite logits."""
    import dataclasses

    from minfer_bench.synthetic import (
        SYNTHETIC_CONFIGS,
        synthetic_model_from_config,
        synthetic_shapes,
    )

    types, shapes, tied, _ = synthetic_shapes("qwen3.6-35b-a3b:q4_k_m")
    assert not tied and shapes["blk.0.ffn_gate_exps.weight"] == (256, 512, 2048)
    assert shapes["blk.0.attn_qkv.weight"] == (8192, 2048) and "blk.3.attn_q.weight" in shapes
    want = {
        "blk.0.attn_qkv.weight": "Q6_K",
        "blk.5.attn_qkv.weight": "Q4_K",
        "blk.0.ssm_conv1d.weight": "F32",
        "blk.0.ffn_gate_inp.weight": "F32",
        "blk.0.ffn_down_exps.weight": "Q6_K",
        "blk.5.ffn_down_exps.weight": "Q4_K",
        "blk.5.ffn_down_shexp.weight": "Q4_K",
        "blk.5.ffn_gate_exps.weight": "Q4_K",
        "blk.3.attn_output.weight": "Q4_K",
        "output.weight": "Q6_K",
    }
    assert {n: types[n].name for n in want} == want
    cfg = SYNTHETIC_CONFIGS["qwen3.6-35b-a3b"]
    small = dataclasses.replace(
        cfg,
        n_layers=4,
        recurrent_layers=cfg.recurrent_layers[:4],
        d_model=256,
        vocab_size=512,
        n_experts=16,
    )
    gm = synthetic_model_from_config(small, "q4_k_m")
    logits = minfer_jax.load(gguf_model=gm, ctx_size=64).logits(list(range(8)))
    assert logits.shape == (8, 512) and np.isfinite(logits).all()
