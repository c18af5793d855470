"""Prefill GEMM, integer variant: int8 activations x int8 weight quants -> int32, rescaled per
block.

Status: interpret-mode tested only; it has not yet been compiled or timed on the GPU, so ops.py
does not dispatch to it by default (`Impl(gemm="int8")` opts in). docs/ARCHITECTURE.md.

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN; block
formats only (their `ints` form: value = q * a[group] (+ b[group])).

Prepass (XLA, once per call, like llama.cpp's q8_1): x [M, K] -> xq int8 [M, K] with one f32
scale per 32 values (xs [M, K/32]) and the float sums of x per weight group (xsum [M, K/g]).
Kernel grid (Mpad / bm, Npad / bn), token blocks fastest. Per 32-wide K step: the weight tile's
integers q [bn, 32] meet xq [bm, 32] in an int8 dot with int32 accumulation, and

    acc += float(dot) * xs[:, block] * a[group]  (+ xsum[:, group] * b[group])

Formats whose groups are 16 wide (Q2_K, Q3_K, Q6_K: the record's `group`) take two dots per
step, each with the other half of the weight tile zeroed, because the Triton lowering needs
K >= 32 for an int8 dot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import tiles
from minfer_jax.pallas.gemm import tiled_call
from minfer_jax.quant.planes import QType, decode_ints, get_format
from minfer_jax.sizes import round_up

XBLOCK = 32  # activation quantization block (and K step)


@dataclasses.dataclass(frozen=True)
class Int8GemmConfig:
    bm: int
    bn: int
    num_warps: int = 8
    num_stages: int = 1
    splits: int = 1  # K split (gemm.tiled_call)


def group_size(qtype: QType) -> int:
    return get_format(qtype).group


def choose_config(qtype: QType, m: int, n: int, k: int) -> Int8GemmConfig:
    bm = min(128, max(32, tiles.pow2_divisor(round_up(m, 32), 128)))
    return Int8GemmConfig(bm=bm, bn=128)


def quantize_activations(x: jax.Array, group: int):
    """x [M, K] -> (xq int8 [M, K], xs f32 [M, K/32], xsum f32 [M, K/group])."""
    m, k = x.shape
    x = x.astype(jnp.float32)
    xb = x.reshape(m, k // XBLOCK, XBLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [M, K/32]
    xs = amax / 127.0
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    xq = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8).reshape(m, k)
    xsum = jnp.sum(x.reshape(m, k // group, group), axis=-1)
    return xq, xs, xsum


@functools.cache
def _kernel(qtype: QType, bm: int, bn: int, k: int):
    """One kernel closure per configuration (jax#40847)."""
    fmt = get_format(qtype)
    g = group_size(qtype)
    halves = XBLOCK // g  # weight groups per activation block: 1 or 2
    dn = (((1,), (1,)), ((), ()))

    def kernel(xq_ref, xs_ref, xsum_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = pl.multiple_of(j * XBLOCK, XBLOCK)
            xq = xq_ref[:, pl.ds(k0, XBLOCK)]  # [bm, 32] int8
            xs = xs_ref[:, pl.ds(j, 1)]  # [bm, 1]
            q, a2, b2 = decode_ints(
                qtype, tiles.load_plane_tiles(fmt, plane_refs, 0, bn, k0, XBLOCK), jnp.float32
            )  # q [bn, 32]; a2, b2 [bn, halves]
            lane = lax.iota(jnp.int32, XBLOCK)[None, :]
            for h in range(halves):
                # this group's scale/offset (column h: a where-sum, since a loaded tensor cannot be
                # sliced); q of the other group zeroed
                pick = lax.iota(jnp.int32, halves)[None, :] == h
                a = jnp.sum(jnp.where(pick, a2, 0.0), axis=1, keepdims=True)  # [bn, 1]
                b = None if b2 is None else jnp.sum(jnp.where(pick, b2, 0.0), axis=1, keepdims=True)
                qh = q if halves == 1 else jnp.where(lane // g == h, q, 0)
                d = lax.dot_general(
                    xq, qh.astype(jnp.int8), dn, preferred_element_type=jnp.int32
                )  # [bm, bn]
                acc = acc + d.astype(jnp.float32) * xs * a.reshape(1, bn)
                if b is not None:
                    acc = acc + xsum_ref[:, pl.ds(j * halves + h, 1)] * b.reshape(1, bn)
            return acc

        acc = jnp.zeros((bm, bn), jnp.float32)
        n_steps = k // XBLOCK
        o_ref[...] = tiles.k_steps(n_steps, step, acc)

    return kernel


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "interpret"))
def gemm_int8(
    x: jax.Array,
    planes: dict,
    *,
    qtype: QType,
    n_out: int,
    config: Int8GemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] . W^T -> [M, n_out] f32 through int8 dots (activations quantized per 32 values)."""
    m, k = x.shape
    fmt = get_format(qtype)
    if fmt.ints is None:
        raise ValueError(f"gemm_int8 needs a block format, got {fmt.name}")
    cfg = config or choose_config(qtype, m, n_out, k)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    mpad = round_up(m, cfg.bm)
    g = group_size(qtype)
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % max(XBLOCK, fmt.block) == 0, (
        cfg,
        npad,
        k,
    )
    tiles.silence_triton_deprecation()

    xq, xs, xsum = quantize_activations(jnp.pad(x, ((0, mpad - m), (0, 0))), g)
    out = tiled_call(
        _kernel(qtype, cfg.bm, cfg.bn, k_split),
        [xq, xs, xsum],
        arrays,
        fmt,
        cfg.bm,
        cfg.bn,
        cfg.num_warps,
        cfg.num_stages,
        interpret,
        f"gemm_int8_{fmt.name.lower()}",
        splits=cfg.splits,
    )
    return out[:m, :n_out]


def gemm_int8_reference(x: jax.Array, planes: dict, *, qtype: QType, n_out: int) -> jax.Array:
    """The same arithmetic on whole arrays: identical activation quantization, exact integer group
    sums."""
    m, k = x.shape
    g = group_size(qtype)
    xq, xs, xsum = quantize_activations(x, g)
    q, a, b = decode_ints(qtype, planes, jnp.float32)  # q [Npad, K], a/b [Npad, K/g]
    q, a = q[:n_out], a[:n_out]
    s = jnp.einsum(
        "mgk,ngk->mng", xq.reshape(m, k // g, g).astype(jnp.int32), q.reshape(n_out, k // g, g)
    )
    scale = jnp.repeat(xs, XBLOCK // g, axis=1)  # activation scale of each weight group [M, K/g]
    y = jnp.sum(s.astype(jnp.float32) * scale[:, None, :] * a[None], axis=-1)
    if b is not None:
        y = y + xsum @ b[:n_out].T
    return y
