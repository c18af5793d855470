"""GPU: the device timeline of unrolled matmul calls inside one executable (jax.profiler + CUPTI).

usage: python tools/gemv_timeline.py [--out DIR] [TYPE:OUTxIN:NT ...]   (default: ggml's nt = 1 rows)

For each case one executable runs R calls (each on its own weight copy, as kernel_bench.run_case);
one traced run is read back (kernel_bench.device_kernel_events) and every GPU kernel is listed with its
duration and the idle gap before it. The summary splits a call's cost into its kernels' time and
the gaps between them: what "time per call" is made of beyond the matmul kernel itself.
"""

import argparse
import collections
import os

import jax
import jax.numpy as jnp

from minfer_jax import kernel_bench as KB
from minfer_jax.quant.planes import QType

DEFAULT = ["Q4_0:4096x14336:1", "Q4_K:4096x14336:1", "Q4_K:4096x4096:1", "Q8_0:4096x14336:1", "Q6_K:4096x14336:1"]


def run(case, reps, out):
    q, shape, nt = case.split(":")
    n, k = (int(v) for v in shape.split("x"))
    qt, nt = QType[q], int(nt)
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * reps)
    weights = [KB.random_planes(kk, qt, n, k) for kk in keys[:reps]]
    xs = [jax.random.normal(kk, (nt, k), jnp.float32) for kk in keys[reps:]]
    mm = KB.dispatch_matmul(qt, n, k, "pallas")
    exe = jax.jit(lambda xs, ws: [mm(x, w) for x, w in zip(xs, ws)]).lower(xs, weights).compile()
    for _ in range(3):
        jax.block_until_ready(exe(xs, weights))
    kernels = KB.device_kernel_events(lambda: jax.block_until_ready(exe(xs, weights)))
    lines = [f"== {case}: {len(kernels)} device events"]
    by_name = collections.defaultdict(list)
    gaps = []
    prev_end = None
    for start, dur, name in kernels:
        gap = None if prev_end is None else (start - prev_end) / 1e3
        if gap is not None:
            gaps.append(gap)
        by_name[name[:60]].append(dur / 1e3)
        if len(lines) < 14:
            lines.append(f"  {name[:60]:60s} {dur / 1e3:8.2f} us  gap {'' if gap is None else f'{gap:6.2f}'}")
        prev_end = max(prev_end or 0, start + dur)
    span = (prev_end - kernels[0][0]) / 1e3 if kernels else 0.0
    for name, durs in by_name.items():
        lines.append(f"  kernel {name:60s} x{len(durs):3d}  mean {sum(durs) / len(durs):7.2f} us  min {min(durs):7.2f}")
    if gaps:
        lines.append(f"  gaps: mean {sum(gaps) / len(gaps):.2f} us, max {max(gaps):.2f}; span {span:.1f} us = "
                     f"{span / reps:.2f} us per call")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out, "timeline.txt"), "a") as fh:
        fh.write(text + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    for case in a.cases:
        run(case, a.reps, a.out)


if __name__ == "__main__":
    main()
