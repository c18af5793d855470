"""What generate() itself achieves beside bench.py: a long prompt's prefill, decode through the
host loop, and peak device memory against weights + KV cache (issue 15/16 acceptance figures).

    PYTHONPATH=. python tools/engine_check.py --synthetic qwen2.5-7b:q4_k_m --ctx 32768 --prompt 32000 --gen 128
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
    a = ap.parse_args()
    gm = synthetic_model(a.synthetic)
    m = minfer_jax.load(gguf_model=gm, ctx_size=a.ctx, prefill_chunk=a.ubatch)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    rows = {}
    for name, n in (("short", a.short), ("long", a.prompt)):
        ids = [int(t) for t in rng.integers(0, vocab, n)]
        minfer_jax.generate(m, ids, max_new_tokens=a.gen)  # compiles
        r = minfer_jax.generate(m, ids, max_new_tokens=a.gen)
        rows[name] = dict(prompt=n, generated=len(r.tokens), prefill_tps=r.prefill_tps, decode_tps=r.decode_tps,
                          prefill_s=r.prefill_s, decode_s=r.decode_s)
    stats = jax.devices()[0].memory_stats() or {}
    plan = m.plan()
    rows["memory"] = dict(peak_bytes=stats.get("peak_bytes_in_use"), weight_bytes=m.weight_nbytes,
                          kv_cache_bytes=cache_nbytes(m.config, plan.n_slots, plan.cache_len, m.cache_dtype))
    mem = rows["memory"]
    if mem["peak_bytes"]:
        mem["workspace_bytes"] = mem["peak_bytes"] - mem["weight_bytes"] - mem["kv_cache_bytes"]
    print(json.dumps({"model": a.synthetic, "ctx": a.ctx, "chunk": m.chunk, **rows}, indent=1))


if __name__ == "__main__":
    main()
