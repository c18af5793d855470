"""Tensor parallelism (sharding.py): the split as data, raw-tensor cuts, and the sharded model
against one device on 4 forced host devices.

The model runs need XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX starts, and the
rest of the suite must keep one device, so they run this file as a script in a subprocess
(`python tests/test_sharding.py xla|interpret`), which prints one JSON line of results. The tiny
model has 2 KV heads (below TP 4: each shard then holds a copy of one), d_ff = 3 Q4_K blocks
(TP 2 and 4 split it unevenly: zero-padded shards), one 64-wide head per shard at TP 4 (o's K
window covers a whole 256 block at an offset) and a vocabulary of 301 (padded head rows).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.configs import tiny_config

from minfer_bench.synthetic import SYNTHETIC_CONFIGS

TINY = tiny_config(n_layers=2, d_ff=768, vocab_size=301)
QWEN25_7B = SYNTHETIC_CONFIGS["qwen2.5-7b"]  # the split plan reads its shapes only
PROMPT = [5, 17, 250, 3, 99]
DEGREES = (1, 2, 4)


def test_7b_split_at_tp2_and_tp4():
    from minfer_jax.engine.sharding import plan_split

    s2 = plan_split(QWEN25_7B, 2, o_block=256, ff_block=256)
    assert (s2.heads, s2.kv_heads, s2.kv_first) == (14, 2, (0, 2))
    assert s2.ff_ranges == ((0, 9472), (9472, 18944)) and s2.ff_width == 9472  # 37 blocks each
    assert (s2.o_starts, s2.o_width, s2.o_offsets) == ((0, 1792), 1792, (0, 0))  # 1792 = 7 blocks
    s4 = plan_split(QWEN25_7B, 4, o_block=256, ff_block=256)
    assert (s4.heads, s4.kv_heads, s4.kv_first) == (7, 1, (0, 1, 2, 3))
    assert [b - a for a, b in s4.ff_ranges] == [19 * 256, 19 * 256, 18 * 256, 18 * 256]
    assert s4.ff_width == 19 * 256  # 74 blocks: two shards padded by one zero block
    # 7 heads x 128 = 896 = 3.5 blocks: each o window is 4 blocks, two of them start half a block
    # early
    assert (s4.o_starts, s4.o_width, s4.o_offsets) == ((0, 768, 1792, 2560), 1024, (0, 128, 0, 128))
    assert s4.vocab_local == 152064 // 4


def test_kv_heads_below_degree_are_copied():
    from minfer_jax.engine.sharding import plan_split

    s = plan_split(TINY, 4, o_block=256, ff_block=256)
    assert (s.heads, s.kv_heads, s.kv_first) == (
        1,
        1,
        (0, 0, 1, 1),
    )  # query heads 0,1 read KV head 0
    assert s.ff_ranges == ((0, 256), (256, 512), (512, 768), (768, 768)) and s.ff_width == 256


@pytest.mark.parametrize(
    "cfg_change, degree, match",
    [
        (dict(n_heads=14, n_kv_heads=2, d_model=14 * 64), 4, "14 query heads"),
        (dict(n_heads=6, n_kv_heads=3, d_model=6 * 64), 2, "3 KV heads"),
    ],
)
def test_impossible_splits_name_the_values(cfg_change, degree, match):
    import dataclasses

    from minfer_jax.engine.sharding import ShardingError, plan_split

    with pytest.raises(ShardingError, match=match):
        plan_split(dataclasses.replace(TINY, **cfg_change), degree, o_block=256, ff_block=256)


def test_more_devices_than_exist_is_an_error():
    from minfer_jax.engine.sharding import make_mesh
    from minfer_jax.errors import MinferError

    with pytest.raises(MinferError, match=r"tensor_parallel must be an integer in 1\.\.1"):
        make_mesh(2, devices=["only-one"])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "F32"])
def test_raw_cuts_decode_to_the_slices(qtype):
    from minfer_jax.engine.sharding import _k_window, _rows
    from minfer_jax.quant.planes import QType, dequantize

    from minfer_bench.synthetic import random_raw_tensor

    t = random_raw_tensor("w", QType[qtype], (6, 768), np.random.default_rng(1))
    full = np.asarray(dequantize(t.data, t.qtype, t.shape))
    win = _k_window(t, 512, 512)  # the last block and one zero block past K
    got = np.asarray(dequantize(win.data, win.qtype, win.shape))
    np.testing.assert_array_equal(
        got, np.concatenate([full[:, 512:], np.zeros((6, 256), np.float32)], axis=1)
    )
    rows = _rows(t, 2, 5, 4)
    got = np.asarray(dequantize(rows.data, rows.qtype, rows.shape))
    np.testing.assert_array_equal(got, np.concatenate([full[2:5], np.zeros((1, 768), np.float32)]))


def _degrees(kernels: str) -> tuple[int, ...]:
    """TP degrees each path runs. The interpreted kernels (each load compiles for ~15 s) at TP 2
    and 4 only: TP 1 runs the same sharded code on a one-device mesh (its split is the whole
    model), which the xla run checks."""
    return DEGREES if kernels == "xla" else (2, 4)


def _run_devices(kernels: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        MINFER_COMPILATION_CACHE="0",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), kernels],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernels", ["xla", "interpret"])
def test_sharded_model_matches_one_device(kernels):
    res = _run_devices(kernels)
    for tp in _degrees(kernels):
        got = res[str(tp)]
        assert got["tokens"] == res["one"]["tokens"], (tp, got, res["one"])
        assert got["logit_err"] <= 3e-4 * res["one"]["logit_max"], (
            tp,
            got,
        )  # f32 order (psum, K splits per shard shape), then a flipped f16 rounding of x
    if kernels == "xla":
        assert (
            res["sampled_tp4"] == res["one"]["sampled"]
        )  # sampled rows: over the gathered vocabulary
        assert (
            res["tied_tp2"] == res["tied_one"]
        )  # tied head: token_embd split by vocabulary as the head
        assert res["spec_tp4"] == res["one"]["tokens"]  # verified drafts at TP 4


def test_moe_split_cuts_each_experts_width():
    """Qwen3-30B-A3B at TP 4: every shard holds all 128 experts, 768 / 4 = 192 rows each
    (Q8_0 down blocks of 32); at Q4_K's 256-wide blocks, 3 blocks over 4 shards (one padded)."""
    from minfer_jax.engine.sharding import local_config, plan_split

    cfg = SYNTHETIC_CONFIGS["qwen3-30b-a3b"]
    s = plan_split(cfg, 4, o_block=32, ff_block=32, expert_block=32)
    assert s.expert_ranges == ((0, 192), (192, 384), (384, 576), (576, 768))
    assert (s.expert_width, s.ff_ranges, s.shared_ranges) == (192, (), ())
    local = local_config(cfg, s)
    assert (local.n_experts, local.n_experts_used, local.d_ff_expert) == (128, 8, 192)
    s = plan_split(cfg, 4, o_block=256, ff_block=256, expert_block=256)
    assert s.expert_width == 256 and s.expert_ranges[3] == (768, 768)
    shared = plan_split(
        SYNTHETIC_CONFIGS["qwen2moe-tiny"],
        2,
        o_block=32,
        ff_block=32,
        expert_block=32,
        shared_block=32,
    )
    assert shared.shared_ranges == ((0, 256), (256, 512)) and shared.expert_width == 128


def test_moe_sharded_model_matches_one_device():
    """qwen2moe-tiny (experts and the gated shared expert) at TP 4 against one device: each expert
    is one Q4_K block wide, so three shards hold only zero padding of it."""
    res = _run_devices("moe")
    for tp in ("4",):
        assert res[tp]["tokens"] == res["one"]["tokens"], (tp, res)
        assert res[tp]["logit_err"] <= 3e-4 * res["one"]["logit_max"], (tp, res)


def _moe_results() -> dict:
    """(run in the 4-device subprocess) qwen2moe-tiny Q4_K_M on one device vs TP 4."""
    import minfer_jax

    from minfer_bench.synthetic import synthetic_model

    gm = synthetic_model("qwen2moe-tiny:q4_k_m", seed=5)
    prompt = list(range(3, 40))  # past 8 tokens: the sorted expert path, then decode's gather

    def run(m):
        toks = minfer_jax.generate(m, prompt, max_new_tokens=3).tokens
        return [int(t) for t in toks], np.asarray(m.logits(prompt))

    tokens, logits = run(minfer_jax.load(gguf_model=gm, ctx_size=64))
    res = {"one": {"tokens": tokens, "logit_max": float(np.abs(logits).max())}}
    for tp in (4,):
        got, lg = run(minfer_jax.load(gguf_model=gm, ctx_size=64, tensor_parallel=tp))
        res[str(tp)] = {"tokens": got, "logit_err": float(np.abs(lg - logits).max())}
    return res


def _model_results(kernels: str) -> dict:
    """(run in the 4-device subprocess) one device vs TP 1, 2, 4 on TINY."""
    import dataclasses

    import jax

    import minfer_jax

    from minfer_bench.synthetic import synthetic_model_from_config

    assert len(jax.devices()) == 4, jax.devices()
    gm = synthetic_model_from_config(TINY, "q4_k_m", seed=5)
    kw = dict(ctx_size=64, kernels=kernels, weights="quantized" if kernels != "xla" else None)

    def run(m, sampled=False, gguf=gm):
        toks = minfer_jax.generate(m, PROMPT, max_new_tokens=3).tokens
        out = {"tokens": [int(t) for t in toks], "logits": np.asarray(m.logits(PROMPT))}
        if sampled:
            out["sampled"] = [
                int(t)
                for t in minfer_jax.generate(
                    m, PROMPT, max_new_tokens=3, temperature=0.8, seed=7
                ).tokens
            ]
        return out

    one = run(minfer_jax.load(gguf_model=gm, **kw), sampled=kernels == "xla")
    res = {
        "one": {
            "tokens": one["tokens"],
            "logit_max": float(np.abs(one["logits"]).max()),
            "sampled": one.get("sampled"),
        }
    }
    for tp in _degrees(kernels):
        m = minfer_jax.load(gguf_model=gm, tensor_parallel=tp, **kw)
        got = run(m, sampled=kernels == "xla" and tp == 4)
        res[str(tp)] = {
            "tokens": got["tokens"],
            "logit_err": float(np.abs(got["logits"] - one["logits"]).max()),
        }
        if "sampled" in got:
            res["sampled_tp4"] = got["sampled"]
            # speculative verification (its shard_map step) with drafts right and wrong
            from minfer_bench.spec_replay import replayed

            spec = replayed(m, PROMPT, one["tokens"], draft_max=3)
            res["spec_tp4"] = [int(t) for t in spec.tokens]
    if kernels == "xla":
        tied = synthetic_model_from_config(
            dataclasses.replace(TINY, tied_output=True), "q4_k_m", seed=6
        )
        gen = lambda m: [int(t) for t in minfer_jax.generate(m, PROMPT, max_new_tokens=3).tokens]  # noqa: E731
        res["tied_one"] = gen(minfer_jax.load(gguf_model=tied, **kw))
        res["tied_tp2"] = gen(minfer_jax.load(gguf_model=tied, tensor_parallel=2, **kw))
    return res


if __name__ == "__main__":
    print(json.dumps(_moe_results() if sys.argv[1] == "moe" else _model_results(sys.argv[1])))
