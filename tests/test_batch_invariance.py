"""Batch invariance (issue 26): with load(deterministic=True) a sequence gets the same logits, bit
for bit, and so the same tokens, alone or beside any other rows.

The kernels keep each row's sums the same themselves (one GEMV configuration at every row count,
GEMV calls of 8 rows past 8, the attention's key splits fixed, split sums added in a fixed order),
and a lone row runs as two, since XLA:GPU compiles a one-row step's fusions apart;
the XLA paths run a decode batch's rows one after another (decoder.forward_decode), since XLA's
CPU dots and row reductions sum in an order that depends on the number of rows. The same tests
run through the compiled kernels on a GPU (tests/kernel_mode.py).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from kernel_mode import INTERPRET, KERNELS
from minfer_jax import ops
from minfer_jax.engine import plan
from minfer_jax.engine.plan import MIN_BUCKET
from minfer_jax.model.decoder import forward_chunk, forward_decode
from minfer_jax.pallas import decode_attention as dec
from minfer_jax.pallas import gemv_tuning
from minfer_jax.sizes import pow2_at_least
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2, context_length=1024)
PROMPTS = os.path.join(os.path.dirname(__file__), "data", "invariance_prompts.json")


@pytest.fixture(scope="module")
def tiny_gguf():
    return synthetic_model_from_config(TINY, "q4_k_m", seed=5)


def _load(gm, kernels: str, deterministic: bool = True, ctx: int = 1024, precise: bool = False):
    weights = "dense" if kernels == "xla" else "quantized"
    return minfer_jax.load(
        gguf_model=gm,
        kernels=kernels,
        weights=weights,
        ctx_size=ctx,
        deterministic=deterministic,
        precise=precise,
    )


def _prefilled_cache(m, lengths: list[int], rng):
    """One random prompt of each length prefilled into its own slot. Through the XLA path on the
    same weights: the decode steps compared below read this cache alike, whatever wrote it, and a
    kernel prefill compiles for minutes in interpret mode. One chunk size for all the prompts (one
    compile); the pad's K/V lie past each decode position."""
    cfg, impl = m.config, dataclasses.replace(m.impl, kernels="xla")
    chunk = pow2_at_least(max(lengths), MIN_BUCKET)
    prefill = jax.jit(lambda p, t, s, c: forward_chunk(p, t, s, jnp.int32(0), c, cfg, impl)[1])
    cache = m.new_cache(len(lengths) + 1, 1024)
    for slot, n in enumerate(lengths):
        tokens = np.zeros(chunk, np.int32)
        tokens[:n] = rng.integers(0, cfg.vocab_size, n)
        cache = prefill(m.params, jnp.asarray(tokens), jnp.int32(slot), cache)
    return cache


def _rows_alone_and_batched(m, lengths: list[int], row_counts: tuple[int, ...], seed: int = 0):
    """Per row count n: one decode step of the first n prefilled rows at once and of each row alone
    (each at the span the scheduler would give it): (n, batched logits [n, vocab], [alone logits
    [vocab] per row]). One cache and one jitted step for all the counts (shared compiles)."""
    cfg, impl = m.config, m.impl
    rng = np.random.default_rng(seed)
    cache = _prefilled_cache(m, lengths, rng)
    plan = m.plan(len(lengths))

    def step(params, cache, tokens, slots, positions, span):
        return forward_decode(params, tokens, slots, positions, cache, cfg, impl, span)[0]

    step = jax.jit(step, static_argnums=5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, len(lengths)), jnp.int32)
    slots = jnp.arange(len(lengths), dtype=jnp.int32)
    positions = jnp.asarray(lengths, jnp.int32)
    alone = []
    for b, n in enumerate(lengths):
        one = slice(b, b + 1)
        row = step(m.params, cache, tokens[one], slots[one], positions[one], plan.span(n + 1))
        alone.append(np.asarray(row)[0])
    for n_rows in row_counts:
        rows = slice(0, n_rows)
        span = plan.span(max(lengths[:n_rows]) + 1)
        batched = step(m.params, cache, tokens[rows], slots[rows], positions[rows], span)
        yield n_rows, np.asarray(batched), alone[:n_rows]


@pytest.mark.parametrize("kernels, precise", [("xla", False), (KERNELS, False), (KERNELS, True)])
def test_deterministic_decode_gives_each_row_its_lone_logits(tiny_gguf, kernels, precise):
    # lengths past 256 and under it: the XLA path's attention span differs alone and batched.
    # precise (two-term x in every GEMV) with deterministic: both guarantees at once
    lengths = [16, 32, 16] if INTERPRET and kernels != "xla" else [300, 10, 57, 5, 120, 33]
    m = _load(tiny_gguf, kernels, precise=precise)
    for n_rows, batched, alone in _rows_alone_and_batched(m, lengths, (2, len(lengths))):
        for b in range(n_rows):
            np.testing.assert_array_equal(batched[b], alone[b], err_msg=f"row {b} of {n_rows}")


def test_deterministic_generate_batch_equals_alone_on_the_real_model(real_model):
    """The issue's check on the CPU path: the real 0.5B, 32 prompts of natural text and code
    (5 .. 481 tokens), greedy, each alone and in one batch of 32; every fourth prompt (7 .. 275
    tokens; the 275 beside a 42 at B = 2, so the pair's spans part from the lone ones) also in
    batches of 2 and of 8. The property holds row by row: the smaller batches need not repeat all
    32 prefills (which took half the test's time). Four tokens each: the row-by-row decode reads
    the 2 GB of f32 weights once per row and step (~0.2 s here); the logits test above is the
    bitwise one."""
    with open(PROMPTS) as f:
        texts = json.load(f)["prompts"]
    m = _load(real_model, "xla", ctx=640)
    prompts = [m.encode(t) for t in texts]
    assert len(prompts) == 32 and 5 <= min(map(len, prompts)) and max(map(len, prompts)) <= 500
    alone = [minfer_jax.generate(m, p, max_new_tokens=4, decode_steps=4).tokens for p in prompts]
    every_fourth = list(range(0, len(prompts), 4))
    assert max(len(prompts[i]) for i in every_fourth) > 256  # spans part alone and batched
    for size, chosen in ((2, every_fourth), (8, every_fourth), (32, list(range(len(prompts))))):
        batched = []  # one model throughout: the deterministic mode keeps no prompt prefixes
        for i in range(0, len(chosen), size):
            group = [prompts[j] for j in chosen[i : i + size]]
            batched += [
                r.tokens
                for r in minfer_jax.generate_batch(m, group, max_new_tokens=4, decode_steps=4)
            ]
        differing = [j for j, b in zip(chosen, batched) if alone[j] != b]
        assert not differing, f"batches of {size}: prompts {differing} differ from alone"


def test_the_deterministic_gemv_config_is_one_for_every_token_count():
    shapes = [(1152, 896), (151936, 896), (896, 4864), (37888, 3584), (3584, 18944)]
    for qtype in gemv_tuning.TUNING:
        for n, k in shapes:
            configs = {
                gemv_tuning.choose_config(qtype, n, k, nt, deterministic=True)
                for nt in range(1, gemv_tuning.MAX_NT + 1)
            }
            assert len(configs) == 1, (qtype, n, k, configs)
            assert not next(iter(configs)).prequant and not next(iter(configs)).fma


def test_deterministic_routes_keep_decode_batches_on_the_one_token_gemv(tiny_gguf):
    assert ops.DETERMINISTIC_MAX_NT == plan.MAX_SEQS  # every decode batch the plan makes
    m = _load(tiny_gguf, KERNELS)
    w = m.params.layers[0].w_down
    for nt in (1, 8, 16, 64):
        r = ops.route(w, nt, m.impl)
        assert r.kind == "gemv" and r.row_chunk == ops.GEMV_MAX_NT, (nt, r)
    assert ops.route(w, 128, m.impl).kind != "gemv"  # prefill chunks past a batch: the GEMM
    default = _load(tiny_gguf, KERNELS, deterministic=False)
    assert ops.route(w, 16, default.impl).kind == "gemm"


def test_deterministic_decode_attention_does_not_depend_on_the_batch():
    rng = np.random.default_rng(1)
    k_cache = jnp.asarray(rng.standard_normal((9, 2, 512, 64)), jnp.float16)
    v_cache = jnp.asarray(rng.standard_normal((9, 2, 512, 64)), jnp.float16)
    q = jnp.asarray(rng.standard_normal((8, 1, 4, 64)), jnp.float32)
    lengths = jnp.asarray([300, 20, 500, 7, 100, 200, 64, 65], jnp.int32)
    slots = jnp.arange(8, dtype=jnp.int32)
    assert len({dec.decode_config(b, 2, deterministic=True) for b in (1, 2, 8, 64)}) == 1

    def attend(b):
        return np.asarray(
            dec.decode_attention(
                q[:b],
                k_cache,
                v_cache,
                slots[:b],
                lengths[:b],
                deterministic=True,
                interpret=INTERPRET,
            )
        )

    whole = attend(8)
    for b in (1, 2, 4):
        if INTERPRET:  # XLA:CPU's exp2 differs in a vector loop's tail: not bitwise by shape
            np.testing.assert_allclose(attend(b), whole[:b], rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(attend(b), whole[:b])


def test_load_takes_only_a_bool_for_deterministic(tiny_gguf):
    with pytest.raises(minfer_jax.InvalidArgumentError, match="deterministic"):
        minfer_jax.load(gguf_model=tiny_gguf, kernels="xla", deterministic="yes")
    with pytest.raises(minfer_jax.InvalidArgumentError, match="deterministic"):
        ops.Impl(deterministic=1)


def test_the_deterministic_mode_reuses_no_prefix(tiny_gguf):
    """A slot's kept K/V came from another chunking (or from decode steps): the mode prefills every
    prompt whole, where the default reuses the conversation so far."""
    ids = [int(t) for t in np.random.default_rng(3).integers(0, TINY.vocab_size, 40)]
    for deterministic, reused in ((False, True), (True, False)):
        m = _load(tiny_gguf, "xla", deterministic=deterministic, ctx=256)
        first = minfer_jax.generate(m, ids, max_new_tokens=4, decode_steps=4)
        again = minfer_jax.generate(m, ids + first.tokens, max_new_tokens=4, decode_steps=4)
        assert (again.cached_tokens > 0) == reused, (deterministic, again.cached_tokens)


def test_a_lone_row_decodes_as_two_identical_rows_on_the_compiled_kernels(tiny_gguf):
    """XLA:GPU compiles a one-row step's fusions apart from a many-row step's (and rounds
    differently there; docs/BENCHMARKS.md, "Batch invariance"), so the mode computes a lone row as
    one of two identical rows. Traced only: this checks the shapes the step computes at, on any
    machine; the GPU run of the tests above checks the bits."""

    m = _load(tiny_gguf, KERNELS)
    cache = m.new_cache(2, 256)
    one = jnp.zeros((1,), jnp.int32)
    for deterministic, rows in ((True, 2), (False, 1)):
        impl = dataclasses.replace(m.impl, kernels="pallas", deterministic=deterministic)
        jaxpr = jax.make_jaxpr(
            lambda p, c, t: forward_decode(p, t, t, t, c, m.config, impl)[0]  # noqa: B023
        )(m.params, cache, one)
        assert jaxpr.out_avals[0].shape == (1, TINY.vocab_size)
        head_rows = {
            v.aval.shape[0]
            for eqn in jaxpr.jaxpr.eqns
            for v in eqn.outvars
            if v.aval.shape[-1:] == (TINY.vocab_size,) and len(v.aval.shape) == 2
        }
        assert rows in head_rows and (deterministic or head_rows == {1}), (deterministic, head_rows)
