"""Qwen3.5 / 3.6 (`qwen35`): synthetic F32 files (minfer_bench.synthetic_qwen35) against llama.cpp's
logits (tests/data/llama_cpp/qwen35-*.json, tools/llama_cpp_reference.py hybrid: llama-cpp-python
0.3.36 on the CPU, f32 KV cache) at every position of a random prompt and llama.cpp's greedy
continuation; the files' metadata rules; the recurrent state through generate(), batches and the
scheduler's prefix reuse."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.errors import UnsupportedError
from minfer_jax.model.from_gguf import config_from_metadata, load_gguf

from minfer_bench.synthetic import write_gguf
from minfer_bench.synthetic_qwen35 import QWEN35_TINY, qwen35_model

DATA = Path(__file__).parent / "data" / "llama_cpp"
# Ours measured 8e-5 of the logit std (6e-5 of it the stored logits' int16 step); the issue's bar is
# 0.02, the slips HYBRID_NOTES lists (grouped v heads, q / gate swapped, full-dim RoPE) give 0.5-5.
TOLERANCE = 1e-3


@functools.cache
def _file(name: str, tmp: str) -> str:
    path = f"{tmp}/{name}.gguf"
    write_gguf(qwen35_model(name), path, progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("qwen35"))
    return lambda name: _file(name, tmp)


@functools.cache
def _model(path: str, **kw):
    return minfer_jax.load(path, ctx_size=256, prefill_chunk=64, **kw)


@pytest.mark.parametrize(
    "name", sorted(n for n, c in QWEN35_TINY.items() if c.family == "qwen35")
)  # qwen35moe: tests/test_qwen35moe.py
def test_logits_match_llama_cpp(files, name):
    """Every position of prompt + llama.cpp's greedy tokens; 170 tokens cross two chunk edges of
    the delta rule and of the 64-token prefill chunks (state carried), 24 stay in one."""
    expected = json.loads((DATA / f"{name}.json").read_text())
    path = files(name)
    assert load_gguf(path).config == QWEN35_TINY[name]
    model = _model(path)
    for p in expected["prompts"]:
        seq = p["ids"] + p["greedy"]
        steps = np.frombuffer(base64.b64decode(p["logits_i16"]), "<i2").reshape(len(seq), -1)
        got = model.logits(seq)
        err = float(np.max(np.abs(got - steps * p["logit_step"]))) / p["std"]
        print(f"{name} {len(p['ids'])} tokens: max |ours - llama.cpp| = {err:.2e} x std")
        assert err < TOLERANCE
        n = len(p["ids"])
        assert got[n - 1 : -1].argmax(-1).tolist() == p["greedy"]


def _metadata(**overrides):
    gm = qwen35_model("qwen35-tiny")
    meta = dict(gm.metadata)
    meta.update({f"qwen35.{k}": v for k, v in overrides.items()})
    return gm, {k: v for k, v in meta.items() if v is not None}


def test_layer_pattern_from_the_interval_and_refusals():
    gm, meta = _metadata(**{"attention.recurrent_layers": None, "full_attention_interval": 2})
    cfg = config_from_metadata(meta, "x.gguf", 320, True)
    assert cfg.recurrent_layers == (True, False, True, False)
    _, meta = _metadata(**{"rope.dimension_sections": [8, 0, 0, 0]})  # pairs left at position 0
    with pytest.raises(UnsupportedError, match="dimension_sections"):
        config_from_metadata(meta, "x.gguf", 320, True)
    for arch in ("mamba",):
        with pytest.raises(UnsupportedError, match=arch):
            config_from_metadata({**meta, "general.architecture": arch}, "x.gguf", 320, True)


# --- the recurrent state through the engine -------------------------------------------------------


def _expected_prompts(name: str):
    return json.loads((DATA / f"{name}.json").read_text())["prompts"]


def test_generate_alone_and_in_a_batch_gives_llama_cpp_greedy_tokens(files):
    """generate() (a prefill chunk padded past the prompt, then decode steps carrying conv and
    delta states) and generate_batch() (170 tokens in three chunks, the last padded; rows of one
    decode batch, each its own slot's state) give llama.cpp's greedy continuation of each prompt."""
    name = "qwen35-tiny-v3-mtp"
    model = _model(files(name))
    long, short = _expected_prompts(name)
    got = minfer_jax.generate(model, short["ids"], max_new_tokens=len(short["greedy"]))
    assert got.tokens == short["greedy"]
    results = minfer_jax.generate_batch(model, [long["ids"], short["ids"]], max_new_tokens=12)
    assert [r.tokens for r in results] == [long["greedy"][:12], short["greedy"][:12]]


def test_a_shared_prefix_restores_a_checkpoint_never_truncates(files):
    """A conversation's next turn (the previous prompt + answer + more) restores the recurrent
    state its slot's checkpoint holds after the previous prompt and prefills the rest; a prompt
    sharing only part of that prompt is prefilled from position 0 (a recurrent state cannot be cut
    back). Each gets the tokens it gets alone (the model's own scheduler, another cache)."""
    name = "qwen35-tiny"
    model = _model(files(name))
    sched = minfer_jax.Scheduler(model, model.plan(n_seqs=1, decode_steps=4))
    p = _expected_prompts(name)[1]
    first = sched.submit(p["ids"], max_new_tokens=8)
    sched.run([first])
    follow_up = p["ids"] + first.result().tokens + [5, 6, 7]
    second = sched.submit(follow_up, max_new_tokens=8)
    sched.run([second])
    assert first.result().tokens == p["greedy"][:8]
    assert second.result().cached_tokens == len(p["ids"])
    assert second.result().tokens == minfer_jax.generate(model, follow_up, max_new_tokens=8).tokens
    partial = follow_up[:10] + [9, 9, 9]  # shares 10 tokens with the slot's checkpointed prompt
    third = sched.submit(partial, max_new_tokens=8)
    sched.run([third])
    assert third.result().cached_tokens == 0
    assert third.result().tokens == minfer_jax.generate(model, partial, max_new_tokens=8).tokens
