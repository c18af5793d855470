"""The whole model through the Pallas kernels (interpreted, or compiled: tests/kernel_mode.py)
against the XLA reference path, on a tiny random-weight model: prefill through the split GEMM,
decode through the GEMV with the RMSNorm folded into it (and not) and, for a 16-row batch,
through the split GEMM; layer 1 has a Q6_K v
beside Q4_K q and k, so its q/k/v run as two fused matmuls ([q; k] and v)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from kernel_mode import KERNELS
from minfer_jax import ops
from minfer_jax.model.cache import KVCache, cache_shape
from minfer_jax.model.decoder import forward_decode
from minfer_jax.model.weights import LoadOptions, fused_runs, load_params
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2)


@pytest.fixture(scope="module")
def tiny_gguf():
    return synthetic_model_from_config(TINY, "q4_k_m", seed=5)


@pytest.fixture(scope="module")
def tiny_models(tiny_gguf):
    def load(k):
        return minfer_jax.load(gguf_model=tiny_gguf, kernels=k, weights="quantized", ctx_size=64)

    return load(KERNELS), load("xla")


@pytest.mark.parametrize("fused", [True, False])
def test_kernel_path_matches_reference_path(tiny_models, fused):
    kern, ref = tiny_models
    kern = dataclasses.replace(
        kern, impl=dataclasses.replace(kern.impl, fused_decode=fused), _compiled={}
    )
    layer = kern.params.layers[0]
    for w in (*layer.qkv, *layer.gate_up):  # one decode row takes the folded norm, or not
        assert bool(ops.route(w, 1, kern.impl, after_norm=True).fold_norm) == fused
    prompt = [5, 17, 250, 3, 99]
    got = list(minfer_jax.generate(kern, prompt, max_new_tokens=4).tokens)
    want = list(minfer_jax.generate(ref, prompt, max_new_tokens=4).tokens)
    assert got == want
    seq = prompt + want[:3]  # the last position's logits come from the decode-sized (GEMV) path too
    lk, lr = np.asarray(kern.logits(seq)), np.asarray(ref.logits(seq))
    np.testing.assert_allclose(lk, lr, atol=2e-2 * float(np.max(np.abs(lr))))


def test_batched_decode_through_the_kernels_matches_each_sequence_alone(tiny_models):
    """10 sequences decode as one 16-row batch (the split few-token GEMM, not the GEMV) and each
    gets the greedy tokens the XLA reference path gives it alone."""
    kern, ref = tiny_models
    prompts = [[(7 * i + 3 * j) % TINY.vocab_size for j in range(3 + i)] for i in range(10)]
    batch = minfer_jax.generate_batch(kern, prompts, max_new_tokens=5, decode_steps=4)
    assert any(
        getattr(key, "rows", 0) == 16 for key in kern._compiled
    )  # one 16-row decode executable
    assert ops.route(kern.params.layers[0].w_down, 16, kern.impl).kind == "gemm"
    alone = [minfer_jax.generate(ref, p, max_new_tokens=5).tokens for p in prompts]
    # Random weights make near-ties: a row may leave the reference only where the reference's own
    # top two logits are within rounding (f16 activations vs f32; XLA:CPU's FMA contraction varies
    # by machine), never at a clear choice, and most rows must match exactly.
    same = 0
    for p, got, want in zip(prompts, (r.tokens for r in batch), alone):
        if got == want:
            same += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = np.sort(ref.logits(p + want[:i])[-1])[-2:]
        assert top2[1] - top2[0] < 2e-3 * max(1.0, abs(float(top2[1]))), (p, got, want, top2)
    assert same >= len(prompts) - 2


def test_neighbours_of_one_format_are_fused(tiny_models, tiny_gguf):
    assert fused_runs(["Q4_K", "Q4_K", "Q6_K"]) == [[0, 1], [2]]
    assert fused_runs(["Q6_K", "Q4_K", "Q4_K"]) == [[0], [1, 2]]
    assert fused_runs(["Q4_K", "Q6_K", "Q4_K"]) == [
        [0],
        [1],
        [2],
    ]  # only neighbours: outputs stay in order
    assert fused_runs(["Q4_K", "Q6_K"], dense=True) == [[0, 1]]
    assert fused_runs(["Q4_K", "Q4_K"], fuse=False) == [[0], [1]]
    kern, _ = tiny_models
    d, kv = TINY.d_model, TINY.kv_dim
    assert [w.shape[0] for w in kern.params.layers[0].qkv] == [d + 2 * kv]
    assert [w.shape[0] for w in kern.params.layers[1].qkv] == [d + kv, kv]
    assert [w.shape[0] for w in kern.params.layers[1].gate_up] == [2 * TINY.d_ff]
    # the same model with every projection apart: the same logits (fusion only stacks rows)
    _, ref = tiny_models
    apart = dataclasses.replace(
        ref, params=load_params(tiny_gguf, LoadOptions(fuse=False)), _compiled={}
    )
    assert len(apart.params.layers[1].qkv) == 3
    seq = [5, 17, 250, 3, 99]
    np.testing.assert_allclose(
        np.asarray(apart.logits(seq)), np.asarray(ref.logits(seq)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_matches_the_xla_epilogue(tiny_models, rows):
    """impl.fused_decode (q / k / v partial sums, biases, RoPE and cache writes in one kernel; the
    attention's split merge in another) gives the cache of the XLA ops it replaces and their
    logits up to the merge's rounding (which the next layer's int8 activations can turn into one
    quantization step)."""
    kern = tiny_models[0]
    n_slots, max_len = 4, 64
    shape = cache_shape(TINY, n_slots, max_len)
    rng = np.random.default_rng(rows)
    cache = KVCache(
        k=tuple(jnp.asarray(rng.normal(size=shape), jnp.float16) for _ in range(TINY.n_layers)),
        v=tuple(jnp.asarray(rng.normal(size=shape), jnp.float16) for _ in range(TINY.n_layers)),
    )
    tokens = jnp.asarray([7, 300, 41][:rows], jnp.int32)
    slots = jnp.asarray([2, 0, 3][:rows], jnp.int32)
    positions = jnp.asarray([9, 0, 40][:rows], jnp.int32)
    out = {}
    for fused in (True, False):
        impl = dataclasses.replace(kern.impl, fused_decode=fused)
        out[fused] = jax.jit(functools.partial(forward_decode, cfg=TINY, impl=impl))(
            kern.params, tokens, slots, positions, cache
        )
    (lf, cf), (lx, cx) = out[True], out[False]
    np.testing.assert_allclose(np.asarray(lf), np.asarray(lx), atol=2e-2 * float(jnp.max(abs(lx))))
    for a, b in zip(jax.tree.leaves(cf), jax.tree.leaves(cx)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-3)


@pytest.mark.parametrize("rows", [1, 3])
def test_precise_decode_comes_far_closer_to_the_f32_model(tiny_models, tiny_gguf, rows):
    """impl.precise: every integer GEMV of a decode step (normed q/k/v, gate/up and head, plain o
    and down; one row and a 3-row batch) takes x in two int8 terms, and the step's logits land
    many times closer to those of the f32 model (dense dequantized weights, XLA) than with one
    term."""
    kern = tiny_models[0]
    ref = minfer_jax.load(gguf_model=tiny_gguf, kernels="xla", weights="dense", ctx_size=64)
    precise = dataclasses.replace(kern.impl, precise=True)
    layer = kern.params.layers[0]
    for w in (*layer.qkv, *layer.gate_up, kern.params.head):
        assert ops.route(w, rows, precise, after_norm=True).label.endswith("/precise")
    for w in (layer.wo, layer.w_down):
        assert ops.route(w, rows, precise).precise
    shape = cache_shape(TINY, 4, 64)
    rng = np.random.default_rng(rows)
    cache = KVCache(
        k=tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(TINY.n_layers)),
        v=tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(TINY.n_layers)),
    )
    args = (
        jnp.asarray([7, 299, 41][:rows], jnp.int32),
        jnp.asarray([2, 0, 3][:rows], jnp.int32),
        jnp.asarray([9, 0, 40][:rows], jnp.int32),
        cache,
    )

    def step(model, impl):
        fn = jax.jit(functools.partial(forward_decode, cfg=TINY, impl=impl))
        return np.asarray(fn(model.params, *args)[0])

    want = step(ref, ref.impl)
    one, two = (np.max(np.abs(step(kern, impl) - want)) for impl in (kern.impl, precise))
    assert two < one / 20, (one, two)  # measured: about 200x


def test_load_takes_only_a_bool_for_precise(tiny_gguf):
    with pytest.raises(minfer_jax.InvalidArgumentError, match="precise"):
        minfer_jax.load(gguf_model=tiny_gguf, kernels="xla", precise="yes")
    with pytest.raises(minfer_jax.InvalidArgumentError, match="precise"):
        ops.Impl(precise=1)
