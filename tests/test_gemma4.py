"""Gemma 4 (`gemma4`): synthetic F32 files (minfer_bench.synthetic_gemma4) against llama.cpp's
logits (tests/data/llama_cpp/gemma4*-tiny.json, tools/llama_cpp_reference.py hybrid:
llama-cpp-python 0.3.36 on the CPU, f32 KV cache) at every position of a random prompt and
llama.cpp's greedy continuation; the files' metadata rules; the shared-KV cache layout; the prompt
through the scheduler (in pieces, batched, sharing a prefix)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.errors import UnsupportedError
from minfer_jax.model.cache import cache_spec
from minfer_jax.model.from_gguf import config_from_metadata, load_gguf

from minfer_bench.synthetic import write_gguf
from minfer_bench.synthetic_gemma4 import GEMMA4_TINY, gemma4_model

DATA = Path(__file__).parent / "data" / "llama_cpp"
# Measured 4e-3 (dense) and 2e-3 (MoE) of the logit std: llama.cpp computes GELU through an f16
# table (HYBRID_NOTES), we exactly; the bar is 0.05. Slips (SWA off by one, rope_freqs
# ignored, V normed with k_norm, no soft-cap) give 0.1 and more.
TOLERANCE = 0.02


@functools.cache
def _file(name: str, tmp: str) -> str:
    path = f"{tmp}/{name}.gguf"
    write_gguf(gemma4_model(name), path, progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gemma4"))
    return lambda name: _file(name, tmp)


@functools.cache
def _model(path: str):
    return minfer_jax.load(path, ctx_size=256, prefill_chunk=64)


def _expected_prompts(name: str):
    return json.loads((DATA / f"{name}.json").read_text())["prompts"]


def _logits(p) -> np.ndarray:
    steps = np.frombuffer(base64.b64decode(p["logits_i16"]), "<i2")
    return steps.reshape(len(p["ids"]) + len(p["greedy"]), -1) * p["logit_step"]


@pytest.mark.parametrize("name", sorted(GEMMA4_TINY))
def test_logits_match_llama_cpp(files, name):
    """Every position of prompt + llama.cpp's 16 greedy tokens: 170 tokens cross the 32-token
    window five times and the 64-token prefill chunks twice (the prompt fed in pieces)."""
    path = files(name)
    assert load_gguf(path).config == GEMMA4_TINY[name]
    model = _model(path)
    for p in _expected_prompts(name):
        seq = p["ids"] + p["greedy"]
        got, want = model.logits(seq), _logits(p)
        dist = np.abs(got - want).max(-1)
        err = float(dist.max()) / p["std"]
        print(f"{name} {len(p['ids'])} tokens: max |ours - llama.cpp| = {err:.2e} x std")
        assert err < TOLERANCE
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * dist  # a near tie may go either way
        assert clear.mean() > 0.9
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_shared_kv_layers_have_no_cache_of_their_own():
    """gemma4-tiny: layers 4 (sliding) and 5 (full) read the caches of layers 2 and 3; the cache
    holds layers 0-3 only, each of its kind's shape (sliding: 2 KV heads of 64, full: 1 of 128)."""
    cfg = GEMMA4_TINY["gemma4-tiny"]
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    spec = cache_spec(cfg, n_slots=2, max_len=16, dtype=np.float32)
    assert [k.shape for k in spec.k] == [(2, 2, 16, 64), (2, 1, 16, 128)] * 2
    with pytest.raises(minfer_jax.InvalidArgumentError, match="shared-KV"):
        dataclasses.replace(cfg, shared_kv_layers=3)  # layers 1, 2 are full, sliding


def _metadata(name="gemma4-tiny", **overrides):
    gm = gemma4_model(name)
    meta = {**gm.metadata, **{f"gemma4.{k}": v for k, v in overrides.items()}}
    return gm, {k: v for k, v in meta.items() if v is not None}


def _config(gm, meta, names=None):
    names = frozenset(gm.tensors) if names is None else names
    tied = "output.weight" not in names
    return config_from_metadata(meta, "x.gguf", gm.config.vocab_size, tied, names)


def test_metadata_rules_and_refusals():
    gm, meta = _metadata(final_logit_softcapping=None)  # absent: llama.cpp's 30
    assert _config(gm, meta).final_softcap == 30.0
    gm, meta = _metadata(**{"rope.freq_base_swa": None})  # absent: 10000
    assert _config(gm, meta).rope_theta_local == 10000.0
    gm, meta = _metadata(**{"attention.sliding_window_pattern": [True] * 5})
    with pytest.raises(UnsupportedError, match="sliding_window_pattern"):
        _config(gm, meta)
    gm, meta = _metadata(**{"rope.dimension_count_swa": 32})
    with pytest.raises(UnsupportedError, match="RoPE over"):
        _config(gm, meta)
    gm, meta = _metadata(**{"attention.head_count_kv": [2, 1, 2, 1, 1, 1]})
    with pytest.raises(UnsupportedError, match="varies"):
        _config(gm, meta)
    gm, meta = _metadata("gemma4moe-tiny")
    names = frozenset(gm.tensors) - {"blk.1.ffn_gate_inp.weight"}
    with pytest.raises(UnsupportedError, match="experts on 3 of 4 layers"):
        _config(gm, meta, names)
    with pytest.raises(UnsupportedError, match="attn_qkv"):
        _config(gm, meta, frozenset(gm.tensors) | {"blk.0.attn_qkv.weight"})


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    """llama.cpp's greedy tokens as generate() returns them: up to the end-of-sequence token."""
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_batched_and_after_a_shared_prefix_as_llama_cpp(files):
    """The scheduler runs the 170-token prompt (three prefill chunks) beside the 24-token one
    (rows of one decode batch, through the shared-KV layers): each gets llama.cpp's greedy
    continuation. Then the 170 tokens + the first 4 of that continuation reuse the slot's cached
    prefix and get the next 4 (greedy is deterministic: llama.cpp's tokens 5-8, its 9th the
    synthetic vocabulary's end-of-sequence token)."""
    name = "gemma4-tiny"
    model = _model(files(name))
    eos = model.config.vocab_size - 1  # the synthetic vocabulary's
    long, short = _expected_prompts(name)
    sched = model.scheduler(2)
    reqs = [sched.submit(p["ids"], max_new_tokens=len(p["greedy"])) for p in (long, short)]
    sched.run(reqs)
    assert [r.result().tokens for r in reqs] == [
        _until_eos(p["greedy"], eos) for p in (long, short)
    ]
    follow_up = long["ids"] + long["greedy"][:4]
    reused = sched.submit(follow_up, max_new_tokens=4)
    sched.run([reused])
    assert reused.result().cached_tokens >= len(long["ids"])
    assert reused.result().tokens == long["greedy"][4:8]
