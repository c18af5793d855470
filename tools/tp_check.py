#!/usr/bin/env python
"""Tensor parallelism on the GPUs of one host: greedy tokens against TP 1, tg / pp per degree.

    PYTHONPATH=. python tools/tp_check.py --model qwen2.5-7b:q4_k_m --tp 1 2 4 --out $OUT/tp.md

Loads the synthetic model once per degree (load(tensor_parallel=N)), runs a pp-token prompt and
tg generated tokens through generate(), and writes a markdown table (tokens/s, scaling efficiency
= t/s at N / (N x t/s at TP 1), whether the greedy tokens equal TP 1's) plus the raw rows as JSON.
"""

import argparse
import json
import sys

import jax

import minfer_jax

from minfer_bench.synthetic import synthetic_model


def run(spec: str, tp: int, pp: int, tg: int, layers: int | None) -> dict:
    gm = synthetic_model(spec, layers=layers)
    model = minfer_jax.load(gguf_model=gm, ctx_size=pp + tg + 64, tensor_parallel=tp)
    prompt = [(7 * i + 3) % gm.config.vocab_size for i in range(pp)]
    warm = [
        (7 * i + 4) % gm.config.vocab_size for i in range(pp)
    ]  # no shared prefix: timed without reuse
    minfer_jax.generate(model, warm, max_new_tokens=tg)  # compile
    res = minfer_jax.generate(model, prompt, max_new_tokens=tg)
    return {
        "tp": tp,
        "pp_tps": res.prefill_tps,
        "tg_tps": res.decode_tps,
        "tokens": res.tokens,
        "weight_gib": model.weight_nbytes / 2**30,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-7b:q4_k_m")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = [run(a.model, tp, a.pp, a.tg, a.layers) for tp in a.tp]
    base = rows[0]
    lines = [
        f"{a.model}, {len(jax.devices())} x {jax.devices()[0].device_kind}, pp{a.pp} / tg{a.tg}",
        "",
        "| TP | pp t/s | tg t/s | tg scaling eff. | weights GiB (all shards) "
        f"| tokens == TP {base['tp']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        eff = r["tg_tps"] / (r["tp"] / base["tp"] * base["tg_tps"])
        lines.append(
            f"| {r['tp']} | {r['pp_tps']:.0f} | {r['tg_tps']:.1f} | {eff:.2f} | "
            f"{r['weight_gib']:.2f} | {r['tokens'] == base['tokens']} |"
        )
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f)
    print("\n".join(lines))
    return 0 if all(r["tokens"] == base["tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
