"""The gated delta rule (Gated DeltaNet's recurrence) over a prefill chunk: a chunked Pallas kernel.

Per value head h (its q / k head h mod Hk, llama.cpp's tiling), with the state S [dk, dv] in f32:
    S <- exp(g_t) S;  d_t = beta_t (v_t - S^T k_t);  S <- S + k_t d_t^T;  o_t = S^T q_t
(q already scaled by dk^-0.5). The chunked form (llama.cpp's delta-net-base.cpp, fla's chunk_gated
_delta_rule) runs C = 64 tokens at a time with matmuls: with G the within-chunk cumulative sum of
g, D[t, s] = exp(G_t - G_s) (s <= t) and L[t, s] = beta_t D[t, s] k_t.k_s (s < t),
    U = (I + L)^-1 (beta V - beta exp(G) K S0)            (the chunk's new values d_t)
    O = exp(G) Q S0 + (D o Q K^T) U
    S1 = exp(G_C) S0 + (exp(G_C - G) K)^T U.
(I + L)^-1 is applied by forward substitution (64 masked row steps; the reference calls jax's
triangular solve). Value columns of the state
are independent, so the grid is (value heads, value blocks); each program walks the chunks in
order carrying its [dk, block_v] slice of the state. Padded tokens (beta = 0, g = 0) leave the
state as it is, which is how a prefill chunk's padding and a partial last chunk stay harmless.
`chunk_delta_rule_reference` is the same chunked math in jnp; `delta_rule_recurrent` the plain
per-token recurrence (the definition, and the decode step's math) both are tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.errors import MinferError
from minfer_jax.pallas import tiles
from minfer_jax.sizes import round_up

CHUNK = 64  # tokens per chunk: llama.cpp's and fla's
HIGHEST = lax.Precision.HIGHEST  # f32 products (IEEE on the GPU): the state must stay f32
BLOCK_V = 64  # value columns of the state per program
NUM_WARPS = 4
NUM_STAGES = 1


class DeltaRuleShapeError(MinferError):
    """Arrays handed to the delta-rule kernel do not have the shapes it supports."""


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def forward_substitute(lower, rhs):
    """(I + lower)^-1 rhs for a strictly lower triangular lower [C, C], rhs [C, n]: row by row
    (masked row extracts, Triton-friendly). Stable where L's powers are huge and cancel (nearly
    equal keys with beta ~ 1 and little decay): a Neumann product gave 1e20 there."""
    c = lower.shape[0]
    row_of_lower = lax.broadcasted_iota(jnp.int32, lower.shape, 0)
    row_of_u = lax.broadcasted_iota(jnp.int32, rhs.shape, 0)

    def step(i, u):  # rows < i of u are solved; row i still holds rhs_i; L[i, j >= i] = 0
        l_i = jnp.sum(jnp.where(row_of_lower == i, lower, 0.0), axis=0)  # [C]
        r_i = jnp.sum(jnp.where(row_of_u == i, u, 0.0), axis=0)  # [n]
        u_i = r_i - jnp.sum(l_i[:, None] * u, axis=0)
        return jnp.where(row_of_u == i, u_i[None, :], u)

    return lax.fori_loop(1, c, step, rhs)


def _solve_reference(lower, rhs):
    """forward_substitute through jax's triangular solve (the reference's, an independent one)."""
    eye = jnp.eye(lower.shape[0], dtype=lower.dtype)
    return jax.scipy.linalg.solve_triangular(eye + lower, rhs, lower=True, unit_diagonal=True)


def _chunk_step(q, k, v, gcum, beta, s0, solve=forward_substitute):
    """One chunk: q, k [C, dk], v [C, bv], gcum (within-chunk cumulative g), beta [C], state s0
    [dk, bv] -> (o [C, bv], s1). Shared by the kernel and the reference (plain jnp ops; solve:
    the unit lower triangular solve)."""
    c = q.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    # exp of a masked exponent, never exp(+large) * 0 (the upper triangle would overflow)
    decay = jnp.exp(jnp.where(col <= row, gcum[:, None] - gcum[None, :], -jnp.inf))
    lower = jnp.where(col < row, beta[:, None] * decay * _dot(k, k, trans_b=True), 0.0)
    g_all = jnp.exp(gcum)
    rhs = beta[:, None] * v - (beta * g_all)[:, None] * _dot(k, s0)
    u = solve(lower, rhs)  # [C, bv]: the chunk's new values
    o = g_all[:, None] * _dot(q, s0) + _dot(decay * _dot(q, k, trans_b=True), u)
    g_end = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1, gcum, 0.0))
    s1 = jnp.exp(g_end) * s0 + _dot(jnp.exp(g_end - gcum)[:, None] * k, u, trans_a=True)
    return o, s1


@functools.cache
def _kernel(n_chunks: int):
    def kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref):
        def step(c, state):
            t = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
            o, state = _chunk_step(q_ref[t, :], k_ref[t, :], v_ref[t, :], g_ref[t], b_ref[t], state)
            o_ref[t, :] = o
            return state

        s_out_ref[...] = lax.fori_loop(0, n_chunks, step, s_ref[...])

    return kernel


def _prepare(q, k, v, g, beta):
    """Head-major f32 operands padded to whole chunks: q, k [Hk, Tp, dk], v [Hv, Tp, dv], the
    within-chunk cumulative g and beta [Hv, Tp]."""
    t_len = q.shape[0]
    pad = round_up(max(t_len, 1), CHUNK) - t_len

    def head_major(x):
        x = jnp.swapaxes(x.astype(jnp.float32), 0, 1)
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    q, k, v, g, beta = (head_major(x) for x in (q, k, v, g, beta))
    n_v, t_pad = g.shape
    gcum = jnp.cumsum(g.reshape(n_v, t_pad // CHUNK, CHUNK), axis=-1).reshape(n_v, t_pad)
    return q, k, v, gcum, beta


def _check(q, k, v, g, beta, state):
    t_len, n_k, dk = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    ok = (
        k.shape == q.shape
        and v.shape[0] == t_len
        and g.shape == beta.shape == (t_len, n_v)
        and state.shape == (n_v, dk, dv)
        and n_v % n_k == 0
    )
    if not ok:
        raise DeltaRuleShapeError(
            f"delta rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
            f"state {state.shape} (want q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state "
            "[Hv, dk, dv], Hv a multiple of Hk)"
        )
    if dk < 16 or dk & (dk - 1) or dv < 16 or dv & (dv - 1):
        raise DeltaRuleShapeError(f"delta rule: dk {dk}, dv {dv} must be powers of two >= 16")


def chunk_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    state,
    *,
    interpret: bool = False,
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
):
    """q, k [T, Hk, dk] (q scaled, both L2-normed), v [T, Hv, dv], g (log decay) and beta [T, Hv],
    state [Hv, dk, dv] f32 -> (o [T, Hv, dv] f32, the state after the T tokens). block_v and
    num_warps: the kernel's tiles (defaults not yet measured on a GPU)."""
    _check(q, k, v, g, beta, state)
    t_len, n_k, dk = q.shape
    n_v, dv = v.shape[1], v.shape[2]
    block_v = min(block_v, dv)
    qh, kh, vh, gcum, bh = _prepare(q, k, v, g, beta)
    t_pad = gcum.shape[1]
    qk_spec = pl.BlockSpec((None, t_pad, dk), lambda h, j: (h % n_k, 0, 0))
    v_spec = pl.BlockSpec((None, t_pad, block_v), lambda h, j: (h, 0, j))
    row_spec = pl.BlockSpec((None, t_pad), lambda h, j: (h, 0))
    s_spec = pl.BlockSpec((None, dk, block_v), lambda h, j: (h, 0, j))
    o, s1 = pl.pallas_call(
        _kernel(t_pad // CHUNK),
        out_shape=[
            jax.ShapeDtypeStruct((n_v, t_pad, dv), jnp.float32),
            jax.ShapeDtypeStruct((n_v, dk, dv), jnp.float32),
        ],
        grid=(n_v, dv // block_v),
        in_specs=[qk_spec, qk_spec, v_spec, row_spec, row_spec, s_spec],
        out_specs=[v_spec, s_spec],
        compiler_params=tiles.compiler_params(num_warps, NUM_STAGES),
        interpret=interpret,
        name="chunk_delta_rule",
    )(qh, kh, vh, gcum, bh, state.astype(jnp.float32))
    return jnp.swapaxes(o[:, :t_len], 0, 1), s1


@jax.jit
def chunk_delta_rule_reference(q, k, v, g, beta, state):
    """The kernel's chunked math in jnp (a scan over chunks, all value heads at once), each
    chunk's triangular system through jax's solver: independent of the kernel's substitution."""
    return _chunk_scan(q, k, v, g, beta, state, _solve_reference)


@jax.jit
def chunk_delta_rule_xla(q, k, v, g, beta, state):
    """The model's XLA path (CPU): the reference's scan with the kernel's forward substitution,
    so its executable holds no LAPACK custom call (a stored CPU executable with one crashed when
    loaded into a process that had not registered LAPACK's handlers yet)."""
    return _chunk_scan(q, k, v, g, beta, state, forward_substitute)


def _chunk_scan(q, k, v, g, beta, state, solve):
    _check(q, k, v, g, beta, state)
    t_len, n_k = q.shape[:2]
    n_v = v.shape[1]
    qh, kh, vh, gcum, bh = _prepare(q, k, v, g, beta)
    rep = n_v // n_k
    qh, kh = jnp.tile(qh, (rep, 1, 1)), jnp.tile(kh, (rep, 1, 1))  # v head h -> q/k head h % Hk

    def chunks(x):  # [Hv, Tp, ...] -> [n_chunks, Hv, C, ...]
        return jnp.swapaxes(x.reshape(n_v, -1, CHUNK, *x.shape[2:]), 0, 1)

    def step(s, xs):
        o, s = jax.vmap(functools.partial(_chunk_step, solve=solve))(*xs, s)
        return s, o

    s1, o = lax.scan(step, state.astype(jnp.float32), tuple(map(chunks, (qh, kh, vh, gcum, bh))))
    o = jnp.swapaxes(o, 0, 1).reshape(n_v, -1, v.shape[2])
    return jnp.swapaxes(o[:, :t_len], 0, 1), s1


def delta_rule_step(q, k, v, g, beta, state):
    """One token per row: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], state [B, Hv, dk, dv]
    f32 -> (o [B, Hv, dv], state). The decode step (XLA fuses it; no kernel needed)."""
    rep = v.shape[1] // q.shape[1]
    q, k = jnp.tile(q, (1, rep, 1)), jnp.tile(k, (1, rep, 1))  # v head h -> q/k head h % Hk
    state = jnp.exp(g)[..., None, None] * state
    kv = jnp.einsum("bhkv,bhk->bhv", state, k, precision=HIGHEST)
    delta = beta[..., None] * (v - kv)
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", state, q, precision=HIGHEST), state


@jax.jit
def delta_rule_recurrent(q, k, v, g, beta, state):
    """The definition, one token at a time (a scan of delta_rule_step): same arguments and
    result as chunk_delta_rule."""

    def step(s, xs):
        o, s = delta_rule_step(*(x[None] for x in xs), s[None])
        return s[0], o[0]

    xs = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
    s1, o = lax.scan(step, state.astype(jnp.float32), xs)
    return o, s1
