"""Gated DeltaNet (model/deltanet.py) and the chunked delta-rule kernel (pallas/delta_rule.py)
against the plain per-token recurrence: kernel (interpreted on the CPU, compiled with
MINFER_TEST_KERNELS=compiled), its jnp reference, state carried across calls, padding, and the
whole layer's prefill against its decode step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax import ops
from minfer_jax.model import deltanet
from minfer_jax.pallas import delta_rule
from tests.configs import tiny_config
from tests.kernel_mode import INTERPRET, KERNELS

# interpreted: summation order only; compiled: IEEE f32 dots, other association
ATOL = 2e-5 if INTERPRET else 2e-4


def _inputs(seed, t_len, n_k, n_v, dk, dv, strong_decay=False):
    r = np.random.default_rng(seed)

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = l2(r.standard_normal((t_len, n_k, dk))) * dk**-0.5
    k = l2(r.standard_normal((t_len, n_k, dk)))
    v = r.standard_normal((t_len, n_v, dv))
    scale = 4.0 if strong_decay else 0.3
    g = -np.abs(r.standard_normal((t_len, n_v))) * scale
    beta = 1 / (1 + np.exp(-2 * r.standard_normal((t_len, n_v))))
    state = r.standard_normal((n_v, dk, dv)) * 0.2
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize(
    "t_len,n_k,n_v,strong",
    [(150, 2, 4, False), (70, 1, 3, True)],  # v heads 2x and 3x; 150 crosses two chunk edges
)
def test_chunk_kernel_matches_recurrence(t_len, n_k, n_v, strong):
    args = _inputs(0, t_len, n_k, n_v, 16, 32, strong)
    want_o, want_s = delta_rule.delta_rule_recurrent(*args)
    for got_o, got_s in (
        delta_rule.chunk_delta_rule(*args, interpret=INTERPRET, block_v=16),
        delta_rule.chunk_delta_rule_reference(*args),
        delta_rule.chunk_delta_rule_xla(*args),
    ):
        np.testing.assert_allclose(got_o, want_o, atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose(got_s, want_s, atol=ATOL, rtol=1e-4)


def test_xla_path_holds_no_lapack_call():
    """The model's CPU path is stored as a serialized executable (engine/executables.py): a LAPACK
    custom call in it crashed a later process that loaded it before registering LAPACK."""
    args = _inputs(0, 70, 1, 2, 16, 16)
    text = delta_rule.chunk_delta_rule_xla.lower(*args).as_text()
    assert "lapack" not in text.lower() and "custom_call" not in text


def test_nearly_equal_keys_stay_stable():
    """Repeated keys with beta ~ 1 and no decay make (I + L)'s inverse a difference operator whose
    Neumann terms are ~1e18 and cancel: the solve must stay at the recurrence's values."""
    q, k, v, g, beta, s0 = _inputs(7, 128, 1, 1, 16, 16)
    k = jnp.broadcast_to(k[:1], k.shape) + 0.01 * q  # nearly one key, unit norm after the L2
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g, beta = jnp.zeros_like(g), jnp.full_like(beta, 0.99)
    want_o, want_s = delta_rule.delta_rule_recurrent(q, k, v, g, beta, s0)
    for got_o, got_s in (
        delta_rule.chunk_delta_rule(q, k, v, g, beta, s0, interpret=INTERPRET, block_v=16),
        delta_rule.chunk_delta_rule_reference(q, k, v, g, beta, s0),
    ):
        np.testing.assert_allclose(got_o, want_o, atol=1e-3, rtol=1e-3)
        np.testing.assert_allclose(got_s, want_s, atol=1e-3, rtol=1e-3)


def test_state_carries_across_calls():
    q, k, v, g, beta, s0 = _inputs(1, 80, 2, 4, 16, 16)
    want_o, want_s = delta_rule.chunk_delta_rule_reference(q, k, v, g, beta, s0)
    cut = 37  # not a chunk edge
    head, tail = (x[:cut] for x in (q, k, v, g, beta)), (x[cut:] for x in (q, k, v, g, beta))
    o1, s1 = delta_rule.chunk_delta_rule_reference(*head, s0)
    o2, s2 = delta_rule.chunk_delta_rule_reference(*tail, s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2]), want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s2, want_s, atol=2e-5, rtol=1e-4)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, s0 = _inputs(2, 8, 2, 3, 16, 16)  # 3 v heads over 2 q/k heads
    with pytest.raises(delta_rule.DeltaRuleShapeError):
        delta_rule.chunk_delta_rule_reference(q, k, v, g, beta, s0)


def _layer(cfg, seed):
    r = np.random.default_rng(seed)
    n_v = cfg.ssm_v_heads
    w = deltanet.DeltaNet(
        proj=(),
        dt_bias=jnp.asarray(r.standard_normal(n_v), jnp.float32),
        a=-jnp.exp(jnp.asarray(r.standard_normal(n_v), jnp.float32)),
        conv=jnp.asarray(r.standard_normal((cfg.ssm_conv_dim, cfg.ssm_conv_kernel)) * 0.5),
        norm=jnp.asarray(1 + 0.1 * r.standard_normal(cfg.ssm_state), jnp.float32),
        out=None,
    )
    width = cfg.ssm_conv_dim + n_v * cfg.ssm_state + 2 * n_v
    return w, width


HYBRID = dict(
    recurrent_layers=(True, True, False),
    ssm_conv_kernel=4,
    ssm_state=16,
    ssm_groups=2,
    ssm_v_heads=4,
)


def test_layer_prefill_matches_decode_steps_and_padding():
    """mix_chunk over a padded chunk = mix_step token by token (output, conv and delta states)."""
    cfg = tiny_config(**HYBRID)
    w, width = _layer(cfg, 3)
    t_len, n_valid = 24, 19
    proj = jnp.asarray(np.random.default_rng(4).standard_normal((t_len, width)), jnp.float32)
    conv0 = jnp.asarray(np.random.default_rng(5).standard_normal((3, cfg.ssm_conv_dim)) * 0.3)
    state0 = jnp.zeros((cfg.ssm_v_heads, 16, 16), jnp.float32)
    impl = ops.Impl(kernels=KERNELS)
    out, conv1, state1 = deltanet.mix_chunk(proj, w, conv0, state0, n_valid, cfg, impl)
    conv, state, rows = conv0[None], state0[None], []
    step = jax.jit(deltanet.mix_step, static_argnums=4)
    for t in range(n_valid):
        o, conv, state = step(proj[t : t + 1], w, conv, state, cfg)
        rows.append(o[0])
    np.testing.assert_allclose(out[:n_valid], jnp.stack(rows), atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(conv1, conv[0], atol=1e-6)
    np.testing.assert_allclose(state1, state[0], atol=ATOL, rtol=1e-4)


def test_conv_chunk_is_causal_with_history():
    """out[t] = sum_j in[t - K + 1 + j] w[:, j] with the carried history before t = 0."""
    r = np.random.default_rng(6)
    x, hist, w = r.standard_normal((5, 3)), r.standard_normal((2, 3)), r.standard_normal((3, 3))
    y, state = deltanet.conv_chunk(jnp.asarray(x), jnp.asarray(hist), jnp.asarray(w), 4)
    full = np.concatenate([hist, x])
    want = np.stack([sum(full[t + j] * w[:, j] for j in range(3)) for t in range(5)])
    np.testing.assert_allclose(y, jax.nn.silu(want), atol=1e-5)
    np.testing.assert_allclose(state, full[4:6], atol=0)
