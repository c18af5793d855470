"""GPU: the chunked delta-rule prefill kernel (pallas/delta_rule.py) at Qwen3.6-27B shapes,
checked against its jnp reference and timed beside it.

usage: PYTHONPATH=. python tools/delta_rule_bench.py [--ts 512,4096] [--heads 16,48] [--dim 128]
           [--block-vs 32,64,128] [--warps 4,8] [--reps 10]

Qwen3.6-27B: 16 q/k heads, 48 v heads, head size 128 (48 of its 64 layers are DeltaNet). A time is
the median wall time of `reps` calls after a warm-up (block_until_ready on each); tok/s is one
layer's tokens per second. The check prints the max abs error of o and of the final state beside
the reference's scale. Not part of the package.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.pallas import delta_rule


def _inputs(t_len, n_k, n_v, dim):
    r = np.random.default_rng(0)

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = l2(r.standard_normal((t_len, n_k, dim))) * dim**-0.5
    k = l2(r.standard_normal((t_len, n_k, dim)))
    v = r.standard_normal((t_len, n_v, dim))
    g = -np.abs(r.standard_normal((t_len, n_v))) * 0.3
    beta = 1 / (1 + np.exp(-r.standard_normal((t_len, n_v))))
    state = np.zeros((n_v, dim, dim))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)]


def _median_s(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="512,4096")
    ap.add_argument("--heads", default="16,48")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block-vs", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    n_k, n_v = (int(x) for x in a.heads.split(","))
    print(f"device: {jax.devices()[0].device_kind}; heads {n_k}/{n_v}, dim {a.dim}")
    for t_len in (int(x) for x in a.ts.split(",")):
        args = _inputs(t_len, n_k, n_v, a.dim)
        ref = jax.jit(delta_rule.chunk_delta_rule_reference)
        want_o, want_s = ref(*args)
        ref_s = _median_s(ref, args, a.reps)
        print(f"T={t_len} reference (XLA) {ref_s * 1e3:.3f} ms  {t_len / ref_s:,.0f} tok/s")
        tiles = [(int(b), int(w)) for b in a.block_vs.split(",") for w in a.warps.split(",")]
        for bv, warps in tiles:
            fn = jax.jit(
                lambda *x, bv=bv, w=warps: delta_rule.chunk_delta_rule(*x, block_v=bv, num_warps=w)
            )
            o, s = fn(*args)
            err_o = float(jnp.max(jnp.abs(o - want_o)))
            err_s = float(jnp.max(jnp.abs(s - want_s)))
            scale = float(jnp.max(jnp.abs(want_o)))
            secs = _median_s(fn, args, a.reps)
            print(
                f"T={t_len} kernel block_v={bv} warps={warps}: {secs * 1e3:.3f} ms  "
                f"{t_len / secs:,.0f} tok/s  "
                f"max|o err| {err_o:.2e} (|o| {scale:.2e}) max|state err| {err_s:.2e}  "
                f"{'PASS' if err_o < 1e-3 * max(scale, 1) and err_s < 1e-3 else 'FAIL'}"
            )


if __name__ == "__main__":
    main()
