"""GEMV design experiments on the GPU (Q4_0 / Q8_0 / F16 at 4096 x 14336): which tile shape and
which arithmetic (tensor-core dot vs CUDA-core FMA) streams weights fastest under Triton.

Not part of the package; results are recorded in docs/ARCHITECTURE.md.
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

N, K = 4096, 14336
INTERPRET = "--interpret" in sys.argv


def timeit(fn, args_list, reps):
    @jax.jit
    def loop(args_list):
        return [fn(*a) for a in args_list]
    jax.block_until_ready(loop(args_list))
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(loop(args_list))
        best = min(best, time.perf_counter() - t)
    return best / reps * 1e6


def q4_planes(key, n, k):
    k1, k2 = jax.random.split(key)
    qs = jax.random.randint(k1, (n, k // 32, 16), 0, 256, jnp.int32).astype(jnp.uint8)  # native GGUF nibbles
    d = (jax.random.normal(k2, (n, k // 32)) * 1e-2).astype(jnp.float16)
    return qs, d


def q4_ref(x, qs, d):
    lo = (qs & 15).astype(jnp.float32) - 8
    hi = (qs >> 4).astype(jnp.float32) - 8
    w = jnp.concatenate([lo, hi], -1) * d.astype(jnp.float32)[..., None]  # [n, G, 32]
    return jnp.einsum("tk,nk->tn", x, w.reshape(w.shape[0], -1))


# --- E2: 3D tile, CUDA-core FMA, nt = 1 -------------------------------------------------------
@functools.cache
def _q4_fma_kernel(bn, g, n_steps):
    def kernel(x_ref, qs_ref, d_ref, o_ref):
        # x_ref: [K/32, 32] f32 ; qs_ref: [bn, K/32, 16] ; d_ref [bn, K/32]
        def step(s, acc):
            g0 = pl.multiple_of(s * g, g)
            b = qs_ref[:, pl.ds(g0, g), :]  # [bn, g, 16]
            xl = x_ref[pl.ds(g0, g), pl.ds(0, 16)]  # [g, 16]
            xh = x_ref[pl.ds(g0, g), pl.ds(16, 16)]
            lo = (b & 15).astype(jnp.float32)
            hi = (b >> 4).astype(jnp.float32)
            part = jnp.sum(lo * xl[None] + hi * xh[None], axis=2)  # [bn, g]
            xs = jnp.sum(xl + xh, axis=1)  # [g]
            part = part - 8.0 * xs[None, :]
            return acc + part * d_ref[:, pl.ds(g0, g)].astype(jnp.float32)  # [bn, g]
        acc = lax.fori_loop(0, n_steps, step, jnp.zeros((bn, g), jnp.float32))
        o_ref[...] = jnp.sum(acc, axis=1)
    return kernel


def q4_fma(x, qs, d, bn=32, g=8, nw=4, ns=1, splits=1):
    n, G, _ = qs.shape
    gs = G // splits
    x2 = x.reshape(G, 32)
    out = pl.pallas_call(
        _q4_fma_kernel(bn, g, gs // g),
        out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32),
        grid=(n // bn, splits),
        in_specs=[pl.BlockSpec((gs, 32), lambda i, s: (s, 0)),
                  pl.BlockSpec((bn, gs, 16), lambda i, s: (i, s, 0)),
                  pl.BlockSpec((bn, gs), lambda i, s: (i, s))],
        out_specs=pl.BlockSpec((None, bn), lambda i, s: (s, i)),
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=ns),
        interpret=INTERPRET,
    )(x2, qs, d)
    return out.sum(0)[None]


# --- E3: 3D tile, tensor-core dots on lo/hi halves, nt <= 16 ------------------------------------
@functools.cache
def _q4_dot_kernel(bn, g, n_steps):
    def kernel(x_ref, qs_ref, d_ref, o_ref):
        # x_ref: [16, K/32, 32] f16 ; qs_ref [bn, K/32, 16] ; d_ref [bn, K/32]
        def step(s, acc):
            g0 = pl.multiple_of(s * g, g)
            b = qs_ref[:, pl.ds(g0, g), :]  # [bn, g, 16]
            dd = d_ref[:, pl.ds(g0, g)][:, :, None]  # [bn, g, 1]
            lo = (((b & 15).astype(jnp.int32) - 8).astype(jnp.float16) * dd).reshape(bn, g * 16)
            hi = (((b >> 4).astype(jnp.int32) - 8).astype(jnp.float16) * dd).reshape(bn, g * 16)
            xl = x_ref[:, pl.ds(g0, g), pl.ds(0, 16)].reshape(16, g * 16)
            xh = x_ref[:, pl.ds(g0, g), pl.ds(16, 16)].reshape(16, g * 16)
            dn = (((1,), (1,)), ((), ()))
            acc = acc + lax.dot_general(xl, lo, dn, preferred_element_type=jnp.float32)
            return acc + lax.dot_general(xh, hi, dn, preferred_element_type=jnp.float32)
        acc = lax.fori_loop(0, n_steps, step, jnp.zeros((16, bn), jnp.float32))
        o_ref[...] = acc
    return kernel


def q4_dot(x, qs, d, bn=64, g=8, nw=4, ns=1):
    n, G, _ = qs.shape
    nt = x.shape[0]
    x3 = jnp.pad(x.astype(jnp.float16), ((0, 16 - nt), (0, 0))).reshape(16, G, 32)
    out = pl.pallas_call(
        _q4_dot_kernel(bn, g, G // g),
        out_shape=jax.ShapeDtypeStruct((16, n), jnp.float32),
        grid=(n // bn,),
        in_specs=[pl.BlockSpec((16, G, 32), lambda i: (0, 0, 0)),
                  pl.BlockSpec((bn, G, 16), lambda i: (i, 0, 0)),
                  pl.BlockSpec((bn, G), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, bn), lambda i: (0, i)),
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=ns),
        interpret=INTERPRET,
    )(x3, qs, d)
    return out[:nt]


# --- E4: F16 weights, CUDA-core FMA, nt = 1 ------------------------------------------------------
@functools.cache
def _f16_fma_kernel(bn, bk, n_steps):
    def kernel(x_ref, w_ref, o_ref):
        def step(s, acc):
            k0 = pl.multiple_of(s * bk, bk)
            w = w_ref[:, pl.ds(k0, bk)].astype(jnp.float32)  # [bn, bk]
            return acc + w * x_ref[pl.ds(k0, bk)][None, :]
        acc = lax.fori_loop(0, n_steps, step, jnp.zeros((bn, bk), jnp.float32))
        o_ref[...] = jnp.sum(acc, axis=1)
    return kernel


def f16_fma(x, w, bn=16, bk=256, nw=4, ns=1):
    n, k = w.shape
    return pl.pallas_call(
        _f16_fma_kernel(bn, bk, k // bk),
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
        grid=(n // bn,),
        in_specs=[pl.BlockSpec((k,), lambda i: (0,)), pl.BlockSpec((bn, k), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bn,), lambda i: (i,)),
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=ns),
        interpret=INTERPRET,
    )(x[0], w)[None]


def main():
    reps = 2 if INTERPRET else 20
    n, k = (256, 14336) if INTERPRET else (N, K)
    keys = jax.random.split(jax.random.PRNGKey(0), reps + 1)
    x1 = jax.random.normal(keys[-1], (1, k))
    q4 = [q4_planes(kk, n, k) for kk in keys[:reps]]
    qbytes = n * k // 32 * 18
    ref1 = q4_ref(x1, *q4[0])


    def report(name, fn, x, ref, nbytes, wl):
        try:
            got = jax.jit(fn)(x, *wl[0])
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            us = timeit(fn, [(x, *w) for w in wl], reps)
            print(f"{name:40s} {us:8.2f} us {nbytes / us / 1e3:8.1f} GB/s err={err:.1e}", flush=True)
        except Exception as e:
            print(f"{name:40s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)

    for bn, g, nw, sp in [(16, 8, 4, 4), (16, 16, 4, 4), (32, 16, 4, 4), (16, 8, 4, 8), (32, 8, 4, 8),
                          (16, 8, 2, 8), (8, 8, 2, 8), (32, 16, 8, 4)]:
        report(f"q4 fma bn={bn} g={g} nw={nw} splits={sp}", functools.partial(q4_fma, bn=bn, g=g, nw=nw, splits=sp),
               x1, ref1, qbytes, q4)


if __name__ == "__main__":
    main()
