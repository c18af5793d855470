"""Speculative decoding on the hybrid families (issue 55 item 1) and Gemma 4: a verification runs
the DeltaNet layers' rows one after another, keeps their states after each row and rolls the slot
back to the state after the last accepted token (model/speculative.py). Greedy and sampled output
equal plain decoding's whatever the drafts (right, partly right, wrong); the verification's logits
and kept states are plain decoding's bit for bit on the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from minfer_jax.model import deltanet
from minfer_jax.model.decoder import forward_decode
from minfer_jax.model.speculative import forward_rows, keep_snapshot

from minfer_bench.spec_replay import replayed
from minfer_bench.synthetic_gemma4 import gemma4_model
from minfer_bench.synthetic_qwen35 import qwen35_model

SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.1, repeat_last_n=16)


@functools.cache
def _model(name: str, deterministic: bool = False):
    source = gemma4_model(name) if name.startswith("gemma4") else qwen35_model(name)
    return minfer_jax.load(
        gguf_model=source, kernels="xla", ctx_size=256, prefill_chunk=64,
        deterministic=deterministic,
    )  # fmt: skip


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 320, n)]


@pytest.mark.parametrize("name", ["qwen35-tiny", "qwen35moe-tiny", "gemma4-tiny"])
def test_right_partly_right_and_wrong_drafts_give_plain_tokens(name):
    """Drafts replayed from the plain output with the last, the first or no token spoiled: each
    rejection rolls the recurrent state back (a wrong state changes every later token). Gemma 4's
    prompt runs past its 32-token sliding window."""
    model = _model(name)
    prompt = _ids(40, 3)
    plain = minfer_jax.generate(model, prompt, max_new_tokens=24)
    spec = replayed(model, prompt, plain.tokens, draft_max=3)
    s = spec.speculation
    assert s.verify_steps >= 6 and 0 < s.accepted < s.drafted
    assert spec.tokens == plain.tokens
    lookup = minfer_jax.generate(
        model, prompt, max_new_tokens=24, speculative="lookup", draft_max=3
    )  # the buckets replay compiled
    assert lookup.tokens == plain.tokens and lookup.speculation is not None


def test_sampled_and_deterministic_mode_give_plain_tokens():
    """Sampled (same seed, the repeat penalty's window grown by accepted drafts), and the
    deterministic mode's one-row-at-a-time path (model/speculative.py's own scan)."""
    model = _model("qwen35-tiny")
    prompt = _ids(20, 5)
    plain = minfer_jax.generate(model, prompt, max_new_tokens=16, seed=2, **SAMPLED)
    spec = replayed(
        model, prompt, plain.tokens, draft_max=3, sampler=minfer_jax.Sampler(**SAMPLED), seed=2
    )
    assert spec.speculation.drafted > spec.speculation.accepted > 0
    assert spec.tokens == plain.tokens
    exact = _model("qwen35-tiny", deterministic=True)
    plain = minfer_jax.generate(exact, prompt, max_new_tokens=12)
    spec = replayed(exact, prompt, plain.tokens, draft_max=3)
    assert spec.speculation.drafted > spec.speculation.accepted > 0
    assert spec.tokens == plain.tokens


def test_verification_rows_are_plain_decode_steps_bit_for_bit():
    """In the deterministic mode (the CPU's batch-invariant path) forward_rows' logits and the
    states kept after row i are what i + 1 plain decode steps give, bit for bit; on the default
    path the batched projections may round apart, but the recurrence over given projections
    (deltanet.mix_rows) is still the decode step's bit for bit. keep_snapshot puts the chosen
    state in the slot."""
    model = _model("qwen35-tiny", deterministic=True)
    cfg, impl, params = model.config, model.impl, model.params
    tokens = jnp.asarray(_ids(4, 9), jnp.int32)
    one = jnp.zeros((1,), jnp.int32)
    cache = model.new_cache(1, 64)
    cache = jax.tree.map(lambda a: a + 0.01 if a.dtype == jnp.float32 else a, cache)  # not zero

    rows = jax.jit(lambda c: forward_rows(params, tokens, jnp.int32(0), jnp.int32(5), c, cfg, impl))
    logits, _, after_rows, snaps = rows(cache)
    assert all(bool(jnp.all(a == b)) for a, b in zip(after_rows.delta, cache.delta))  # untouched

    def plain_step(c, row):  # plain decoding's steps run in a loop too (steps.decode_chunk)
        token, position = row
        out, c = forward_decode(params, token[None], one, position[None], c, cfg, impl)
        return c, (out[0], tuple(a[0] for a in c.conv + c.delta))

    positions = 5 + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, (plain_logits, plain_states) = jax.jit(
        lambda c: jax.lax.scan(plain_step, c, (tokens, positions))
    )(cache)
    np.testing.assert_array_equal(np.asarray(plain_logits), np.asarray(logits))
    for kept, state in zip(snaps.conv + snaps.delta, plain_states):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(state))
    rolled = keep_snapshot(after_rows, snaps, 0, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(rolled.delta[0][0]), np.asarray(snaps.delta[0][1]))

    mixer = params.layers[0].mixer
    width = _proj_width(cfg)
    proj = jax.random.normal(jax.random.PRNGKey(0), (5, width), jnp.float32)
    conv0, state0 = cache.conv[0][0], cache.delta[0][0]
    out, convs, states = jax.jit(lambda p: deltanet.mix_rows(p, mixer, conv0, state0, cfg))(proj)
    conv, state = conv0[None], state0[None]
    for i in range(proj.shape[0]):
        o, conv, state = jax.jit(lambda p, c, s: deltanet.mix_step(p, mixer, c, s, cfg))(
            proj[i : i + 1], conv, state
        )
        np.testing.assert_array_equal(np.asarray(o[0]), np.asarray(out[i]))
        np.testing.assert_array_equal(np.asarray(state[0]), np.asarray(states[i]))
        np.testing.assert_array_equal(np.asarray(conv[0]), np.asarray(convs[i]))
    unrolled = jax.jit(lambda p: deltanet.mix_rows(p, mixer, conv0, state0, cfg, unroll=True))
    for got, want in zip(unrolled(proj), (out, convs, states)):  # the GPU's form: same math
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _proj_width(cfg) -> int:
    """The DeltaNet projections' concatenated width: conv input, z, beta, alpha."""
    return cfg.ssm_conv_dim + cfg.ssm_v_heads * cfg.ssm_state + 2 * cfg.ssm_v_heads
