"""GPU probe: compile, check and time the Pallas matmul kernels on a list of cases (one device call).

Usage: python tools/kernel_probe.py CASESET [--out DIR]. Prints one line per case and appends JSON
lines to DIR/kernels.jsonl. Superseded for reporting by scripts/bench.py --kernels.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax

from minfer_jax import kernel_bench as KB
from minfer_jax.kernel_bench import run_case
from minfer_jax.pallas import dequant as D
from minfer_jax.quant import int8_words
from minfer_jax.pallas import gemm as M
from minfer_jax.pallas import gemm_int8 as M8
from minfer_jax.pallas import gemv as G
from minfer_jax.quant.planes import FORMATS, QType

Q = QType


def gemv_case(qt, n, k, nt, cfg=None):
    f = lambda x, w: G.gemv(x, w, qtype=qt, n_out=n, config=cfg)
    r = lambda x, w: G.gemv_reference(x, w, qtype=qt, n_out=n)
    return ("gemv", qt, n, k, nt, f, r, cfg)


def gemm_case(qt, n, k, m, cfg=None):
    f = lambda x, w: M.gemm(x, w, qtype=qt, n_out=n, config=cfg)
    r = lambda x, w: M.gemm_reference(x, w, qtype=qt, n_out=n)
    return ("gemm", qt, n, k, m, f, r, cfg)


def dequant_case(qt, n, k, cfg=None):  # times the dequantization alone (x unused; output [Npad, K])
    f = lambda x, w: D.dequantize(w, qtype=qt, config=cfg)
    r = lambda x, w: D.dequantize_reference(w, qtype=qt)
    return ("dequant", qt, n, k, 1, f, r, cfg)


def variant_case(qt, n, k, m, gemm):  # ops.matmul's prefill dispatch with one variant forced
    return ("gemm:" + gemm, qt, n, k, m, KB.dispatch_matmul(qt, n, k, "pallas", gemm),
            KB.reference_matmul(qt, n, m, "pallas", gemm), gemm)


def gemm_int8_case(qt, n, k, m, cfg=None):
    f = lambda x, w: M8.gemm_int8(x, w, qtype=qt, n_out=n, config=cfg)
    r = lambda x, w: M8.gemm_int8_reference(x, w, qtype=qt, n_out=n)
    return ("gemm_int8", qt, n, k, m, f, r, cfg)


def cases(name):
    if name == "first":
        out = [gemv_case(q, 4096, 14336, 1) for q in FORMATS]
        out += [gemv_case(q, 4096, 14336, 8) for q in (Q.Q4_0, Q.Q4_K)]
        out += [gemv_case(Q.Q5_0, 896, 896, 1), gemv_case(Q.Q5_0, 9728, 896, 1),
                gemv_case(Q.Q6_K, 896, 4864, 1), gemv_case(Q.Q8_0, 151936, 896, 1)]
        for bn, nw, ns in [(16, 4, 2), (64, 4, 2), (32, 8, 2), (32, 4, 3), (32, 4, 1)]:
            for q in (Q.Q4_0, Q.Q4_K):
                bk = 256
                out.append(gemv_case(q, 4096, 14336, 1, G.GemvConfig(bn=bn, bk=bk, splits=2, num_warps=nw, num_stages=ns)))
        out += [gemm_case(q, 4096, 14336, 512) for q in (Q.F16, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0)]
        return out
    if name == "sweep2":
        out = []
        cfgs = [(32, 256, 8, 4, 1), (16, 256, 8, 4, 1), (64, 256, 8, 4, 1), (32, 256, 4, 4, 1),
                (32, 256, 8, 2, 1), (32, 256, 8, 8, 1), (32, 256, 8, 4, 2), (16, 128, 8, 2, 1)]
        for q in (Q.Q4_0, Q.Q4_K):
            out += [gemv_case(q, 4096, 14336, 1, G.GemvConfig(*c)) for c in cfgs]
        out += [gemv_case(Q.Q4_0, 4096, 14336, 1, G.GemvConfig(*c)) for c in [(32, 128, 16, 4, 1), (16, 128, 16, 4, 1)]]
        for q in (Q.F16, Q.Q8_0, Q.Q6_K, Q.Q5_0):
            out += [gemv_case(q, 4096, 14336, 1, G.GemvConfig(*c)) for c in [(32, 256, 8, 4, 1), (16, 256, 8, 4, 1)]]
        out += [gemv_case(Q.Q4_K, 4096, 14336, 8, G.GemvConfig(32, 256, 8, 4, 1))]
        return out
    if name == "int8":  # integer-path GEMV tiles at the 0.5B decode shapes, and nt = 8 at 7B width
        out = []
        small = [(Q.Q5_0, 896, 896), (Q.Q5_0, 128, 896), (Q.Q5_0, 9728, 896), (Q.Q6_K, 896, 4864),
                 (Q.Q8_0, 151936, 896)]
        for q, n, k in small:
            base = G.choose_config(q, n, k)
            out.append(gemv_case(q, n, k, 1, base))
            for bn, warps, target in [(16, 2, 1024), (32, 4, 1024), (8, 2, 1024), (16, 4, 256), (16, 4, 4096),
                                      (32, 4, 4096), (16, 2, 4096)]:
                npad = -(-n // 128) * 128
                chunks = k // base.bk
                sp = max(d for d in range(1, chunks + 1) if chunks % d == 0 and (d == 1 or npad // bn * d <= target))
                out.append(gemv_case(q, n, k, 1, dataclasses.replace(base, bn=bn, num_warps=warps, splits=sp)))
        for bn, warps in [(16, 4), (32, 4), (64, 4), (64, 8)]:
            base = G.choose_config(Q.Q4_K, 4096, 14336, 8)
            chunks = 14336 // base.bk
            sp = max(d for d in range(1, chunks + 1) if chunks % d == 0 and (d == 1 or 4096 // bn * d <= 1024))
            out.append(gemv_case(Q.Q4_K, 4096, 14336, 8, dataclasses.replace(base, bn=bn, num_warps=warps, splits=sp)))
        return out
    if name == "gemm":  # prefill GEMM tiles (f16 dequant) and the int8 GEMM's first GPU run, 512 x 4096 x 14336
        out = []
        for q in (Q.Q4_0, Q.Q4_K):
            for c in [(128, 128, 64, 8, 2), (128, 128, 64, 8, 3), (128, 128, 128, 8, 2), (128, 256, 64, 8, 2),
                      (64, 256, 64, 8, 2), (256, 128, 64, 8, 2), (128, 128, 32, 4, 2), (64, 128, 64, 4, 3)]:
                out.append(gemm_case(q, 4096, 14336, 512, M.GemmConfig(*c)))
        for q in (Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0):
            out.append(gemm_int8_case(q, 4096, 14336, 512))
        for c in [(64, 128, 4, 1), (128, 64, 8, 1), (128, 128, 8, 2)]:
            out.append(gemm_int8_case(Q.Q4_K, 4096, 14336, 512, M8.Int8GemmConfig(*c)))
        return out
    if name == "s3":  # unsplit integer GEMV tiles (no split-K reduction), GEMM operand order and tiles
        out = []
        for q in (Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0):
            base = G.choose_config(q, 4096, 14336, 1)
            group = int8_words.SPECS[q].group
            out.append(gemv_case(q, 4096, 14336, 1, base))
            for bn, gt, warps in [(4, 32, 2), (8, 32, 4), (8, 16, 2), (4, 16, 2), (16, 16, 4), (8, 32, 2)]:
                out.append(gemv_case(q, 4096, 14336, 1, dataclasses.replace(base, bn=bn, bk=gt * group, splits=1,
                                                                            num_warps=warps)))
        for q, cfgs in [(Q.Q4_0, [(128, 128, 64, 8, 3), (128, 128, 128, 8, 2), (128, 64, 64, 4, 3), (64, 128, 64, 4, 4)]),
                        (Q.Q4_K, [(128, 128, 128, 8, 2), (128, 128, 128, 8, 3), (128, 64, 128, 4, 3)]),
                        (Q.F16, [(128, 128, 64, 8, 2), (128, 128, 64, 8, 3)]),
                        (Q.Q8_0, [(128, 128, 64, 8, 3)]), (Q.Q6_K, [(128, 128, 128, 8, 2)])]:
            out += [gemm_case(q, 4096, 14336, 512, M.GemmConfig(*c)) for c in cfgs]
        return out
    if name == "s4":  # GEMM tiles per format (the atomic split-K GEMV cases of this set were dropped with the option)
        out = []
        for q, cfgs in [(Q.F16, [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3)]),
                        (Q.BF16, [(128, 128, 64, 8, 3)]), (Q.F32, [(128, 128, 64, 8, 3), (128, 128, 32, 8, 3)]),
                        (Q.Q4_0, [(128, 64, 64, 4, 3), (128, 64, 64, 4, 4), (128, 64, 128, 4, 3), (256, 64, 64, 8, 3),
                                  (128, 128, 64, 8, 4), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3)]),
                        (Q.Q4_K, [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 64, 128, 4, 4),
                                  (256, 128, 128, 8, 3), (128, 128, 256, 8, 2), (128, 64, 256, 4, 3)]),
                        (Q.Q8_0, [(128, 64, 64, 4, 3), (128, 128, 64, 8, 4)]),
                        (Q.Q6_K, [(128, 128, 128, 8, 3), (128, 64, 128, 4, 3)]),
                        (Q.Q5_0, [(128, 64, 64, 4, 3), (128, 128, 64, 8, 4)]),
                        (Q.Q4_1, [(128, 64, 64, 4, 3)]), (Q.Q5_1, [(128, 64, 64, 4, 3)]),
                        (Q.Q2_K, [(128, 128, 128, 8, 3)]), (Q.Q3_K, [(128, 128, 128, 8, 3)]),
                        (Q.Q5_K, [(128, 128, 128, 8, 3)])]:
            out += [gemm_case(q, 4096, 14336, 512, M.GemmConfig(*c)) for c in cfgs]
        return out
    if name == "s5":  # dequantize-then-GEMM vs decode-in-GEMM by token count; dequant tiles; K-quant bk 256
        out = []
        for q in (Q.Q4_K, Q.Q4_0, Q.Q6_K):
            out += [dequant_case(q, 4096, 14336, D.DequantConfig(*c)) for c in
                    [(32, 512, 4), (64, 256, 4), (16, 1024, 4), (64, 512, 8), (128, 256, 8), (32, 256, 4)]]
        for q in (Q.Q4_K, Q.Q4_0):
            for m in (16, 32, 64, 128, 256, 512):
                out += [variant_case(q, 4096, 14336, m, "f16"), variant_case(q, 4096, 14336, m, "dequant")]
        for q in (Q.Q4_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.Q5_K):
            out.append(gemm_case(q, 4096, 14336, 512, M.GemmConfig(128, 128, 256, 8, 2)))
        return out
    if name == "s6":  # 7B ffn_down (K = 18944 = 74 super-blocks): steps x splits
        out = []
        for q in (Q.Q4_K, Q.Q6_K):
            group = int8_words.SPECS[q].group
            for gt, sp in [(16, 1), (4, 4), (16, 37), (8, 37), (8, 2), (16, 2), (4, 37)]:
                if (18944 // group) % (gt * sp) == 0:
                    out.append(gemv_case(q, 3584, 18944, 1, G.GemvConfig(bn=16, bk=gt * group, splits=sp)))
            out.append(gemv_case(q, 3584, 18944, 1, G.GemvConfig(bn=32, bk=16 * group, splits=37)))
        return out
    if name == "s7":  # one step per program (straight-line, no K loop) vs the 1024-program rule
        out = []
        for q, n, k in [(Q.Q4_0, 4096, 14336), (Q.Q4_K, 4096, 14336), (Q.Q8_0, 4096, 14336), (Q.Q6_K, 4096, 14336),
                        (Q.Q4_K, 14336, 4096), (Q.Q4_K, 3584, 3584), (Q.Q5_0, 9728, 896)]:
            base = G.choose_config(q, n, k, 1)
            group = int8_words.SPECS[q].group
            chunks = k // group // 16
            out.append(gemv_case(q, n, k, 1, base))
            for bn, sp in [(16, chunks), (32, chunks), (16, chunks // 2)]:
                if sp >= 1 and chunks % sp == 0:
                    out.append(gemv_case(q, n, k, 1, G.GemvConfig(bn=bn, bk=16 * group, splits=sp)))
        return out
    if name == "s8":  # not yet run: one step per program for nt = 2..8 (the rule that won for one token)
        out = []
        for q, n, k in [(Q.Q4_0, 4096, 14336), (Q.Q4_K, 4096, 14336), (Q.Q6_K, 4096, 14336), (Q.Q8_0, 4096, 14336),
                        (Q.Q4_K, 3584, 18944), (Q.Q4_K, 3584, 3584)]:
            group = int8_words.SPECS[q].group
            chunks = k // group // 16
            for nt in (2, 8):
                out.append(gemv_case(q, n, k, nt, G.choose_config(q, n, k, nt)))
                for bn, warps in [(16, 4), (32, 4), (64, 8)]:
                    out.append(gemv_case(q, n, k, nt, G.GemvConfig(bn=bn, bk=16 * group, splits=chunks, num_warps=warps)))
        return out
    if name == "s9":  # x quantized before the kernel; (run with coarse planes as blocks too: no gain, removed); Q6_K wider steps
        out = []
        R = dataclasses.replace
        for q in (Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0):
            group = int8_words.SPECS[q].group
            chunks = 14336 // group // 16
            for nt in (2, 8):
                base = G.choose_config(q, 4096, 14336, nt)
                one = G.GemvConfig(bn=32, bk=16 * group, splits=chunks)
                out += [gemv_case(q, 4096, 14336, nt, c) for c in
                        (base, R(base, prequant=True), one, R(one, prequant=True))]
        for q, n, k in [(Q.Q4_K, 4096, 14336), (Q.Q6_K, 4096, 14336), (Q.Q5_K, 4096, 14336), (Q.Q2_K, 4096, 14336),
                        (Q.Q4_K, 14336, 4096), (Q.Q4_K, 3584, 18944), (Q.Q6_K, 3584, 18944)]:
            base = G.choose_config(q, n, k, 1)
            out += [gemv_case(q, n, k, 1, c) for c in (base, R(base, prequant=True))]
        for bn in (8, 16, 32):  # Q6_K: 32 groups (512 weights) per step
            out.append(gemv_case(Q.Q6_K, 4096, 14336, 1, G.GemvConfig(bn=bn, bk=512, splits=28)))
        return out
    if name == "s10":  # one token: the 512-weight step rule, with x quantized in the kernel vs before it
        out = []
        R = dataclasses.replace
        for q in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            base = G.choose_config(q, 4096, 14336, 1)
            out += [gemv_case(q, 4096, 14336, 1, c) for c in (base, R(base, prequant=True))]
        for bn in (16, 64):
            out.append(gemv_case(Q.Q5_0, 4096, 14336, 1, R(G.choose_config(Q.Q5_0, 4096, 14336, 1), bn=bn,
                                                            splits=28, prequant=True)))
        for q, n, k in [(Q.Q4_K, 1152, 896), (Q.Q4_K, 9728, 896), (Q.Q6_K, 896, 4864), (Q.Q8_0, 151936, 896)]:
            base = G.choose_config(q, n, k, 1)  # 0.5B shapes (fused qkv, fused gate/up, ffn_down, head)
            out += [gemv_case(q, n, k, 1, c) for c in (base, R(base, prequant=True))]
        return out
    if name == "s11":  # distinct x per call (no CSE of quantize_x): nt > 1 prequant; nt = 1 tiles for Q4_K / Q5_0
        out = []
        R = dataclasses.replace
        for q in (Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0):
            for nt in (2, 8):
                base = G.choose_config(q, 4096, 14336, nt)
                out += [gemv_case(q, 4096, 14336, nt, c) for c in (base, R(base, prequant=not base.prequant))]
        for q in (Q.Q4_K, Q.Q5_0):
            base = G.choose_config(q, 4096, 14336, 1)
            out.append(gemv_case(q, 4096, 14336, 1, base))
            for bn, w in [(32, 2), (32, 8), (16, 2), (16, 4), (64, 4), (64, 8)]:
                out.append(gemv_case(q, 4096, 14336, 1, R(base, bn=bn, num_warps=w, splits=28)))
        return out
    raise SystemExit(f"unknown case set {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("caseset")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    path = os.path.join(a.out, "kernels.jsonl")
    for kind, qt, n, k, nt, f, r, cfg in cases(a.caseset):
        t0 = time.time()
        try:
            res = run_case(qt, n, k, nt, f, r, impl=kind, reps=a.reps)
            d = dataclasses.asdict(res)
            d["config"] = str(cfg)
            print(f"{kind} {qt.name:5s} {n:6d}x{k:6d} nt={nt:4d} {res.us:9.2f} us {res.gbps:8.1f} GB/s "
                  f"{res.tflops:7.2f} TF/s err={res.rel_err:.1e} compile={res.compile_s:.1f}s {cfg}", flush=True)
        except Exception as e:  # keep going: one failing lowering must not hide the others
            d = {"kind": kind, "qtype": qt.name, "n": n, "k": k, "nt": nt, "error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{kind} {qt.name} {n}x{k} nt={nt} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
        d["wall_s"] = time.time() - t0
        with open(path, "a") as fh:
            fh.write(json.dumps(d) + "\n")


if __name__ == "__main__":
    main()
