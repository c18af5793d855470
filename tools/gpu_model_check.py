"""GPU check of the whole model through the Pallas kernels (one device call).

1. Greedy tokens of a small synthetic model: Pallas path == XLA reference path.
2. Synthetic Qwen2.5 0.5B / 7B Q4_K_M: pp512 and tg128 tokens/s, each timed around one
   compiled executable after warm-up (superseded for reporting by scripts/bench.py).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import minfer_jax
from minfer_jax.sampling import GREEDY
from minfer_jax.synthetic import synthetic_model


def greedy_parity(spec, layers, n=24):
    gm = synthetic_model(spec, layers=layers, seed=3)
    prompt = list(np.random.default_rng(0).integers(0, gm.config.vocab_size, 40))
    toks = {}
    for kernels in ("pallas", "xla"):
        m = minfer_jax.load(gguf_model=gm, kernels=kernels, weights="quantized", ctx_size=256)
        r = minfer_jax.generate(m, prompt, max_new_tokens=n)
        toks[kernels] = r.tokens
        lg = m.logits(prompt[:20])
        toks[kernels + "_logits"] = lg
    same = toks["pallas"] == toks["xla"]
    err = float(np.max(np.abs(toks["pallas_logits"] - toks["xla_logits"])))
    print(f"parity {spec} layers={layers}: greedy identical={same} max|dlogit|={err:.2e}", flush=True)
    if not same:
        print(" pallas", toks["pallas"], "\n xla   ", toks["xla"], flush=True)


def speed(spec, pp=512, tg=128, reps=3):
    gm = synthetic_model(spec, seed=1)
    m = minfer_jax.load(gguf_model=gm, kernels="pallas", ctx_size=1024)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, gm.config.vocab_size, pp), jnp.int32)
    key = jax.random.PRNGKey(0)
    hist = jnp.zeros((0,), jnp.int32)
    exe, c1 = m.prefill_executable(pp, 1024, GREEDY)
    dexe, c2 = m.decode_executable(tg, 1024, GREEDY)
    best_p = best_d = 1e9
    for _ in range(reps):
        cache = m.new_cache(1024)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        tok, _, cache = exe(m.params, cache, ids, jnp.int32(0), jnp.int32(pp), key, hist)
        jax.block_until_ready(tok)
        best_p = min(best_p, time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = dexe(m.params, cache, tok, jnp.int32(pp), key, hist)
        jax.block_until_ready(out)
        best_d = min(best_d, time.perf_counter() - t0)
    wb = m.weight_nbytes
    print(f"speed {spec}: weights {wb/1e6:.0f} MB  pp{pp} {pp/best_p:9.1f} t/s  tg{tg} {tg/best_d:8.1f} t/s "
          f"({wb*tg/best_d/1e9:.0f} GB/s)  compile {c1:.1f}+{c2:.1f} s", flush=True)


if __name__ == "__main__":
    print(jax.devices(), jax.__version__, flush=True)
    what = sys.argv[1:] or ["parity", "speed"]
    if "parity" in what:
        greedy_parity("qwen2.5-0.5b:q4_k_m", 2)
        greedy_parity("qwen2.5-0.5b:q8_0", 2)
    if "speed" in what:
        speed("qwen2.5-0.5b:q4_k_m")
        speed("qwen2.5-7b:q4_k_m")
