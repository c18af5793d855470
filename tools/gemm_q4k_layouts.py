"""GPU: does the few-token GEMM's cost come from its Q4_K tile decode's layout? (not part of the package)

usage: python tools/gemm_q4k_layouts.py [--shapes q4_k:3584x18944,...] [--nt 16,32] [--reps 20] [--interpret]

Nsight Compute put 38 % of the split Q4_K GEMM's stall samples on scalar shared-memory stores (one
STS per decoded f16, 64 per thread per K step): the decoded [bn, bk] tile reaches the dot through
reshapes ([bn, words, 8] -> [bn, bk], then [bn, groups, 32] for the scales). Two decodes that avoid
the large reshapes, timed beside the product's kernel (same tile, split and planes):
  w3d  nibbles kept as [bn, words, 8], scales per word [bn, words] applied in 3-D, one reshape at the end
  nib  one dot per nibble index i on [bn, words] (no reshape of the tile at all); x is permuted
       outside the kernel so that its K-columns match (within a K step: column i * words + j
       holds x[8 j + i]), the dot sum being order-free
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from cases import add_case_args, parse_cases  # tools/ is sys.path[0] when run as a script
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.bench import kernel_timing as KB
from minfer_jax.pallas import gemm, tiles
from minfer_jax.quant.planes import QType, get_format, int_to_half

DN = (((1,), (1,)), ((), ()))


def _scales(refs, k0, bn: int, bk: int):
    """Per-word f16 scale and offset [bn, bk / 8] of a Q4_K tile (gguf-py's product order)."""
    _, sc_ref, m_ref, d_ref, dmin_ref = refs
    groups = bk // 32
    g0 = k0 // 32 if isinstance(k0, int) else pl.multiple_of(k0 // 32, groups)
    s0 = k0 // 256
    f16 = jnp.float16
    d = d_ref[:, pl.ds(s0, 1)].astype(f16)
    dmin = dmin_ref[:, pl.ds(s0, 1)].astype(f16)
    a = d * sc_ref[:, pl.ds(g0, groups)].astype(jnp.int32).astype(f16)  # [bn, groups]
    b = -(dmin * m_ref[:, pl.ds(g0, groups)].astype(jnp.int32).astype(f16))

    def per_word(v):  # [bn, groups] -> [bn, groups * 4]: a 32-weight group is 4 words
        return jnp.broadcast_to(v[:, :, None], (bn, groups, 4)).reshape(bn, groups * 4)

    return per_word(a), per_word(b)


@functools.cache
def _kernel(style: str, bm: int, bn: int, bk: int, k: int):
    words = bk // 8
    n_k = k // bk

    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            w0 = k0 // 8 if isinstance(k0, int) else pl.multiple_of(k0 // 8, words)
            qs = plane_refs[0][:, pl.ds(w0, words)]  # [bn, words] uint32
            a, b = _scales(plane_refs, k0, bn, bk)
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            if style == "w3d":
                shifts = (lax.iota(jnp.int32, 8) * 4).astype(jnp.uint32)
                q = ((qs[:, :, None] >> shifts[None, None, :]) & jnp.uint32(15)).astype(jnp.int32)
                w = (int_to_half(q) * a[:, :, None] + b[:, :, None]).reshape(bn, bk)
                return acc + lax.dot_general(x_ref[:, pl.ds(kx, bk)], w, DN, preferred_element_type=jnp.float32)
            for i in range(8):
                q = ((qs >> jnp.uint32(4 * i)) & jnp.uint32(15)).astype(jnp.int32)
                w = int_to_half(q) * a + b  # [bn, words]: weights 8 j + i
                xi = x_ref[:, pl.ds(kx + i * words, words)]  # [bm, words], permuted columns
                acc = acc + lax.dot_general(xi, w, DN, preferred_element_type=jnp.float32)
            return acc

        o_ref[...] = tiles.k_steps(n_k, step, jnp.zeros((bm, bn), jnp.float32))

    return kernel


def permute_x(x: jax.Array, bk: int) -> jax.Array:
    """Within each K step of bk: column i * (bk / 8) + j <- column 8 j + i."""
    m, k = x.shape
    return x.reshape(m, k // bk, bk // 8, 8).transpose(0, 1, 3, 2).reshape(m, k)


@functools.partial(jax.jit, static_argnames=("style", "n_out", "config", "interpret"))
def gemm_q4k(x, planes, *, style: str, n_out: int, config: gemm.GemmConfig, interpret: bool = False):
    fmt = get_format(QType.Q4_K)
    cfg = config
    arrays = tiles.plane_arrays(fmt, planes)
    m, k = x.shape
    mpad = tiles.round_up(m, cfg.bm)
    xp = tiles.cast_rows(x, mpad, jnp.float16)
    if style == "nib":
        xp = permute_x(xp, cfg.bk)
    out = gemm.tiled_call(_kernel(style, cfg.bm, cfg.bn, cfg.bk, k // cfg.splits), [xp], arrays, fmt, cfg.bm, cfg.bn,
                          cfg.num_warps, cfg.num_stages, interpret, f"gemm_{style}_q4_k", splits=cfg.splits)
    return out[:m, :n_out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap, nt="16,32")
    ap.set_defaults(shapes="q4_k:3584x3584,q4_k:37888x3584,q4_k:3584x18944")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--warps", default="4", help="num_warps values to try for the new styles")
    a = ap.parse_args()
    for qt, n, k, nt in parse_cases(a):
        if qt != QType.Q4_K:
            raise SystemExit("this probe decodes Q4_K only")
        base = gemm.choose_config(qt, nt, n, k)
        cands = [("route", base)] + [(s, dataclasses.replace(base, num_warps=int(w)))
                                     for s in ("w3d", "nib") for w in a.warps.split(",")]
        for style, cfg in cands:
            if style == "route":
                def call(x, w, cfg=cfg):
                    return gemm.gemm(x, w, qtype=qt, n_out=n, config=cfg, interpret=a.interpret)
            else:
                def call(x, w, style=style, cfg=cfg):
                    return gemm_q4k(x, w, style=style, n_out=n, config=cfg, interpret=a.interpret)
            ref = functools.partial(gemm.gemm_reference, qtype=qt, n_out=n)
            try:
                r = KB.run_case(qt, n, k, nt, call, ref, impl=style, reps=a.reps, trials=3)
            except Exception as e:  # noqa: BLE001 - one failing lowering must not hide the rest
                print(f"{style} {qt.name} {n}x{k} nt={nt} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
                continue
            print(f"{qt.name} {n:6d}x{k:6d} nt={nt:3d} {style:5s} {r.us:8.2f} us {r.gbps:7.1f} GB/s "
                  f"err={r.rel_err:.1e} {cfg}", flush=True)


if __name__ == "__main__":
    main()
