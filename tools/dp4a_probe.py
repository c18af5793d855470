"""GPU probe: int8-activation GEMV with dp4a (llama.cpp's MMVQ idea) in Pallas/Triton via inline PTX.

Standalone (random u32 word planes, Q4_0 and Q8_0), to decide whether the decode GEMV should move
to this formulation. Prints GB/s per config and the max relative error vs a numpy reference.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def dp4a(a, b, c):
    [r] = pltriton.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                          pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return r


def make_kernel(fmt, ntp, bn, gt, n_steps, prefetch):
    wpg = 4 if fmt == "q4_0" else 8

    def kernel(*refs):
        if fmt == "q4_0":
            w_ref, d_ref, xe_ref, xo_ref, dx_ref, xs_ref, o_ref = refs
        else:
            w_ref, d_ref, xe_ref, dx_ref, o_ref = refs

        def load(j):
            g0 = j * gt if isinstance(j, int) else pl.multiple_of(j * gt, gt)
            return w_ref[:, pl.ds(g0, gt), :], d_ref[:, pl.ds(g0, gt)]

        def step(j, carry):
            if prefetch:
                accs, (w, d) = carry
                nxt = load(jnp.minimum(j + 1, n_steps - 1))
            else:
                accs = carry
                w, d = load(j)
            g0 = pl.multiple_of(j * gt, gt)
            d = d.astype(jnp.float32)
            out = []
            if fmt == "q4_0":
                lo = w & 0x0F0F0F0F
                hi = (w >> 4) & 0x0F0F0F0F
            for t in range(ntp):
                xe = jnp.broadcast_to(xe_ref[t, pl.ds(g0, gt), :][None], (bn, gt, wpg))
                dx = dx_ref[t, pl.ds(g0, gt)]  # [gt]
                if fmt == "q4_0":
                    xo = jnp.broadcast_to(xo_ref[t, pl.ds(g0, gt), :][None], (bn, gt, wpg))
                    s = dp4a(hi, xo, dp4a(lo, xe, jnp.zeros((bn, gt, wpg), jnp.int32)))
                else:
                    s = dp4a(w, xe, jnp.zeros((bn, gt, wpg), jnp.int32))
                sf = jnp.sum(s, axis=-1).astype(jnp.float32) * dx[None, :]  # [bn, gt]
                if fmt == "q4_0":
                    sf = sf - 8.0 * xs_ref[t, pl.ds(g0, gt)][None, :]
                out.append(accs[t] + d * sf)
            return (tuple(out), nxt) if prefetch else tuple(out)

        accs = tuple(jnp.zeros((bn, gt), jnp.float32) for _ in range(ntp))
        if prefetch:
            accs, _ = lax.fori_loop(0, n_steps, step, (accs, load(0)))
        else:
            accs = lax.fori_loop(0, n_steps, step, accs)
        for t in range(ntp):
            o_ref[t, :] = jnp.sum(accs[t], axis=1)

    return kernel


def gemv(fmt, w, d, xs_list, dx, xsum, *, bn, gt, splits, warps, stages=1, prefetch=False, raw=False):
    n, g, wpg = w.shape
    ntp = dx.shape[0]
    gs = g // splits
    kern = make_kernel(fmt, ntp, bn, gt, gs // gt, prefetch)
    in_specs = [pl.BlockSpec((bn, gs, wpg), lambda i, s: (i, s, 0)), pl.BlockSpec((bn, gs), lambda i, s: (i, s))]
    ops = [w, d]
    for xv in xs_list:
        in_specs.append(pl.BlockSpec((ntp, gs, wpg), lambda i, s: (0, s, 0)))
        ops.append(xv)
    in_specs.append(pl.BlockSpec((ntp, gs), lambda i, s: (0, s)))
    ops.append(dx)
    if fmt == "q4_0":
        in_specs.append(pl.BlockSpec((ntp, gs), lambda i, s: (0, s)))
        ops.append(xsum)
    out = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((splits, ntp, n), jnp.float32), grid=(n // bn, splits),
                         in_specs=in_specs, out_specs=pl.BlockSpec((None, ntp, bn), lambda i, s: (s, 0, i)),
                         compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))(*ops)
    return out if raw else out.sum(0)


# (bn, gt, warps, target programs (1 = no split), prefetch, stages)
CONFIGS = [(16, 16, 4, 1024, False, 1), (16, 16, 4, 1024, True, 1), (16, 16, 4, 1024, False, 2),
           (32, 16, 4, 1024, True, 1), (16, 32, 4, 1024, True, 1),
           (16, 32, 4, 1024, False, 1), (16, 32, 8, 1024, True, 1), (8, 32, 4, 1, True, 1),
           (4, 32, 4, 1, True, 1), (4, 32, 2, 1, True, 1), (4, 64, 4, 1, True, 1), (8, 64, 4, 1, True, 1),
           (8, 16, 4, 2048, True, 1), (16, 16, 4, 2048, True, 1), (8, 32, 4, 1024, True, 1)]


def main():
    n, k = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "4096x14336").split("x"))
    rng = np.random.default_rng(0)
    reps = 30
    for fmt, ntp in [("q4_0", 1), ("q8_0", 1), ("q4_0", 8)][:int(sys.argv[2]) if len(sys.argv) > 2 else 3]:
        wpg = 4 if fmt == "q4_0" else 8
        g = k // 32
        ws = [jnp.asarray(rng.integers(0, 2**32, (n, g, wpg), dtype=np.uint32)) for _ in range(reps)]
        ds = [jnp.asarray((rng.standard_normal((n, g)) * 1e-2).astype(np.float16)) for _ in range(reps)]
        xq = rng.integers(-127, 128, (ntp, g, 32)).astype(np.int8)
        dx = jnp.asarray(rng.random((ntp, g)).astype(np.float32))
        xsum = jnp.asarray(xq.astype(np.float32).sum(-1)) * dx
        if fmt == "q4_0":  # word j of a group: weights 8j..8j+7; lo bytes = even weights, hi = odd
            xr = xq.reshape(ntp, g, 4, 4, 2)
            xs_list = [jnp.asarray(np.ascontiguousarray(xr[..., h]).view(np.int32)[..., 0]) for h in range(2)]
        else:
            xs_list = [jnp.asarray(xq.reshape(ntp, g, 8, 4).view(np.int32)[..., 0])]
        # numpy reference on copy 0
        wb = np.asarray(ws[0]).view(np.uint8).reshape(n, g, wpg * 4)
        if fmt == "q4_0":
            q = np.stack([wb & 15, wb >> 4], -1).reshape(n, g, 32).astype(np.float32) - 8
        else:
            q = wb.view(np.int8).astype(np.float32)
        xf = xq.astype(np.float32) * np.asarray(dx)[..., None]  # [ntp, g, 32]
        ref = np.einsum("ngk,tgk->tn", q * np.asarray(ds[0], np.float32)[..., None], xf)
        wbytes = n * k * (0.5 if fmt == "q4_0" else 1.0) + n * g * 2
        cfgs = []
        for bn, gt, warps, progs, pf, st in CONFIGS:
            chunks = g // gt
            splits = max(dd for dd in range(1, chunks + 1) if chunks % dd == 0 and (dd == 1 or (n // bn) * dd <= progs))
            cfgs.append(dict(bn=bn, gt=gt, splits=splits, warps=warps, prefetch=pf, stages=st))
        for kw in cfgs:
            try:
                f = jax.jit(lambda ws, ds, xs_list, dx, xsum: [gemv(fmt, w, d, xs_list, dx, xsum, raw=True, **kw)
                                                             for w, d in zip(ws, ds)])
                exe = f.lower(ws, ds, xs_list, dx, xsum).compile()
                out = exe(ws, ds, xs_list, dx, xsum)
                jax.block_until_ready(out)
                best = 1e9
                for _ in range(15):
                    t0 = time.perf_counter()
                    jax.block_until_ready(exe(ws, ds, xs_list, dx, xsum))
                    best = min(best, (time.perf_counter() - t0) / reps)
                got = np.asarray(out[0]).sum(0)
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                print(f"{fmt} nt={ntp} {n}x{k} {kw}: "
                      f"{best * 1e6:7.1f} us {wbytes / best / 1e9:7.0f} GB/s err={err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{fmt} {kw}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
