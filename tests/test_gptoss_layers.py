"""gpt-oss's layer pieces beside ggml's own arithmetic: YaRN RoPE (ggml_rope_cache_init's loop
transcribed in float32 numpy), the even-layer sliding window, the attention output bias."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax.model import layers
from minfer_jax.model.config import Config


def ggml_rope_neox_yarn(x, positions, base, factor, orig_ctx, beta_fast=32.0, beta_slow=1.0):
    """ggml-cpu's rope (NEOX, ext_factor 1, attn_factor 1, freq_scale 1 / factor), float32."""
    x = np.asarray(x, np.float32)
    n_dims = x.shape[-1]

    def corr_dim(beta):
        return n_dims * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(corr_dim(beta_fast)))
    hi = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
    freq_scale = np.float32(1.0 / factor)
    theta_scale = np.float32(base ** (-2.0 / n_dims))
    out = np.empty_like(x)
    for t, p in enumerate(positions):
        theta = np.float32(p)
        for i0 in range(0, n_dims, 2):
            y = (i0 // 2 - lo) / max(0.001, hi - lo)
            ramp = 1 - min(1.0, max(0.0, y))
            interp = freq_scale * theta
            th = interp * (1 - ramp) + theta * ramp
            mscale = np.float32(1.0 + 0.1 * math.log(1.0 / freq_scale))
            c, s = np.float32(math.cos(th)) * mscale, np.float32(math.sin(th)) * mscale
            i = i0 // 2
            x0, x1 = x[t, :, i], x[t, :, i + n_dims // 2]
            out[t, :, i] = x0 * c - x1 * s
            out[t, :, i + n_dims // 2] = x0 * s + x1 * c
            theta = np.float32(theta * theta_scale)
    return out


@pytest.mark.parametrize("base,factor,orig_ctx", [(150000.0, 32.0, 4096), (10000.0, 4.0, 2048)])
def test_yarn_rope_matches_ggml(base, factor, orig_ctx):
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 7, 100, 3000, 20000])
    x = rng.normal(size=(len(positions), 3, 64)).astype(np.float32)
    got = layers.rope_neox(jnp.asarray(x), jnp.asarray(positions), base, yarn=(factor, orig_ctx))
    want = ggml_rope_neox_yarn(x, positions, base, factor, orig_ctx)
    # both round the angle in float32 (ggml by a running product): an error ~ position x 2^-23
    for t, p in enumerate(positions):
        np.testing.assert_allclose(np.asarray(got[t]), want[t], atol=1e-6 + 2e-7 * p, rtol=0)
    plain = layers.rope_neox(jnp.asarray(x), jnp.asarray(positions), base)
    assert float(jnp.max(jnp.abs(plain - got))) > 0.1  # YaRN changed something


def test_yarn_corr_dims_of_gpt_oss():
    """gpt-oss-20b: head_dim 64, base 150000, original context 4096 -> ramp over pairs 8 .. 18
    (floor(8.09), ceil(17.39))."""
    assert layers.yarn_corr_dims(64, 150000.0, 4096) == (8.0, 18.0)


def test_even_layers_slide_with_period_two():
    """gpt-oss: llama.cpp's set_swa_pattern(2): layer il is sliding-window iff il % 2 == 0."""
    cfg = Config(
        n_layers=4,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        context_length=256,
        vocab_size=32,
        rope_theta=150000.0,
        rms_eps=1e-5,
        tied_output=False,
        sliding_window=128,
        swa_period=2,
        rope_theta_local=10000.0,
    )
    assert [cfg.window(i) for i in range(4)] == [128, 0, 128, 0]
    assert [cfg.layer_rope_theta(i) for i in range(4)] == [10000.0, 150000.0] * 2
