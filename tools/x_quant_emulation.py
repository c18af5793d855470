"""Which matmul inputs' int8 quantization moves a model's greedy token off the float64 top-1.

The decode GEMV quantizes x to int8, one scale per 32 inputs (llama.cpp's q8_1 idea; in two
terms in the precise mode, ops.Impl.precise). This emulates that in the float64 forward
(minfer_bench/float64_reference.py) at chosen matmul inputs and counts, over the greedy tokens of
the
XLA path (which agree with float64), the steps where the emulated top-1 differs from float64's,
and how many of them at a float64 top-2 gap above --gap. It needs no GPU: it tells which inputs
need a finer x before a kernel is changed. Sites: qkv, o, gateup, down, head; a suffix picks a
scheme other than the kernels' (SCHEMES): "qkv2" two terms, "qkvg16" a scale per 16 inputs,
"qkvo4" a second term in the 4 groups of largest scale only.

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
from minfer_jax.model.from_gguf import load_gguf  # noqa: E402
from tools.engine_check import NATURAL_PROMPTS  # noqa: E402

from minfer_bench import float64_reference  # noqa: E402

GROUP = 32
SITES = ("qkv", "o", "gateup", "down", "head")


def int8_groups(
    x: np.ndarray,
    terms: int = 1,
    group: int = GROUP,
    second_in: int | None = None,
    outlier: float | None = None,
    step: int = 8,
    share: list | None = None,
) -> np.ndarray:
    """x [..., K] as int8 with one scale (max / 127) per `group` inputs, rounded to nearest, in
    `terms` terms (each quantizing what the ones before left). second_in: the second term only in
    that many groups of each row, those of the largest first-term scale (x is one vector shared by
    every output row, so a kernel could pick them once per call). outlier: the second term only in
    the steps of `step` groups (a GEMV program's share of K) that hold a group whose max exceeds
    `outlier` x the row's RMS (a kernel can skip the rest). share: gets the fraction of groups
    given a second term appended."""
    rest, out = x, np.zeros_like(x)
    for t in range(terms):
        blocks = rest.reshape(*rest.shape[:-1], -1, group)
        scale = np.abs(blocks).max(-1, keepdims=True) / 127
        scale = np.where(scale == 0, 1, scale)
        term = np.round(blocks / scale) * scale
        if t == 0:
            first_scale = scale[..., 0]
        elif outlier is not None:  # whole steps of `step` groups, where one group is an outlier
            rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
            hot = first_scale * 127 > outlier * rms  # [..., G]
            steps = np.arange(hot.shape[-1]) // step
            hot_step = np.stack([hot[..., steps == i].any(-1) for i in range(steps[-1] + 1)], -1)
            term = term * hot_step[..., steps][..., None]
            second = hot_step[..., steps]
        elif second_in is not None:
            keep = np.argsort(-first_scale, axis=-1)[..., :second_in]
            mask = np.zeros(first_scale.shape, bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            term = term * mask[..., None]
            second = mask
        else:
            second = np.ones(first_scale.shape, bool)
        if t == 1 and share is not None:
            share.append(float(second.mean()))
        term = term.reshape(rest.shape)
        out, rest = out + term, rest - term
    return out


SCHEMES = {
    "": dict(),  # one term, groups of 32 (the kernels)
    "2": dict(terms=2),  # two terms (the precise mode's GEMVs)
    "g16": dict(group=16),  # one term, a scale per 16
    "o4": dict(terms=2, second_in=4),  # a second term in the 4 groups of largest scale
    "o16": dict(terms=2, second_in=16),
    "t6": dict(terms=2, outlier=6.0),  # a second term in the 8-group steps holding a max > 6 RMS
    "t8": dict(terms=2, outlier=8.0),
    "t12": dict(terms=2, outlier=12.0),
    "t8s4": dict(terms=2, outlier=8.0, step=4),
}


def quantizer(sites: set[str], shares: dict | None = None):
    """The x_quant hook of float64_reference.forward for these sites (SITE + a SCHEMES key);
    shares (optional): site -> list of the second term's share of groups, one per call."""
    chosen = dict(_split(s) for s in sites)

    def x_quant(site: str, x: np.ndarray) -> np.ndarray:
        if site not in chosen:
            return x
        share = None if shares is None else shares.setdefault(site, [])
        return int8_groups(x, **SCHEMES[chosen[site]], share=share)

    return x_quant


def _split(text: str) -> tuple[str, str]:
    site = next((s for s in SITES if text.startswith(s)), "")
    return site, text[len(site) :]


def parse_variant(text: str) -> tuple[str, set[str]]:
    name, _, sites = text.partition("=")
    chosen = {s for s in sites.split(",") if s}
    bad = {s for s in chosen if not _split(s)[0] or _split(s)[1] not in SCHEMES}
    if not name or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=SITE,... with sites from {', '.join(SITES)}, each with an"
            f" optional scheme suffix from {', '.join(k for k in SCHEMES if k)}"
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
    shares: dict = {name: {} for name, _ in a.variants}
    for name, _ in a.variants:
        out[name] = dict(differ=0, differ_past_gap=0, cases=[])
    for i, (p, toks) in enumerate(zip(prompts, runs)):
        ref = float64_reference.forward(gm, p + toks)
        for name, sites in a.variants:
            got = float64_reference.forward(gm, p + toks, quantizer(sites, shares[name]))
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
    for name, _ in a.variants:  # how much of the dp4a work a second term adds, per site
        out[name]["second_term_share"] = {
            site: round(float(np.mean(v)), 3) for site, v in sorted(shares[name].items()) if v
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
