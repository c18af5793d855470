"""Which matmul inputs' int8 quantization moves a model's greedy token off the float64 top-1.

The decode GEMV quantizes x to int8, one scale per 32 inputs (llama.cpp's q8_1 idea; in two
terms with gemv_tuning.NORM_X_TERMS = 2). This emulates that in the float64 forward
(tests/float64_reference.py) at chosen matmul inputs and counts, over the greedy tokens of the
XLA path (which agree with float64), the steps where the emulated top-1 differs from float64's,
and how many of them at a float64 top-2 gap above --gap. It needs no GPU: it tells which inputs
need a finer x before a kernel is changed. Sites: qkv, o, gateup, down, head; "site2" quantizes
that site in two terms.

    python tools/x_quant_emulation.py -m MODEL.gguf --gen 64 \\
        --variants all=qkv,o,gateup,down,head norm2=qkv2,o,gateup2,down,head2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import minfer_jax  # noqa: E402
from minfer_jax.files.gguf import load_gguf  # noqa: E402
from tests import float64_reference  # noqa: E402
from tools.engine_check import NATURAL_PROMPTS  # noqa: E402

GROUP = 32
SITES = ("qkv", "o", "gateup", "down", "head")


def int8_groups(x: np.ndarray, terms: int = 1) -> np.ndarray:
    """x [..., K] as int8 with one scale (max / 127) per GROUP inputs, rounded to nearest, in
    `terms` terms (each quantizing what the ones before left)."""
    rest, out = x, np.zeros_like(x)
    for _ in range(terms):
        blocks = rest.reshape(*rest.shape[:-1], -1, GROUP)
        scale = np.abs(blocks).max(-1, keepdims=True) / 127
        scale = np.where(scale == 0, 1, scale)
        term = (np.round(blocks / scale) * scale).reshape(rest.shape)
        out, rest = out + term, rest - term
    return out


def quantizer(sites: set[str]):
    """The x_quant hook of float64_reference.forward for these sites ("site" or "site2")."""

    def x_quant(site: str, x: np.ndarray) -> np.ndarray:
        if site + "2" in sites:
            return int8_groups(x, 2)
        return int8_groups(x) if site in sites else x

    return x_quant


def parse_variant(text: str) -> tuple[str, set[str]]:
    name, _, sites = text.partition("=")
    chosen = {s for s in sites.split(",") if s}
    unknown = {s.removesuffix("2") for s in chosen} - set(SITES)
    if not name or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=SITE,... with sites from {', '.join(SITES)} (or SITE2)"
        )
    return name, chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="a GGUF file of a supported family")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--gap", type=float, default=0.02, help="float64 top-2 gap that counts")
    ap.add_argument(
        "--variants",
        nargs="+",
        type=parse_variant,
        default=[parse_variant("all=" + ",".join(SITES))],
        metavar="NAME=SITE,...",
    )
    a = ap.parse_args(argv)
    gm = load_gguf(a.model)
    m = minfer_jax.load(gguf_model=gm, ctx_size=1024, kernels="xla")
    prompts = [m.tokenizer.encode(t) for t in NATURAL_PROMPTS]
    runs = [minfer_jax.generate(m, p, max_new_tokens=a.gen).tokens for p in prompts]
    out: dict = {"model": a.model, "steps": sum(map(len, runs)), "gap": a.gap}
    for name, _ in a.variants:
        out[name] = dict(differ=0, differ_past_gap=0, cases=[])
    for i, (p, toks) in enumerate(zip(prompts, runs)):
        ref = float64_reference.forward(gm, p + toks)
        for name, sites in a.variants:
            got = float64_reference.forward(gm, p + toks, quantizer(sites))
            for j in range(len(toks)):
                row, emulated = ref[len(p) + j - 1], got[len(p) + j - 1]
                if emulated.argmax() == row.argmax():
                    continue
                top2 = np.sort(row)[-2:]
                gap = float(top2[1] - top2[0])
                res = out[name]
                res["differ"] += 1
                res["differ_past_gap"] += gap > a.gap
                res["cases"].append(dict(prompt=i, step=j, f64_top2_gap=gap))
        print(f"prompt {i} done", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
