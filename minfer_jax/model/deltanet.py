"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / 3.6 (`qwen35`), as pure functions.

From h = rms(x) . attn_norm (llama.cpp models/qwen35.cpp, /HYBRID_NOTES facts):
    [q | k | v] = attn_qkv . h   (Hk dk | Hk dk | Hv dv channels), z = attn_gate . h,
    beta = sigmoid(ssm_beta . h), g = softplus(ssm_alpha . h + ssm_dt.bias) * ssm_a (ssm_a < 0),
    causal depthwise conv over the [q | k | v] channels (kernel K, no bias; the last K - 1 inputs
    carried as the conv state), SiLU, q and k L2-normed per head (q scaled by dk^-0.5),
    the gated delta rule (pallas/delta_rule.py; value head h reads q / k head h mod Hk),
    o = rms(o) . ssm_norm * silu(z) per head, out = ssm_out . o.
A sequence's conv state [K - 1, channels] and delta state [Hv, dk, dv] are f32 and carried between
a prompt's chunks and decode steps; a chunk's padded tokens (past n_valid) leave both unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model.config import Config
from minfer_jax.model.weights import DeltaNet
from minfer_jax.pallas import delta_rule


def split_projection(proj: jax.Array, cfg: Config):
    """The four projections' concatenated outputs [T, ...] -> (conv input [T, conv_dim], z [T, Hv,
    dv], beta [T, Hv] pre-sigmoid, alpha [T, Hv])."""
    conv_dim, n_v, dv = cfg.ssm_conv_dim, cfg.ssm_v_heads, cfg.ssm_state
    z_end = conv_dim + n_v * dv
    z = proj[:, conv_dim:z_end].reshape(proj.shape[0], n_v, dv)
    return proj[:, :conv_dim], z, proj[:, z_end : z_end + n_v], proj[:, z_end + n_v :]


def gates(beta_in: jax.Array, alpha: jax.Array, w: DeltaNet) -> tuple[jax.Array, jax.Array]:
    """(beta = sigmoid(beta_in), the log decay g = softplus(alpha + dt_bias) * a), f32 [T, Hv]."""
    g = jax.nn.softplus(alpha.astype(jnp.float32) + w.dt_bias) * w.a
    return jax.nn.sigmoid(beta_in.astype(jnp.float32)), g


def conv_chunk(x: jax.Array, conv_state: jax.Array, w: jax.Array, n_valid) -> tuple:
    """Causal depthwise conv of one sequence's chunk: x [T, C] after the inputs in conv_state
    [K - 1, C], weights w [C, K] -> (SiLU(out) [T, C], the state after the first n_valid rows)."""
    k = w.shape[1]
    full = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)])
    t_len = x.shape[0]
    out = sum(full[j : j + t_len] * w[:, j] for j in range(k))
    state = jax.lax.dynamic_slice_in_dim(full, n_valid, k - 1, axis=0)
    return jax.nn.silu(out), state


def conv_step(x: jax.Array, conv_state: jax.Array, w: jax.Array) -> tuple:
    """One token per row: x [B, C], conv_state [B, K - 1, C] -> (SiLU(out) [B, C], state)."""
    full = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)[:, None]], 1)
    out = jnp.einsum("bkc,ck->bc", full, w, precision=jax.lax.Precision.HIGHEST)
    return jax.nn.silu(out), full[:, 1:]


def split_heads(y: jax.Array, cfg: Config, eps: float):
    """The conv's output [T, conv_dim] -> q (L2-normed, times dk^-0.5), k (L2-normed) [T, Hk, dk],
    v [T, Hv, dv]. llama.cpp's L2 norm: x / sqrt(sum x^2 + eps), eps = the RMSNorm's."""
    t, n_k, n_v, s = y.shape[0], cfg.ssm_groups, cfg.ssm_v_heads, cfg.ssm_state
    q = y[:, : n_k * s].reshape(t, n_k, s)
    k = y[:, n_k * s : 2 * n_k * s].reshape(t, n_k, s)
    v = y[:, 2 * n_k * s :].reshape(t, n_v, s)

    def l2(a):
        return a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + eps)

    return l2(q) * s**-0.5, l2(k), v


def gated_norm(o: jax.Array, z: jax.Array, w: DeltaNet, eps: float) -> jax.Array:
    """rms(o) . ssm_norm * silu(z) per head: o, z [T, Hv, dv] -> [T, Hv dv]."""
    y = ops.rms_norm(o, w.norm, eps) * jax.nn.silu(z.astype(jnp.float32))
    return y.reshape(o.shape[0], -1)


def mix_chunk(proj, w: DeltaNet, conv_state, state, n_valid, cfg: Config, impl: ops.Impl):
    """One sequence's chunk: the projections' outputs [T, ...] (split_projection) with the
    sequence's conv state and delta state -> (the gated output [T, Hv dv], conv_state, state);
    tokens from n_valid on are padding (beta = g = 0: the state passes them unchanged)."""
    x, z, beta_in, alpha = split_projection(proj, cfg)
    beta, g = gates(beta_in, alpha, w)
    valid = (jnp.arange(proj.shape[0]) < n_valid)[:, None]
    beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)
    y, conv_state = conv_chunk(x, conv_state, w.conv, n_valid)
    q, k, v = split_heads(y, cfg, cfg.rms_eps)
    if impl.kernels == "xla":
        o, state = delta_rule.chunk_delta_rule_xla(q, k, v, g, beta, state)
    else:
        interpret = impl.kernels == "interpret"
        o, state = delta_rule.chunk_delta_rule(q, k, v, g, beta, state, interpret=interpret)
    return gated_norm(o, z, w, cfg.rms_eps), conv_state, state


def mix_step(proj, w: DeltaNet, conv_state, state, cfg: Config):
    """One token per row: proj [B, ...], conv_state [B, K - 1, conv_dim], state [B, Hv, dk, dv]
    -> (the gated output [B, Hv dv], conv_state, state)."""
    x, z, beta_in, alpha = split_projection(proj, cfg)
    beta, g = gates(beta_in, alpha, w)
    y, conv_state = conv_step(x, conv_state, w.conv)
    q, k, v = split_heads(y, cfg, cfg.rms_eps)
    o, state = delta_rule.delta_rule_step(q, k, v, g, beta, state)
    return gated_norm(o, z, w, cfg.rms_eps), conv_state, state


def mix_rows(proj, w: DeltaNet, conv_state, state, cfg: Config, unroll: bool = False):
    """T consecutive tokens of one sequence, each run as mix_step runs a decode row (so the bits
    are plain decoding's): proj [T, ...], conv_state [K - 1, conv_dim], state [Hv, dk, dv] ->
    (the gated output [T, Hv dv], conv states [T, K - 1, conv_dim], states [T, Hv, dk, dv]): the
    states after each token, of which speculative verification keeps the last accepted one.
    unroll: the rows as straight-line code (a GPU loop iteration costs ~8 us, more than a row's
    step), else a loop (the CPU's bits are then the decode step's)."""

    def step(carry, row):
        conv, s = carry
        out, conv, s = mix_step(row[None], w, conv, s, cfg)
        return (conv, s), (out[0], conv[0], s[0])

    carry = (conv_state[None], state[None])
    _, (out, convs, states) = jax.lax.scan(step, carry, proj, unroll=unroll)
    return out, convs, states
