"""gpt-oss (synthetic gpt-oss-tiny: 4 layers, even ones sliding over 32 keys, YaRN, sinks, biases,
8 experts of which 2 per token) against llama.cpp's logits at every position of two prompts (24
and 72 tokens, the second past the window) plus llama.cpp's 16 greedy tokens after each
(tools/llama_cpp_reference.py logits; llama-cpp-python 0.3.36 on the CPU).

F32 file with an f32 KV cache in llama.cpp: every position within 0.02 logit std (measured: ~1e-6
absolute, so no router near-tie is close to flipping at these seeds). Q8_0 and MXFP4 experts
(the mxfp4_moe mix): llama.cpp quantizes activations to 8 bits there, so only its argmax is
checked, where its top-2 margin is clear of the two paths' distance.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.model import gptoss
from minfer_jax.model.from_gguf import load_gguf

from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model, write_gguf

DATA = Path(__file__).parent / "data" / "llama_cpp"


def _expected(name: str):
    meta = json.loads((DATA / f"{name}.json").read_text())
    rows = np.load(DATA / meta["logits"])
    return meta, [rows[f"p{i}"].astype(np.float32) for i in range(len(meta["prompts"]))]


def _logits(spec: str, seed: int, prompts) -> list[np.ndarray]:
    model = minfer_jax.load(gguf_model=synthetic_model(spec, seed=seed), ctx_size=256)
    return [np.asarray(model.logits(p["ids"])) for p in prompts]


def test_f32_logits_equal_llama_cpp_at_every_position():
    meta, want = _expected("gpt-oss-tiny-f32")
    assert meta["f32_kv"]
    got = _logits(meta["spec"], meta["seed"], meta["prompts"])
    for p, ours, ref in zip(meta["prompts"], got, want):
        assert ours.shape == ref.shape == (len(p["ids"]), 512)
        assert len(p["ids"]) - p["n_prompt"] == 16  # llama.cpp's greedy tokens, teacher-forced
        std = ref.std(axis=-1)
        err = np.abs(ours - ref).max(axis=-1)
        assert (err <= 0.02 * std).all(), (err / std).max()
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gpt-oss-tiny-q8_0", "gpt-oss-tiny-mxfp4_moe"])
def test_quantized_argmax_equals_llama_cpp_where_clear(name):
    """llama.cpp's 8-bit activations move most positions by ~0.03 std and now and then flip a
    router choice (a position off by ~0.5-1 std, measured: 1-6 of 88): the median stays small,
    flips are few, and elsewhere the argmax is llama.cpp's wherever its margin is clear."""
    meta, want = _expected(name)
    got = _logits(meta["spec"], meta["seed"], meta["prompts"])
    flipped = total = 0
    for p, ours, ref in zip(meta["prompts"], got, want):
        dist = np.abs(ours - ref).max(axis=-1)  # per position
        std = ref.std(axis=-1)
        assert np.median(dist / std) < 0.1, np.median(dist / std)
        routed_alike = dist < 0.2 * std
        clear = routed_alike & (np.asarray(p["margin"]) > 2 * dist)
        np.testing.assert_array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
        flipped += int((~routed_alike).sum())
        total += len(p["ids"])
    assert flipped <= 0.1 * total, (flipped, total)


def test_config_and_tensors_round_trip_through_gguf(tmp_path):
    gm = synthetic_model("gpt-oss-tiny:mxfp4_moe")
    write_gguf(gm, tmp_path / "g.gguf", progress=False)
    back = load_gguf(tmp_path / "g.gguf")
    assert back.config == gm.config == SYNTHETIC_CONFIGS["gpt-oss-tiny"]
    assert back.config.yarn == (32.0, 4096) and back.config.window(0) == 32
    assert back.config.window(1) == 0
    assert set(back.tensors) == set(gm.tensors)
    assert back.tensors["blk.0.ffn_up_exps.weight"].qtype.name == "MXFP4"
    assert back.tensors["blk.0.attn_q.weight"].qtype.name == "Q8_0"
    assert back.tensors["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"


def test_gpt_oss_20b_spec_has_the_real_shapes():
    """openai/gpt-oss-20b's config.json: 24 layers, hidden 2880, 64 heads of 64, 8 KV heads, 32
    experts of width 2880, 4 per token, vocab 201088, sliding window 128, YaRN 32 over 4096."""
    from minfer_bench.synthetic import synthetic_shapes

    types, shapes, tied, _ = synthetic_shapes("gpt-oss-20b:mxfp4_moe")
    assert not tied and shapes["blk.0.ffn_down_exps.weight"] == (32, 2880, 2880)
    assert shapes["blk.0.attn_q.weight"] == (4096, 2880)
    assert shapes["blk.0.attn_sinks.weight"] == (64,)
    assert types["blk.3.ffn_gate_exps.weight"].name == "MXFP4"
    assert {types[n].name for n in ("token_embd.weight", "output.weight")} == {"Q8_0"}
    cfg = SYNTHETIC_CONFIGS["gpt-oss-20b"]
    assert (cfg.family, cfg.n_experts_used, cfg.sliding_window) == (gptoss.ARCHITECTURE, 4, 128)


def test_kernel_path_matches_reference_path():
    """The Pallas kernels (interpreted on the CPU, compiled with MINFER_TEST_KERNELS=compiled):
    chunk attention with sinks on windowed and full layers in prefill, decode attention with
    sinks (split-K, its merge) in decode, against the XLA path; a 40-token prompt is past the
    32-token window. Positions where the int8 / f16 activations flip a router choice or a near
    tie are left out, as for the dense families (test_families.py)."""
    from tests.kernel_mode import KERNELS

    gm = synthetic_model("gpt-oss-tiny:q8_0", seed=3, layers=2)  # one windowed, one full
    kern, ref = (
        minfer_jax.load(gguf_model=gm, kernels=k, weights="quantized", ctx_size=64)
        for k in (KERNELS, "xla")
    )
    prompt = np.random.default_rng(1).integers(0, gm.config.vocab_size, 40).tolist()
    got, want = (
        minfer_jax.generate(kern, prompt, max_new_tokens=3),
        minfer_jax.generate(ref, prompt, max_new_tokens=3),
    )
    seq = prompt + want.tokens
    lk, lr = np.asarray(kern.logits(seq)), np.asarray(ref.logits(seq))
    dist = np.abs(lk - lr).max(axis=-1)
    std = lr.std(axis=-1)
    routed_alike = dist < 0.2 * std
    assert routed_alike.mean() > 0.9 and np.median(dist / std) < 0.05
    top2 = np.sort(lr, axis=-1)[:, -2:]
    clear = routed_alike & (top2[:, 1] - top2[:, 0] > 2 * dist)
    np.testing.assert_array_equal(lk.argmax(-1)[clear], lr.argmax(-1)[clear])
    n = len(prompt) - 1  # decode: equal up to the first unclear step
    steps = next((i for i in range(len(want.tokens)) if not clear[n + i]), len(want.tokens))
    assert got.tokens[:steps] == want.tokens[:steps]


def test_tensor_parallel_is_refused_clearly():
    from minfer_jax.engine.sharding import ShardingError, plan_split

    with pytest.raises(ShardingError, match="gpt-oss"):
        plan_split(SYNTHETIC_CONFIGS["gpt-oss-tiny"], 2, o_block=32, ff_block=32)
