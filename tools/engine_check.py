"""What generate() itself achieves beside bench.py: a long prompt's prefill, decode through the
host loop, and peak device memory against weights + KV cache (issue 15/16 acceptance figures).

    PYTHONPATH=. python tools/engine_check.py --synthetic qwen2.5-7b:q4_k_m --ctx 32768 --prompt 32000 --gen 128
    PYTHONPATH=. python tools/engine_check.py --synthetic qwen2.5-0.5b:q4_k_m --layers 2 --parity 2500

--parity N: greedy tokens of an N-token prompt through the Pallas kernels against the XLA
reference path (same quantized weights); a divergence is reported with the reference's top-2
logit gap at that position (a near-tie when the gap is below the paths' logit difference).
--batched B,...: llama-batched-bench rows (-npp 512 -ntg 128) on the same loaded model.
--batch-parity B: B prompts decoded as one batch through the kernels (B > 8: the split GEMM)
against each alone (B = 1: the GEMV); per row the identical prefix and, at a divergence, the
lone run's top-2 logit gap (issue 16: each sequence's greedy tokens alone or batched).
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import minfer_jax
from minfer_jax.bench.synthetic import synthetic_model
from minfer_jax.model.cache import cache_nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--prompt", type=int, required=True, help="tokens of the long prompt")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--short", type=int, default=16, help="tokens of the short prompt (decode speed)")
    ap.add_argument("--ubatch", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--parity", type=int, default=0, metavar="N")
    ap.add_argument("--batched", default="", metavar="B,...")
    ap.add_argument("--batch-parity", type=int, default=0, metavar="B")
    a = ap.parse_args()
    gm = synthetic_model(a.synthetic, layers=a.layers)
    if a.batch_parity:
        print(json.dumps(batch_parity(gm, a.batch_parity, a.gen, a.ctx), indent=1), flush=True)
        return
    if a.parity:
        print(json.dumps(parity(gm, a.parity, a.gen), indent=1), flush=True)
        return
    m = minfer_jax.load(gguf_model=gm, ctx_size=a.ctx, prefill_chunk=a.ubatch)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    rows = {}
    for name, n in (("short", a.short), ("long", a.prompt)):
        warm, ids = ([int(t) for t in rng.integers(0, vocab, n)] for _ in range(2))  # distinct: no prefix reuse
        minfer_jax.generate(m, warm, max_new_tokens=a.gen)  # compiles
        r = minfer_jax.generate(m, ids, max_new_tokens=a.gen)
        assert r.cached_tokens == 0, r.cached_tokens
        rows[name] = dict(prompt=n, generated=len(r.tokens), prefill_tps=r.prefill_tps, decode_tps=r.decode_tps,
                          prefill_s=r.prefill_s, decode_s=r.decode_s)
    stats = jax.devices()[0].memory_stats() or {}
    plan = m.plan()
    rows["memory"] = dict(peak_bytes=stats.get("peak_bytes_in_use"), weight_bytes=m.weight_nbytes,
                          kv_cache_bytes=cache_nbytes(m.config, plan.n_slots, plan.cache_len, m.cache_dtype))
    mem = rows["memory"]
    if mem["peak_bytes"]:
        mem["workspace_bytes"] = mem["peak_bytes"] - mem["weight_bytes"] - mem["kv_cache_bytes"]
    print(json.dumps({"model": a.synthetic, "ctx": a.ctx, "chunk": m.chunk, **rows}, indent=1), flush=True)
    if a.batched:
        from minfer_jax.bench import batched

        batched.run(m, a.synthetic, [512], [128], [int(b) for b in a.batched.split(",")], seed=0, out_files=[],
                    log=lambda s: None)


def parity(gm, n: int, gen: int) -> dict:
    """Greedy tokens of an n-token prompt, kernels vs the XLA path, and the first divergence's margin."""
    ctx = n + gen + 16
    kern = minfer_jax.load(gguf_model=gm, ctx_size=ctx, kernels="pallas", weights="quantized")
    ref = minfer_jax.load(gguf_model=gm, ctx_size=ctx, kernels="xla", weights="quantized")
    ids = [int(t) for t in np.random.default_rng(1).integers(0, gm.config.vocab_size, n)]
    a = minfer_jax.generate(kern, ids, max_new_tokens=gen).tokens
    b = minfer_jax.generate(ref, ids, max_new_tokens=gen).tokens
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    out = dict(prompt=n, generated=len(a), identical_prefix=same, identical=a == b)
    seq = ids + b[:same + 1]
    lk, lr = kern.logits(seq)[n - 1:], ref.logits(seq)[n - 1:]
    out["max_abs_logit_diff"] = float(np.max(np.abs(lk - lr)))
    if same < len(a):
        top2 = np.sort(lr[same])[-2:]
        out["ref_top2_gap_at_divergence"] = float(top2[1] - top2[0])
    return out


def batch_parity(gm, n_seqs: int, gen: int, ctx: int, kernels: str = "pallas") -> dict:
    """Greedy tokens of n_seqs random prompts (5 .. 64 tokens) batched vs alone, both through the kernels."""
    m = minfer_jax.load(gguf_model=gm, ctx_size=ctx, kernels=kernels, weights="quantized")
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, gm.config.vocab_size, int(rng.integers(5, 65)))]
               for _ in range(n_seqs)]
    batch = minfer_jax.generate_batch(m, prompts, max_new_tokens=gen)
    rows = []
    for p, r in zip(prompts, batch):
        alone = minfer_jax.generate(m, p, max_new_tokens=gen).tokens
        same = next((i for i, (x, y) in enumerate(zip(r.tokens, alone)) if x != y), min(len(r.tokens), len(alone)))
        row = dict(prompt=len(p), identical_prefix=same, identical=r.tokens == alone)
        if not row["identical"] and same < len(alone):
            top2 = np.sort(np.asarray(m.logits(p + alone[:same]))[-1])[-2:]
            row["alone_top2_gap_at_divergence"] = float(top2[1] - top2[0])
        rows.append(row)
    return dict(n_seqs=n_seqs, generated=gen, identical_rows=sum(r["identical"] for r in rows), rows=rows)


if __name__ == "__main__":
    main()
