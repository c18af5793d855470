"""Dump the PTX of the Pallas kernels (run on the GPU with XLA_FLAGS=--xla_dump_to=DIR) and summarize it.

usage: XLA_FLAGS=--xla_dump_to=/tmp/dump python tools/ptx_dump.py /tmp/dump OUTDIR [gemv|gemm|summary]
  gemv: compile the integer GEMV (nt 1 and 8) and both float paths; gemm: the GEMM at its
  default and a narrow tile (does Triton emit wgmma or mma.sync?); summary: only summarize what DIR holds.
"""

import collections
import dataclasses
import glob
import os
import re
import sys

import jax

from minfer_jax.kernel_bench import random_planes
from minfer_jax.pallas import gemm as M
from minfer_jax.pallas import gemv as G
from minfer_jax.quant.planes import QType as Q


def compile_gemv():
    for q in (Q.Q4_0, Q.Q4_K, Q.F16):
        w = random_planes(jax.random.PRNGKey(1), q, 4096, 14336)
        for nt in (1, 8):  # block formats: the integer kernel; F16: fma (nt = 1) and the dot
            x = jax.random.normal(jax.random.PRNGKey(0), (nt, 14336))
            base = G.choose_config(q, 4096, 14336, nt)
            cfgs = (base, dataclasses.replace(base, fma=False)) if q == Q.F16 and nt == 1 else (base,)
            for cfg in cfgs:
                G.gemv(x, w, qtype=q, n_out=4096, config=cfg).block_until_ready()


def compile_gemm():
    for q in (Q.Q4_0, Q.Q4_K, Q.F16):
        w = random_planes(jax.random.PRNGKey(1), q, 4096, 14336)
        x = jax.random.normal(jax.random.PRNGKey(0), (512, 14336))
        base = M.choose_config(q, 512, 4096, 14336)
        for cfg in (base, dataclasses.replace(base, bn=64, num_warps=4)):
            M.gemm(x, w, qtype=q, n_out=4096, config=cfg).block_until_ready()


def summarize(dump, out, pattern):
    files = glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)
    print("ptx files:", len(files))
    kept = 0
    for f in files:
        text = open(f).read()
        for m in re.finditer(r"\.visible \.entry (\w*" + pattern + r"\w*)\((.*?)\n\}\n", text, re.S):
            name, body = m.group(1), m.group(0)
            ops = collections.Counter(re.findall(r"^\s+(?:@%p\d+ )?([a-z][\w.]*)", body, re.M))
            total = sum(ops.values())
            print(f"== {name} ({total} instructions)")
            print("  ", ", ".join(f"{k}:{v}" for k, v in ops.most_common(40)))
            if kept < 6:
                with open(os.path.join(out, f"{name[:60]}_{kept}.ptx"), "w") as fh:
                    fh.write(body)
                kept += 1


def main(dump, out, mode="gemv"):
    if mode == "gemv":
        compile_gemv()
    elif mode == "gemm":
        compile_gemm()
    summarize(dump, out, mode if mode in ("gemv", "gemm") else "gem")


if __name__ == "__main__":
    main(*sys.argv[1:4])
