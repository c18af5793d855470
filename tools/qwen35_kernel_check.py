"""GPU: a synthetic qwen35 (minfer_bench.synthetic_qwen35) through the compiled kernels against
the XLA path: greedy tokens of generate() and the logits of every prompt position (the delta-rule
kernel in the prefill, the quantized-weight GEMV / GEMM routes around it, decode's recurrent step).

usage: PYTHONPATH=. python tools/qwen35_kernel_check.py [--name qwen35-tiny-v3-mtp] [--tokens 170]
           [--new 16] [--kernels pallas]
--name qwen35moe-tiny / qwen35moe-tiny:q8_0-experts: qwen35moe through its F32 / Q8_0 expert routes.

Prints PASS / FAIL: tokens equal and max |logit difference| < 2e-2 of the logit std (the kernels'
f16 / int8 activations). --kernels interpret runs the same on a CPU (minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

import minfer_jax

from minfer_bench.synthetic import write_gguf
from minfer_bench.synthetic_qwen35 import QWEN35_TINY, qwen35_model


def main() -> int:
    ap = argparse.ArgumentParser()
    names = sorted(QWEN35_TINY) + [
        f"{n}:q8_0-experts" for n, c in QWEN35_TINY.items() if c.n_experts
    ]
    ap.add_argument("--name", default="qwen35-tiny-v3-mtp", choices=names)
    ap.add_argument("--tokens", type=int, default=170)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--kernels", default="pallas", choices=("pallas", "interpret"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_gguf(qwen35_model(a.name), path, progress=False)
        ctx = a.tokens + a.new + 64
        kern = minfer_jax.load(path, kernels=a.kernels, weights="quantized", ctx_size=ctx)
        ref = minfer_jax.load(path, kernels="xla", weights="dense", ctx_size=ctx)
        prompt = np.random.default_rng(1).integers(0, 320, a.tokens).tolist()
        got = minfer_jax.generate(kern, prompt, max_new_tokens=a.new).tokens
        want = minfer_jax.generate(ref, prompt, max_new_tokens=a.new).tokens
        lk, lr = np.asarray(kern.logits(prompt + want)), np.asarray(ref.logits(prompt + want))
    err = float(np.abs(lk - lr).max() / lr.std())
    ok = got == want and err < 2e-2
    print(
        f"{a.name} {a.kernels}: tokens {'equal' if got == want else f'{got} != {want}'}, "
        f"max |logit diff| {err:.2e} x std: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
