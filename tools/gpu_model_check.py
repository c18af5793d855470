"""GPU check of the whole model through the Pallas kernels (one device call).

1. Greedy tokens of a small synthetic model: Pallas path == XLA reference path.
2. Synthetic Qwen2.5 0.5B / 7B Q4_K_M: pp512 and tg128 tokens/s, each timed around one
   compiled executable after warm-up (superseded for reporting by scripts/bench.py).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import minfer_jax
from minfer_jax.sampling import GREEDY
from minfer_jax.bench.synthetic import synthetic_model


def with_fold(m, fold_norm: bool):
    """The loaded model with ops.Impl.fold_norm set (fresh executable cache)."""
    import dataclasses

    return dataclasses.replace(m, impl=dataclasses.replace(m.impl, fold_norm=fold_norm), _compiled={})


def greedy_parity(spec, layers, n=24, n_prompt=40, gemm="auto", fold_norm=False):
    """Greedy tokens and every prompt position's logits, Pallas path vs XLA reference path. On a
    divergence, the reference's top-2 logit gap at that step tells a near-tie (gap within the
    paths' logit difference: the argmax may flip) from a real mismatch."""
    gm = synthetic_model(spec, layers=layers, seed=3)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, gm.config.vocab_size, n_prompt)]
    models = {k: with_fold(minfer_jax.load(gguf_model=gm, kernels=k, weights="quantized", ctx_size=256, gemm=gemm),
                           fold_norm) for k in ("pallas", "xla")}
    toks = {k: list(minfer_jax.generate(m, prompt, max_new_tokens=n).tokens) for k, m in models.items()}
    lg = {k: np.asarray(m.logits(prompt)) for k, m in models.items()}  # the prefill matmuls at nt = n_prompt
    err = float(np.max(np.abs(lg["pallas"] - lg["xla"])))
    same = toks["pallas"] == toks["xla"]
    print(f"parity {spec} layers={layers} prompt={n_prompt} gemm={gemm}: greedy identical={same} "
          f"max|dlogit| over the prompt={err:.2e}", flush=True)
    if not same:
        i = next(j for j, (a, b) in enumerate(zip(toks["pallas"], toks["xla"])) if a != b)
        seq = prompt + toks["xla"][:i]
        ref, got = (np.asarray(models[k].logits(seq))[-1] for k in ("xla", "pallas"))
        top2 = np.sort(ref)[-2:]
        gap, d = float(top2[1] - top2[0]), float(np.max(np.abs(got - ref)))
        verdict = "near-tie (argmax within the logit difference)" if gap <= 2 * d else "MISMATCH"
        print(f"  first divergence at generated token {i}: reference top-2 gap {gap:.2e}, max|dlogit| there "
              f"{d:.2e}: {verdict}\n  pallas {toks['pallas']}\n  xla    {toks['xla']}", flush=True)


def speed(spec, pp=512, tg=128, reps=3, gemm="auto", fold_norm=False):
    gm = synthetic_model(spec, seed=1)
    m = with_fold(minfer_jax.load(gguf_model=gm, kernels="pallas", ctx_size=1024, gemm=gemm), fold_norm)
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
    from minfer_jax.pallas import gemv

    print(f"speed {spec} gemm={gemm} prequant_min_nt={gemv.PREQUANT_MIN_NT} fold_norm={m.impl.fold_norm}: weights {wb/1e6:.0f} MB  pp{pp} {pp/best_p:9.1f} t/s  tg{tg} {tg/best_d:8.1f} t/s "
          f"({wb*tg/best_d/1e9:.0f} GB/s)  compile {c1:.1f}+{c2:.1f} s", flush=True)


def decode_timeline(spec, tg=16, top=30):
    """One traced run of the tg-step decode executable: the kernels of one token, by name (count
    and device time per token), and the span per token; what a decode step is made of."""
    import collections

    from minfer_jax.bench.kernel_timing import device_kernel_events

    gm = synthetic_model(spec, seed=1)
    m = minfer_jax.load(gguf_model=gm, kernels="pallas", ctx_size=256)
    key, hist = jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32)
    dexe, _ = m.decode_executable(tg, 256, GREEDY)
    run = lambda: jax.block_until_ready(dexe(m.params, m.new_cache(256), jnp.int32(1), jnp.int32(8), key, hist))  # noqa: E731
    run()
    events = device_kernel_events(run)
    span = (max(s + d for s, d, _ in events) - events[0][0]) / 1e3
    by = collections.defaultdict(lambda: [0, 0.0])
    for _, d, name in events:
        by[name][0] += 1
        by[name][1] += d / 1e3
    busy = sum(v[1] for v in by.values())
    print(f"timeline {spec}: {len(events) / tg:.1f} kernels per token, span {span / tg:.1f} us per token, "
          f"kernels busy {busy / tg:.1f} us per token", flush=True)
    for name, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {c / tg:6.1f} x/token {t / tg:8.2f} us/token  {t / c:7.2f} us each  {name[:90]}", flush=True)


if __name__ == "__main__":
    # usage: gpu_model_check.py [parity] [speed] [speed05] [timeline05] [timeline7] [--gemm VARIANT] [--fold-norm on|off] [--prequant-min-nt N]
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["parity", "speed"])
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--fold-norm", choices=("on", "off"), default="off",
                    help="ops.Impl.fold_norm: RMSNorm folded into the decode GEMVs")
    ap.add_argument("--prequant-min-nt", type=int, default=None,
                    help="override pallas.gemv.PREQUANT_MIN_NT (token count from which x is quantized before the GEMV)")
    a = ap.parse_args()
    fold = a.fold_norm == "on"
    if a.prequant_min_nt is not None:
        from minfer_jax.pallas import gemv

        gemv.PREQUANT_MIN_NT = a.prequant_min_nt
    print(jax.devices(), jax.__version__, flush=True)
    if "parity" in a.what:
        greedy_parity("qwen2.5-0.5b:q4_k_m", 2, fold_norm=fold)
        greedy_parity("qwen2.5-0.5b:q8_0", 2, fold_norm=fold)
        greedy_parity("qwen2.5-0.5b:q4_k_m", 2, n_prompt=200, fold_norm=fold)  # long prefills, both GEMM variants
        greedy_parity("qwen2.5-0.5b:q4_k_m", 2, n_prompt=200, gemm="f16", fold_norm=fold)
        greedy_parity("qwen2.5-0.5b:q8_0", 2, n_prompt=200, fold_norm=fold)
    if "timeline05" in a.what:
        decode_timeline("qwen2.5-0.5b:q4_k_m")
    if "timeline7" in a.what:
        decode_timeline("qwen2.5-7b:q4_k_m", top=20)
    if "speed" in a.what or "speed05" in a.what:
        speed("qwen2.5-0.5b:q4_k_m", gemm=a.gemm, fold_norm=fold)
    if "speed" in a.what:
        speed("qwen2.5-7b:q4_k_m", gemm=a.gemm, fold_norm=fold)
