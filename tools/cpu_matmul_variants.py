"""Which weight form does XLA's CPU backend multiply fastest for the built-in 0.5B's shapes?

Each variant holds a stack of `--layers` weights (so the bytes stream from memory, not the cache, as
in a decode step) and runs x through all of them in one jitted scan; best-of-`--reps` ms per matmul.

    PYTHONPATH=. python tools/cpu_matmul_variants.py --nt 1 --shapes 9728x896,896x4864
    XLA_FLAGS=--xla_cpu_experimental_xnn_fusion_type=... PYTHONPATH=. python tools/... (A/B flags)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32


def _weights(n, k, layers, rng):
    q = rng.integers(-16, 16, size=(layers, n, k), dtype=np.int8)
    s = (rng.random((layers, n, k // BLOCK), dtype=np.float32) * 0.01).astype(np.float32)
    return q, s


def variants(n, k):
    nb = k // BLOCK

    def f32_nk(x, w):  # w [n, k] f32
        return jnp.dot(x, w["w"].T)

    def f32_kn(x, w):  # w [k, n] f32
        return jnp.dot(x, w["w"])

    def bf16_nk(x, w):
        return jax.lax.dot_general(
            x.astype(jnp.bfloat16),
            w["w"],
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )

    def bf16_nk_f32x(x, w):  # weights widened inside the dot's fusion
        return jnp.dot(x, w["w"].astype(jnp.float32).T)

    def i8_deq_dot(x, w):  # int8 * block scale -> f32, then the dot
        deq = (w["q"].astype(jnp.float32).reshape(n, nb, BLOCK) * w["s"][..., None]).reshape(n, k)
        return jnp.dot(x, deq.T)

    def i8_deq_kn(x, w):  # int8 [k, n] * block scale [k / 32, n] -> f32, then the dot
        deq = (w["q"].reshape(nb, BLOCK, n).astype(jnp.float32) * w["s"][:, None, :]).reshape(k, n)
        return jnp.dot(x, deq)

    def i8_deq_bar(x, w):  # the decoded matrix materialized (no fusion into the dot)
        deq = (w["q"].astype(jnp.float32).reshape(n, nb, BLOCK) * w["s"][..., None]).reshape(n, k)
        return jnp.dot(x, jax.lax.optimization_barrier(deq).T)

    def i8_deq_bar_kn(x, w):
        deq = (w["q"].reshape(nb, BLOCK, n).astype(jnp.float32) * w["s"][:, None, :]).reshape(k, n)
        return jnp.dot(x, jax.lax.optimization_barrier(deq))

    def i8_reduce(x, w):  # multiply-reduce, scale per block after the inner sum
        xb = x.reshape(-1, 1, nb, BLOCK)
        part = (w["q"].astype(jnp.float32).reshape(n, nb, BLOCK) * xb).sum(-1)  # [t, n, nb]
        return (part * w["s"]).sum(-1)

    def i8_dot_f32(x, w):  # one dot over (block, j) of x with the int8 weights widened, per block
        xb = x.reshape(-1, nb, BLOCK)
        part = jnp.einsum("tbj,nbj->tnb", xb, w["q"].reshape(n, nb, BLOCK).astype(jnp.float32))
        return (part * w["s"]).sum(-1)

    def i8_i8_block(x, w):  # llama.cpp's way: x quantized per block, int8 x int8 -> int32 per block
        xb = x.reshape(-1, nb, BLOCK)
        xs = jnp.max(jnp.abs(xb), -1) / 127.0
        xq = jnp.round(xb / jnp.where(xs == 0, 1, xs)[..., None]).astype(jnp.int8)
        part = jax.lax.dot_general(
            xq,
            w["q"].reshape(n, nb, BLOCK),
            (((2,), (2,)), ((1,), (1,))),
            preferred_element_type=jnp.int32,
        )  # [nb, t, n]
        return jnp.einsum("btn,nb,tb->tn", part.astype(jnp.float32), w["s"], xs)

    def i8_i8_whole(x, w):  # upper bound: one int8 dot over all k (no block scales)
        xq = jnp.round(x * 10).astype(jnp.int8)
        out = jax.lax.dot_general(
            xq, w["q"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
        )
        return out.astype(jnp.float32) * w["s"][:, 0]

    return dict(
        f32_nk=f32_nk,
        f32_kn=f32_kn,
        bf16_nk=bf16_nk,
        bf16_nk_f32x=bf16_nk_f32x,
        i8_deq_dot=i8_deq_dot,
        i8_deq_kn=i8_deq_kn,
        i8_deq_bar=i8_deq_bar,
        i8_deq_bar_kn=i8_deq_bar_kn,
        i8_reduce=i8_reduce,
        i8_dot_f32=i8_dot_f32,
        i8_i8_block=i8_i8_block,
        i8_i8_whole=i8_i8_whole,
    )


def stored(name, q, s):
    w = (q.astype(np.float32).reshape(*q.shape[:2], -1, BLOCK) * s[..., None]).reshape(q.shape)
    if name == "f32_nk":
        return dict(w=w)
    if name == "f32_kn":
        return dict(w=np.ascontiguousarray(np.swapaxes(w, 1, 2)))
    if name.startswith("bf16"):
        return dict(w=jnp.asarray(w, jnp.bfloat16))
    if name.endswith("_kn"):
        return dict(
            q=np.ascontiguousarray(np.swapaxes(q, 1, 2)),
            s=np.ascontiguousarray(np.swapaxes(s, 1, 2)),
        )
    return dict(q=q, s=s)


def time_variant(fn, ws, x, reps):
    def body(x, w):
        y = fn(x, w)
        return x + 1e-3 * y.sum(), None  # a carried dependency: no layer can be skipped

    run = jax.jit(lambda x, ws: jax.lax.scan(body, x, ws)[0])
    run(x, ws).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        run(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="9728x896,896x4864,1152x896,896x896")
    ap.add_argument("--nt", default="1")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        q, s = _weights(n, k, a.layers, rng)
        for nt in map(int, a.nt.split(",")):
            x = jnp.asarray(rng.standard_normal((nt, k), dtype=np.float32))
            for name, fn in variants(n, k).items():
                if a.only and name not in a.only.split(","):
                    continue
                ws = jax.tree_util.tree_map(jnp.asarray, stored(name, q, s))
                t = time_variant(fn, ws, x, a.reps)
                per = t / a.layers * 1e3
                nbytes = sum(v.nbytes for v in jax.tree_util.tree_leaves(ws)) / a.layers
                print(
                    f"{n}x{k} nt={nt} {name:14s} {per:8.3f} ms/matmul"
                    f"  {nbytes / per / 1e6:6.1f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
