"""GPU: where does the decode GEMV's time go? (one device call; not part of the package)

usage: python tools/gemv_profile.py time [--out DIR]   time each case's GEMV next to a read-only
                                                       kernel with the same grid and loads
       ncu ... python tools/gemv_profile.py run        run each kernel once (for Nsight Compute)
       --shapes TYPE:OUTxIN,... [--nt LIST] replaces the built-in cases; tools/ncu_sass_summary.py
       folds an `ncu --page source --print-source sass --csv` export into a table per opcode.

The read-only kernel ("stream") loads the blocks the integer GEMV loads (x and every weight view;
not the coarse per-super-block rows, which the GEMV gathers) and only sums them: its time is the
floor this grid and block shape can reach under Triton, so GEMV - stream is the cost of the decode
and integer-dot arithmetic.
"""

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.pallas import gemv as G
from minfer_jax.pallas import gemv_tuning, int8_words, tiles
from minfer_jax.quant.planes import QType as Q

from minfer_bench.bench import kernel_timing as KB
from minfer_bench.bench import parsing

CASES = [
    (Q.Q4_0, 4096, 14336, 1),
    (Q.Q4_K, 4096, 14336, 1),
    (Q.Q6_K, 4096, 14336, 1),
    (Q.Q8_0, 4096, 14336, 1),
    (Q.Q4_K, 4096, 14336, 8),
]


def _total(v):  # any block -> f32 scalar-per-row [bn] (rows first)
    v = v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v.astype(jnp.int32)
    while v.ndim > 1:
        v = jnp.sum(v, axis=-1)
    return v.astype(jnp.float32)


@functools.cache
def _stream_kernel(n_views: int):
    def kernel(x_ref, *refs):
        *plane_refs, o_ref = refs
        acc = _total(plane_refs[0][...])
        for r in plane_refs[1:]:
            acc = acc + _total(r[...])
        xs = x_ref[...].astype(jnp.float32)
        while xs.ndim > 0:
            xs = jnp.sum(xs, axis=-1)
        o_ref[0, :] = acc + xs

    return kernel


@functools.partial(jax.jit, static_argnames=("qtype", "cfg", "interpret"))
def stream(x, planes, *, qtype, cfg, interpret=False):
    spec = int8_words.SPECS[qtype]
    nt, k = x.shape
    gs = k // spec.group // cfg.splits
    xv = int8_words.x_view(qtype, x)
    wp = int8_words.word_planes(qtype, planes)
    npad = planes[spec.views[0][0]].shape[0]
    in_specs = [pl.BlockSpec((nt, gs, spec.x_words, 4, spec.x_slots), lambda i, s: (0, s, 0, 0, 0))]
    arrays = []
    for name, tail in spec.views:
        arrays.append(wp[name])
        in_specs.append(
            pl.BlockSpec((cfg.bn, gs, *tail), functools.partial(G._row_block_index, len(tail)))
        )
    out = G._split_k_call(
        _stream_kernel(len(arrays)),
        in_specs,
        (xv, *arrays),
        cfg,
        npad,
        1,
        interpret,
        "stream_probe",
    )
    return out.sum(axis=0)


def variants(qt, n, k, nt):
    base = G.choose_config(qt, n, k, nt)
    out = [("gemv", base)]
    if nt == 1:
        for w in (1, 2, 8):
            out.append(("gemv", dataclasses.replace(base, num_warps=w)))
        for bn, w in ((64, 4), (64, 8)):
            out.append(
                (
                    "gemv",
                    dataclasses.replace(
                        base,
                        bn=bn,
                        num_warps=w,
                        splits=gemv_tuning.one_step_splits(base.splits, 4096 // bn),
                    ),
                )
            )
    out.append(("stream", base))
    return out


def fn_for(kind, qt, n, cfg):
    if kind == "stream":
        return lambda x, w: stream(x, w, qtype=qt, cfg=cfg)
    return lambda x, w: G.gemv_int8(x, w, qtype=qt, n_out=n, config=cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("time", "run"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--shapes",
        default=None,
        help="instead of the built-in cases: TYPE:OUTxIN list, as "
        "scripts/bench.py --shapes (e.g. q5_0:4096x14336)",
    )
    ap.add_argument("--nt", default="1", help="token counts for --shapes, as scripts/bench.py --nt")
    a = ap.parse_args()
    cases = (
        CASES
        if a.shapes is None
        else [
            (qt, n, k, nt)
            for qt, n, k in parsing.parse_shapes(a.shapes)
            for nt in parsing.parse_int_range(a.nt, "--nt")
        ]
    )
    print(jax.devices(), jax.__version__, flush=True)
    tiles.silence_triton_deprecation()
    for qt, n, k, nt in cases:
        for kind, cfg in variants(qt, n, k, nt):
            f = fn_for(kind, qt, n, cfg)
            if a.mode == "run":
                if kind == "gemv" and cfg != G.choose_config(qt, n, k, nt):
                    continue
                w = KB.random_planes(jax.random.PRNGKey(1), qt, n, k)
                x = jax.random.normal(jax.random.PRNGKey(0), (nt, k))
                jax.block_until_ready(jax.jit(f)(x, w))
                continue
            ref = functools.partial(G.gemv_reference, qtype=qt, n_out=n) if kind == "gemv" else f
            try:
                r = KB.run_case(qt, n, k, nt, f, ref, impl=kind, reps=20)
                print(
                    f"{kind:6s} {qt.name:5s} {n}x{k} nt={nt} {r.us:8.2f} us (mean {r.avg_us:8.2f}) "
                    f"{r.gbps:7.1f} GB/s err={r.rel_err:.1e} {cfg}",
                    flush=True,
                )
                d = dataclasses.asdict(r) | {"kind": kind, "config": str(cfg)}
            except Exception as e:  # noqa: BLE001 - one failing lowering must not hide the rest
                print(
                    f"{kind} {qt.name} {n}x{k} nt={nt} FAILED {type(e).__name__}: {str(e)[:500]}",
                    flush=True,
                )
                d = {
                    "kind": kind,
                    "qtype": qt.name,
                    "nt": nt,
                    "config": str(cfg),
                    "error": str(e)[:1000],
                }
            with open(os.path.join(a.out, "gemv_profile.jsonl"), "a") as fh:
                fh.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    sys.exit(main())
