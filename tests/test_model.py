"""The Qwen2 model against the math: the float64 numpy forward of minfer_bench/float64_reference.py,
independent of the package.

The reference dequantizes with gguf.quants and implements Qwen2 from its definition (RMSNorm,
q/k/v with bias, NeoX RoPE, GQA causal attention, SwiGLU, tied or untied head). On the CPU the
package runs its dense path: weights dequantized bit-exactly, f32 storage, f32 matmuls.

Tolerance. The only differences are f32 rounding in sums of up to 4864 products through 24
layers (error ~ sqrt(K) * 2^-24 * |x||w| per dot, amplified along the residual stream). Measured:
max |delta logit| = 2.8e-5 on logits of magnitude ~10-30. We allow 1e-3 absolute (30x margin for
other CPUs' summation orders, still far below any real modelling error) and require the same
argmax at every position.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine import steps as gen
from minfer_jax.engine.sampling import GREEDY, RowSettings, SamplerMode
from minfer_jax.model.decoder import forward_decode

from minfer_bench import float64_reference

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, counting from zero."""\n'


@pytest.fixture(scope="module")
def model(real_model):
    return minfer_jax.load(gguf_model=real_model, ctx_size=256)


@pytest.fixture(scope="module")
def prompt_ids(model):
    ids = model.tokenizer.encode(PROMPT)[:16]
    assert len(ids) == 16
    return ids


@pytest.mark.real_model
def test_logits_match_float64_reference(model, real_model, prompt_ids):
    got = model.logits(prompt_ids)
    ref = float64_reference.forward(real_model, prompt_ids)
    assert got.shape == ref.shape == (16, model.config.vocab_size)
    err = np.max(np.abs(got - ref))
    print(f"max |logit - float64 logit| = {err:.2e}")
    assert err < 1e-3, err
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.real_model
def test_decode_steps_match_prefill_logits(model, prompt_ids):
    """Feeding 32 tokens one at a time through the cache (the decode path) gives one 48-token
    prefill's logits."""
    cont = model.tokenizer.encode(
        "    if n <= 1:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n"
        "        a, b = b, a + b\n    return b\n"
    )
    seq = prompt_ids + cont[:32]
    assert len(seq) == 48
    full = model.logits(seq)  # [48, vocab]

    plan = model.plan(ctx=64)
    prefill, _ = model.executable(plan.logits_key(16))
    decode = jax.jit(
        functools.partial(forward_decode, cfg=model.config, impl=model.impl, span=plan.span(48))
    )
    cache = model.new_cache(1, plan.cache_len)
    first, cache = prefill(
        model.params, cache, np.asarray(seq[:16], np.int32), np.int32(0), np.int32(0)
    )
    steps = [np.asarray(first)[-1]]
    zero = jnp.zeros((1,), jnp.int32)
    for pos in range(16, 47):
        out, cache = decode(
            model.params, jnp.asarray(seq[pos : pos + 1], jnp.int32), zero, zero + pos, cache
        )
        steps.append(np.asarray(out)[0])
    steps = np.stack(steps)  # logits predicting tokens 16..47
    np.testing.assert_allclose(steps, full[15:47], atol=2e-3, rtol=0)


@pytest.mark.real_model
def test_greedy_generation_is_deterministic_and_coherent(model):
    a = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=32)
    b = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=32)
    assert a.tokens == b.tokens and a.text == b.text
    assert len(a.tokens) == 32 and a.stop_reason == "length"
    assert "if n <= 0:" in a.text
    # The on-device loop's greedy tokens are the argmax of the teacher-forced logits.
    logits = model.logits(a.prompt_tokens + a.tokens)
    n = len(a.prompt_tokens)
    np.testing.assert_array_equal(logits[n - 1 : -1].argmax(-1), np.asarray(a.tokens))


@pytest.mark.real_model
def test_sampling_same_seed_same_tokens(model):
    kw = dict(
        max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1
    )
    a = minfer_jax.generate(model, "Once upon a time", seed=7, **kw)
    b = minfer_jax.generate(model, "Once upon a time", seed=7, **kw)
    c = minfer_jax.generate(model, "Once upon a time", seed=8, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


@pytest.mark.real_model
def test_stop_string_eos_and_context_limits(model):
    r = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=32, stop=["<="])
    assert r.stop_reason == "stop" and r.text.endswith("if n ") and "<=" not in r.text
    chat = minfer_jax.generate(model, "Say hi.", chat=True, max_new_tokens=64)
    assert chat.stop_reason == "eos" and chat.text.strip()
    small = minfer_jax.load(gguf_model=model_gguf(model), ctx_size=24)
    r = minfer_jax.generate(small, "def fibonacci(n):", max_new_tokens=100)
    assert r.stop_reason == "context" and len(r.prompt_tokens) + len(r.tokens) == 24
    with pytest.raises(minfer_jax.ContextOverflowError):
        minfer_jax.generate(small, "word " * 40, max_new_tokens=4)


def model_gguf(model):
    from minfer_jax.model.from_gguf import load_gguf

    return load_gguf(model.source)


@pytest.mark.real_model
def test_buckets_compile_once(model):
    """Prompts of different lengths in one bucket reuse one executable: no retrace, no recompile."""
    import chex

    plan = model.plan(ctx=64)
    mode = SamplerMode()
    exe, _ = model.executable(plan.prefill_key(16, mode))
    for n in (3, 9, 16):
        ((_, bucket, _),) = plan.chunks(n)
        exe_again, dt = model.executable(plan.prefill_key(bucket, mode))
        assert exe_again is exe and dt == 0.0
    # The jitted step itself traces once per static configuration.
    traced = chex.assert_max_traces(n=1)(gen.prompt_logits)
    f = jax.jit(
        lambda p, c, t, s: traced(p, c, t, jnp.int32(0), s, cfg=model.config, impl=model.impl)
    )
    for n in (1, 5):
        toks = np.zeros((16,), np.int32)
        toks[:n] = 100
        f(model.params, model.new_cache(1, 256), jnp.asarray(toks), jnp.int32(n))


@pytest.mark.real_model
def test_quantized_weights_stay_within_file_size_and_agree_with_dense(model, real_model):
    """The device layout (what the GPU runs) costs <= 1.1x the file's tensor bytes, and its
    reference path (whole-matrix decode in f16 + dot) picks the same greedy tokens as the dense
    path."""
    q = minfer_jax.load(gguf_model=real_model, weights="quantized", kernels="xla", ctx_size=64)
    file_bytes = sum(t.nbytes for t in real_model.tensors.values())
    assert q.weight_nbytes <= 1.1 * file_bytes, (q.weight_nbytes, file_bytes)
    a = minfer_jax.generate(q, "def fibonacci(n):", max_new_tokens=8)
    b = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=8)
    assert a.tokens == b.tokens


def test_step_functions_compose_inside_a_user_jit():
    """prefill_chunk and decode_chunk are pure: a caller can jit them together with its own code."""
    from minfer_bench.synthetic import synthetic_model

    gm = synthetic_model("qwen2.5-0.5b:q8_0", layers=1, seed=2)
    m = minfer_jax.load(gguf_model=gm, weights="quantized", kernels="xla", ctx_size=64)
    cfg, impl, mode = m.config, m.impl, SamplerMode()
    rows = RowSettings.of([GREEDY], [0], vocab=m.config.vocab_size)

    @jax.jit
    def prefill_then_decode(params, cache, prompt):
        state = minfer_jax.engine.steps.init_slot_state(1, 0)
        zero = jnp.int32(0)
        tok, state, cache = minfer_jax.prefill_chunk(
            params,
            cache,
            state,
            prompt,
            zero,
            zero,
            jnp.int32(prompt.shape[0]),
            jnp.zeros((0,), jnp.int32),
            rows,
            cfg=cfg,
            impl=impl,
            mode=mode,
        )
        out, state, cache = minfer_jax.decode_chunk(
            params,
            cache,
            state,
            jnp.zeros((1,), jnp.int32),
            jnp.full((1,), prompt.shape[0], jnp.int32),
            rows,
            cfg=cfg,
            impl=impl,
            mode=mode,
            n_steps=4,
        )
        return jnp.concatenate([tok[None], out[:, 0]])

    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, 16), jnp.int32)
    got = prefill_then_decode(m.params, m.new_cache(1, 256), prompt)
    want = minfer_jax.generate(m, [int(t) for t in prompt], max_new_tokens=5, decode_steps=4)
    assert got.tolist() == want.tokens
