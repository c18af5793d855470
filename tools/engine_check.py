r"""What generate() itself achieves beside bench.py: a long prompt's prefill, decode through the
host loop, and peak device memory against weights + KV cache (issue 15/16 acceptance figures).

    PYTHONPATH=. python tools/engine_check.py --synthetic qwen2.5-7b:q4_k_m --ctx 32768 \
        --prompt 32000 --gen 128
    PYTHONPATH=. python tools/engine_check.py --synthetic qwen2.5-0.5b:q4_k_m --layers 2 \
        --parity 2500

--parity N: greedy tokens of an N-token prompt through the Pallas kernels against the XLA
reference path (same quantized weights); a divergence is reported with the reference's top-2
logit gap at that position (a near-tie when the gap is below the paths' logit difference).
--batched B,...: llama-batched-bench rows (-npp 512 -ntg 128) on the same loaded model.
--batch-parity B[,B...]: prompts decoded in batches of B through the kernels (B > 8: the split
GEMM, or with --deterministic the one-token GEMV in calls of 8 rows) against each alone (B = 1:
the GEMV); per row the identical prefix and, at a divergence, the lone run's top-2 logit gap
(issue 16/26: each sequence's greedy tokens alone or batched). The prompts: --prompts FILE (a
JSON {"prompts": [...]} of texts, e.g. tests/data/invariance_prompts.json), else B random ones.
--deterministic: load(deterministic=True) for every check (--batch-parity then runs every B on
the lone run's model: that mode keeps no prompt prefixes, so nothing is compiled twice). Each
finished B is also written to stderr at once, so a run cut short keeps what it measured.
--step-invariance B,...: one decode step of each of the first 4 prompts (--prompts, else random)
with its row alone in a 1-slot cache, alone in a B + 1-slot cache, replicated in B rows and beside
B - 1 other prompts: max |logit difference| against the lone step, and for a replicated row that
differs the fewest leading layers that already differ (a bisection over truncated models, each a
real decode executable): where batch invariance breaks. Also the prompt's K/V prefilled into the
wider cache, and prefilled with its first token apart (as prefix reuse does), against the lone
prefill's.
--profile B,...: where a decode step's device time goes at batch B (GPU kernels on the
jax.profiler timeline, summed by name over --gen steps of B sequences).
--f64 B: issue 26's float64 check of the decode path: greedy tokens of B prompts (natural text
and code with -m, random ids on a synthetic model), each alone and as one batch, and at every
decode step the float64 forward's (minfer_bench/float64_reference.py) top-1 on the same prefix; a
disagreement counts where the float64 top-2 gap exceeds --f64-gap (0.02 logits). --f64-prompts
I,J,...: only those of the natural prompts (e.g. 7: the one whose step 8 the int8 activations
flip); --precise: load(precise=True) (also for --batch-parity); --cache-dtype f16: the GPU's KV
cache on the CPU too (with --kernels interpret, the GPU path's numerics but for the order of f32
sums).
-m FILE replaces --synthetic for --batch-parity, --profile and --f64 (a real model: fewer
near-ties).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import minfer_jax
from minfer_jax.engine import options
from minfer_jax.model.cache import cache_nbytes
from minfer_jax.model.from_gguf import load_gguf

from minfer_bench.bench.kernel_timing import device_kernel_events
from minfer_bench.synthetic import synthetic_model


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic")
    src.add_argument("-m", "--model", help="a GGUF file (--batch-parity and --profile)")
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--prompt", type=int, default=0, help="tokens of the long prompt")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument(
        "--short", type=int, default=16, help="tokens of the short prompt (decode speed)"
    )
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--parity", type=int, default=0, metavar="N")
    ap.add_argument("--batched", default="", metavar="B,...")
    ap.add_argument("--batch-parity", default="", metavar="B[,B...]")
    ap.add_argument("--prompts", default=None, metavar="FILE")
    ap.add_argument("--step-invariance", default="", metavar="B,...")
    ap.add_argument("--op-level", action="store_true")
    ap.add_argument("--profile", default="", metavar="B,...")
    ap.add_argument("--f64", type=int, default=0, metavar="B")
    ap.add_argument("--f64-gap", type=float, default=0.02)
    ap.add_argument("--f64-prompts", default=None, metavar="I,J,...")
    ap.add_argument("--cache-dtype", choices=("f16", "f32"), default=None, help="(--f64)")
    options.add_arguments(ap)  # --kernels (auto: pallas here; interpret: a CPU smoke test), ...
    return ap


def main() -> None:
    ap = build_parser()
    a = ap.parse_args()
    opts = options.from_arguments(a, ctx_size=a.ctx)
    a.kernels = opts.kernels or "pallas"
    only = None if a.f64_prompts is None else [int(i) for i in a.f64_prompts.split(",")]
    if only is not None and not all(0 <= i < a.f64 for i in only):
        ap.error(f"--f64-prompts takes numbers of the --f64 {a.f64} prompts (0 .. {a.f64 - 1})")
    gm = synthetic_model(a.synthetic, layers=a.layers) if a.synthetic else load_gguf(a.model)
    if a.batch_parity:
        batches = [int(b) for b in a.batch_parity.split(",")]
        out = batch_parity(
            gm, batches, a.gen, a.ctx, a.kernels, a.prompts, a.deterministic, precise=a.precise
        )
        print(json.dumps(out, indent=1), flush=True)
    if a.profile:
        for b in (int(v) for v in a.profile.split(",")):
            print(step_profile(gm, b, a.gen, a.ctx, a.kernels, a.deterministic), flush=True)
    if a.f64:
        out = f64_check(
            gm,
            a.f64,
            a.gen,
            a.ctx,
            a.kernels,
            a.f64_gap,
            a.deterministic,
            precise=a.precise,
            cache_dtype=a.cache_dtype,
            only=only,
        )
        print(json.dumps(out, indent=1), flush=True)
    if a.step_invariance:
        batches = [int(b) for b in a.step_invariance.split(",")]
        out = step_invariance(
            gm, batches, a.ctx, a.kernels, a.prompts, a.deterministic, op_level=a.op_level
        )
        print(json.dumps(out, indent=1), flush=True)
    if a.batch_parity or a.profile or a.f64 or a.step_invariance:
        return
    if a.model or not a.prompt:
        ap.error("the speed and memory check needs --synthetic and --prompt")
    if a.parity:
        print(json.dumps(parity(gm, a.parity, a.gen), indent=1), flush=True)
        return
    m = minfer_jax.load(options=opts, gguf_model=gm)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    rows = {}
    for name, n in (("short", a.short), ("long", a.prompt)):
        warm, ids = (
            [int(t) for t in rng.integers(0, vocab, n)] for _ in range(2)
        )  # distinct: no prefix reuse
        minfer_jax.generate(m, warm, max_new_tokens=a.gen)  # compiles
        r = minfer_jax.generate(m, ids, max_new_tokens=a.gen)
        assert r.cached_tokens == 0, r.cached_tokens
        rows[name] = dict(
            prompt=n,
            generated=len(r.tokens),
            prefill_tps=r.prefill_tps,
            decode_tps=r.decode_tps,
            prefill_s=r.prefill_s,
            decode_s=r.decode_s,
        )
    stats = jax.devices()[0].memory_stats() or {}
    plan = m.plan()
    rows["memory"] = dict(
        peak_bytes=stats.get("peak_bytes_in_use"),
        weight_bytes=m.weight_nbytes,
        kv_cache_bytes=cache_nbytes(
            m.config, plan.n_slots, plan.cache_len, m.cache_dtype, m.kv_types, m.kv_rotation
        ),
    )
    mem = rows["memory"]
    if mem["peak_bytes"]:
        mem["workspace_bytes"] = mem["peak_bytes"] - mem["weight_bytes"] - mem["kv_cache_bytes"]
    print(
        json.dumps({"model": a.synthetic, "ctx": a.ctx, "chunk": m.chunk, **rows}, indent=1),
        flush=True,
    )
    if a.batched:
        from minfer_bench.bench import batched

        batched.run(
            m,
            a.synthetic,
            [512],
            [128],
            [int(b) for b in a.batched.split(",")],
            seed=0,
            out_files=[],
            log=lambda s: None,
        )


NATURAL_PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, COUNT(*) FROM orders",
    "The three laws of thermodynamics are",
    "class Stack:\n    def __init__(self):",
    "Photosynthesis is the process by which",
]


def f64_check(
    gm,
    n_seqs: int,
    gen: int,
    ctx: int,
    kernels: str,
    gap: float,
    deterministic: bool = False,
    precise: bool = False,
    cache_dtype: str | None = None,
    only: list[int] | None = None,
) -> dict:
    """Each decode step's greedy token (alone and in one batch of n_seqs) against the float64
    forward's top-1 on the same prefix: one float64 forward per generated sequence gives every
    step's logits (causal). only: those of the n_seqs prompts; cache_dtype "f16" / "f32" (None:
    the platform's)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from minfer_bench import float64_reference

    dtype = {"f16": jnp.float16, "f32": jnp.float32, None: None}[cache_dtype]
    kw = dict(gguf_model=gm, ctx_size=ctx, kernels=kernels, weights="quantized")
    kw.update(deterministic=deterministic, precise=precise, cache_dtype=dtype)
    m = minfer_jax.load(**kw)
    m_alone = minfer_jax.load(**kw)
    if not str(gm.path).startswith("synthetic:"):
        texts = (NATURAL_PROMPTS * (n_seqs // len(NATURAL_PROMPTS) + 1))[:n_seqs]
        prompts = [m.tokenizer.encode(t) for t in texts]
    else:
        rng = np.random.default_rng(4)
        prompts = [
            [int(t) for t in rng.integers(0, gm.config.vocab_size, int(rng.integers(5, 65)))]
            for _ in range(n_seqs)
        ]
    numbers = list(range(len(prompts))) if only is None else only  # reported as the prompt
    prompts = [prompts[i] for i in numbers]
    paths = {
        "alone": [minfer_jax.generate(m_alone, p, max_new_tokens=gen).tokens for p in prompts],
        "batched": [r.tokens for r in minfer_jax.generate_batch(m, prompts, max_new_tokens=gen)],
    }
    out: dict = {"n_seqs": len(prompts), "generated": gen, "gap": gap, "kernels": kernels}
    out.update(deterministic=deterministic, precise=precise, cache_dtype=str(m.cache_dtype))
    for name, runs in paths.items():
        steps = off = off_clear = 0
        worst = 0.0
        cases = []
        for i, p, toks in zip(numbers, prompts, runs):
            ref = float64_reference.forward(gm, p + toks)  # [T, vocab]
            for j, t in enumerate(toks):
                row = ref[len(p) + j - 1]
                top2 = np.sort(row)[-2:]
                steps += 1
                if int(row.argmax()) != t:
                    off += 1
                    d = float(top2[1] - top2[0])
                    worst = max(worst, d)
                    off_clear += d > gap
                    # the float64 logits of its top-1 and of the token this path chose
                    cases.append(
                        dict(
                            prompt=i,
                            step=j,
                            f64_top1=int(row.argmax()),
                            chosen=int(t),
                            f64_gap_to_chosen=float(row.max() - row[t]),
                            f64_top2_gap=d,
                        )
                    )
        out[name] = dict(
            steps=steps, disagree=off, disagree_past_gap=off_clear, worst_gap=worst, cases=cases
        )
    out["alone_equals_batched"] = sum(a == b for a, b in zip(paths["alone"], paths["batched"]))
    return out


def parity(gm, n: int, gen: int) -> dict:
    """Greedy tokens of an n-token prompt, kernels vs the XLA path, and the first divergence's
    margin."""
    ctx = n + gen + 16
    kern = minfer_jax.load(gguf_model=gm, ctx_size=ctx, kernels="pallas", weights="quantized")
    ref = minfer_jax.load(gguf_model=gm, ctx_size=ctx, kernels="xla", weights="quantized")
    ids = [int(t) for t in np.random.default_rng(1).integers(0, gm.config.vocab_size, n)]
    a = minfer_jax.generate(kern, ids, max_new_tokens=gen).tokens
    b = minfer_jax.generate(ref, ids, max_new_tokens=gen).tokens
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    out = dict(prompt=n, generated=len(a), identical_prefix=same, identical=a == b)
    seq = ids + b[: same + 1]
    lk, lr = kern.logits(seq)[n - 1 :], ref.logits(seq)[n - 1 :]
    out["max_abs_logit_diff"] = float(np.max(np.abs(lk - lr)))
    if same < len(a):
        top2 = np.sort(lr[same])[-2:]
        out["ref_top2_gap_at_divergence"] = float(top2[1] - top2[0])
    return out


def batch_parity(
    gm,
    batches: list[int],
    gen: int,
    ctx: int,
    kernels: str = "pallas",
    prompts_file: str | None = None,
    deterministic: bool = False,
    precise: bool = False,
) -> dict:
    """Greedy tokens of each prompt alone and in consecutive batches of B (for each B), both
    through the kernels: per B the rows whose tokens equal the lone run's, and per differing row
    the identical prefix and the lone run's top-2 logit gap there."""

    def load():
        return minfer_jax.load(
            gguf_model=gm,
            ctx_size=ctx,
            kernels=kernels,
            weights="quantized",
            deterministic=deterministic,
            precise=precise,
        )

    if prompts_file:
        with open(prompts_file) as f:
            texts = json.load(f)["prompts"]
        tokenizer = load().tokenizer
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        rng = np.random.default_rng(2)
        prompts = [
            [int(t) for t in rng.integers(0, gm.config.vocab_size, int(rng.integers(5, 65)))]
            for _ in range(max(batches))
        ]
    # one model per run: a model reuses the prompt prefixes its slots hold from earlier runs
    # (not in the deterministic mode, which keeps no prefixes: one model, compiled once, serves)
    m_alone = load()
    alone = [minfer_jax.generate(m_alone, p, max_new_tokens=gen).tokens for p in prompts]
    out: dict = dict(
        n_prompts=len(prompts),
        prompt_tokens=[len(p) for p in prompts],
        generated=gen,
        deterministic=deterministic,
        precise=precise,
        kernels=kernels,
    )
    print(f"batch parity: {len(prompts)} prompts alone done", file=sys.stderr, flush=True)
    for b in batches:
        m = m_alone if deterministic else load()
        got = []
        for i in range(0, len(prompts), b):
            group = prompts[i : i + b]
            got += [r.tokens for r in minfer_jax.generate_batch(m, group, max_new_tokens=gen)]
        rows = []
        for i, (p, mine, lone) in enumerate(zip(prompts, got, alone)):
            if mine == lone:
                continue
            same = next((j for j, (x, y) in enumerate(zip(mine, lone)) if x != y), len(lone))
            row = dict(prompt=i, identical_prefix=same)
            if same < len(lone):
                top2 = np.sort(np.asarray(m_alone.logits(p + lone[:same]))[-1])[-2:]
                row["alone_top2_gap_at_divergence"] = float(top2[1] - top2[0])
            rows.append(row)
        out[f"B={b}"] = dict(identical_rows=len(prompts) - len(rows), differing=rows)
        print(f"batch parity B={b}: {json.dumps(out[f'B={b}'])}", file=sys.stderr, flush=True)
        del m
    return out


def step_invariance(
    gm,
    batches: list[int],
    ctx: int,
    kernels: str = "pallas",
    prompts_file: str | None = None,
    deterministic: bool = False,
    n_prompts: int = 4,
    op_level: bool = False,
) -> dict:
    """One decode step of a prompt's row alone and beside other rows (see --step-invariance);
    op_level: where a replicated row differs, also op_differences() over the fewest layers that
    differ."""
    import dataclasses

    from minfer_jax.model.cache import KVCache
    from minfer_jax.model.decoder import forward_chunk, forward_decode
    from minfer_jax.sizes import pow2_at_least

    m = minfer_jax.load(  # the XLA path on its default dense weights: what a CPU user runs
        gguf_model=gm,
        ctx_size=ctx,
        kernels=kernels,
        weights="dense" if kernels == "xla" else "quantized",
        deterministic=deterministic,
    )
    cfg, impl, cache_len = m.config, m.impl, m.plan().cache_len
    if prompts_file:
        with open(prompts_file) as f:
            prompts = [m.tokenizer.encode(t) for t in json.load(f)["prompts"]]
    else:
        rng = np.random.default_rng(5)
        prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, 40)] for _ in range(8)]
    prefill = jax.jit(
        lambda params, tokens, slot, start, cache: forward_chunk(
            params, tokens, slot, start, cache, cfg, impl
        )[1]
    )

    def prefill_at(params, tokens, slot, start: int, cache):
        return prefill(params, tokens, slot, jnp.int32(start), cache)

    def step_fn(params, cache, tokens, slots, positions):
        return forward_decode(params, tokens, slots, positions, cache, cfg, impl)[0]

    step = jax.jit(step_fn)

    def filled(n_slots: int, rows: list[list[int]], first: int = 0):
        """A cache of n_slots with rows[i][:-1] prefilled into slot i (first > 0: its first
        `first` tokens in a chunk of their own, then the rest from there, as prefix reuse
        does)."""
        cache = m.new_cache(n_slots, cache_len)
        for slot, p in enumerate(rows):
            for lo, hi in ((0, first), (first, len(p) - 1)) if first else ((0, len(p) - 1),):
                tokens = np.zeros((max(16, pow2_at_least(hi - lo)),), np.int32)
                tokens[: hi - lo] = p[lo:hi]
                cache = prefill_at(m.params, jnp.asarray(tokens), jnp.int32(slot), lo, cache)
        return cache

    def cache_difference(a, b, n: int) -> float:
        """max |K/V difference| of slot 0's first n positions over every layer."""
        return max(
            float(jnp.max(jnp.abs(x[0, :, :n].astype(jnp.float32) - y[0, :, :n])))
            for x, y in zip(a.k + a.v, b.k + b.v)
        )

    def step_args(rows: list[list[int]]):
        """(tokens, slots, positions) of one decode step: row i in slot i at its last token."""
        tokens = jnp.asarray([p[-1] for p in rows], jnp.int32)
        positions = jnp.asarray([len(p) - 1 for p in rows], jnp.int32)
        return tokens, jnp.arange(len(rows), dtype=jnp.int32), positions

    def run(params, cache, rows: list[list[int]]):
        return np.asarray(step(params, cache, *step_args(rows)))

    def truncated(params, cache, n_layers: int):
        return (
            dataclasses.replace(params, layers=params.layers[:n_layers]),
            KVCache(k=cache.k[:n_layers], v=cache.v[:n_layers]),
        )

    out: dict = {"kernels": kernels, "deterministic": deterministic, "prompts": []}
    for i, p in enumerate(prompts[:n_prompts]):
        others = [q for j, q in enumerate(prompts) if j != i]
        alone_cache = filled(1, [p])
        alone = run(m.params, alone_cache, [p])[0]
        reused = filled(1, [p], first=1)
        row: dict = {
            "prompt": i,
            "tokens": len(p),
            # the prompt's K/V and step when its first token was prefilled apart (prefix reuse)
            "prefix_reused_cache": cache_difference(reused, alone_cache, len(p) - 1),
            "prefix_reused_step": float(np.max(np.abs(run(m.params, reused, [p])[0] - alone))),
        }
        for b in batches:
            wide_cache = filled(b + 1, [p])
            wide = run(m.params, wide_cache, [p])[0]
            rep_cache = filled(b + 1, [p] * b)
            replicated = run(m.params, rep_cache, [p] * b)
            mixed = run(m.params, filled(b + 1, [p, *others[: b - 1]]), [p, *others[: b - 1]])[0]
            entry = {
                "prefill_in_b+1_slots": cache_difference(wide_cache, alone_cache, len(p) - 1),
                "alone_in_b+1_slots": float(np.max(np.abs(wide - alone))),
                "replicated_rows": [float(np.max(np.abs(r - alone))) for r in replicated],
                "beside_others": float(np.max(np.abs(mixed - alone))),
            }
            # the lone row run as b identical rows of its own 1-slot cache (same slot, position)
            entry["alone_as_b_rows"] = float(
                np.max(np.abs(run(m.params, alone_cache, [p] * b)[0] - alone))
            )
            if entry["replicated_rows"][0]:
                lo, hi = 0, cfg.n_layers  # layers [0, lo) agree, [0, hi) differ
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    a1 = run(*truncated(m.params, alone_cache, mid), [p])[0]
                    rb = run(*truncated(m.params, rep_cache, mid), [p] * b)[0]
                    lo, hi = (mid, hi) if np.array_equal(a1, rb) else (lo, mid)
                entry["first_layers_that_differ"] = hi
                if op_level:
                    entry["ops"] = op_differences(
                        step_fn,
                        (*truncated(m.params, alone_cache, hi), *step_args([p])),
                        (*truncated(m.params, rep_cache, hi), *step_args([p] * b)),
                    )
            row[f"B={b}"] = entry
        out["prompts"].append(row)
    return out


def op_differences(fn, alone_args: tuple, batch_args: tuple, limit: int = 8) -> dict:
    """fn's jaxpr run one primitive at a time on the lone args and on the batch args (whose row
    0 / slot 0 is the lone row): the first `limit` primitives whose lone part of the output
    differs while every input's lone part agrees, and whether the eager outputs differ at all.
    The lone part of a batch value: the leading slice of the lone value's size along every axis
    whose size differs (rows, padded rows, cache slots)."""

    def lone_part(batch_val, lone_val):
        if batch_val.shape == lone_val.shape:
            return batch_val
        if batch_val.ndim != lone_val.ndim:
            return None
        return batch_val[tuple(slice(0, n) for n in lone_val.shape)]

    def same(batch_val, lone_val) -> bool | None:
        part = lone_part(batch_val, lone_val)
        if part is None:
            return None
        return bool(jnp.array_equal(part, lone_val, equal_nan=True))

    (lone_trace, lone_result), (batch_trace, batch_result) = (
        _eager_trace(fn, alone_args),
        _eager_trace(fn, batch_args),
    )
    culprits, n_differ = [], 0
    for (eqn, lone_ins, lone_outs), (beqn, batch_ins, batch_outs) in zip(lone_trace, batch_trace):
        if eqn.primitive.name != beqn.primitive.name:
            return {"error": f"the traces part at {eqn.primitive.name} / {beqn.primitive.name}"}
        outs = [same(b, a) for b, a in zip(batch_outs, lone_outs)]
        if False not in outs:
            continue
        n_differ += 1
        if False in [same(b, a) for b, a in zip(batch_ins, lone_ins)] or len(culprits) >= limit:
            continue
        i = outs.index(False)
        diff = jnp.abs(
            lone_part(batch_outs[i], lone_outs[i]).astype(jnp.float32)
            - lone_outs[i].astype(jnp.float32)
        )
        culprits.append(
            {
                "primitive": eqn.primitive.name,
                "lone_shapes": [list(v.shape) for v in lone_outs],
                "batch_shapes": [list(v.shape) for v in batch_outs],
                "max_difference": float(jnp.max(diff)),
                "elements_that_differ": int(jnp.sum(diff > 0)),
                "where": _source_line(eqn),
            }
        )
    return {
        "primitives": len(lone_trace),
        "primitives_that_differ": n_differ,
        "logits_differ_eagerly": not same(batch_result[0], lone_result[0]),
        "first_with_agreeing_inputs": culprits,
    }


_INLINED = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}


def _eager_trace(fn, args: tuple) -> tuple[list, list]:
    """fn's jaxpr evaluated one primitive at a time, jit and custom derivative calls inlined:
    ([(eqn, inputs (its literals left out), outputs)] per primitive, fn's outputs)."""
    closed = jax.make_jaxpr(fn)(*args)
    records: list = []

    def run(jaxpr, consts, invals):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, invals))

        def read(v):
            return v.val if _literal(v) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            sub = next(
                (eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params),
                None,
            )
            if eqn.primitive.name in _INLINED and sub is not None:
                inner = getattr(sub, "jaxpr", sub)
                outs = run(inner, getattr(sub, "consts", ()), ins)
            else:
                bind_params = eqn.primitive.get_bind_params(eqn.params)
                # some jax versions return (subfuns, params), others the params alone
                subfuns, bind_params = (
                    bind_params if isinstance(bind_params, tuple) else ((), bind_params)
                )
                outs = eqn.primitive.bind(*subfuns, *ins, **bind_params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
                # a literal is part of the op: one that depends on the row count parts the op
                records.append((eqn, [x for v, x in zip(eqn.invars, ins) if not _literal(v)], outs))
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    result = run(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return records, result


def _literal(v) -> bool:
    return type(v).__name__ == "Literal"


def _source_line(eqn, depth: int = 3) -> str:
    """Where in the code eqn was made: its innermost `depth` frames outside jax, innermost
    first."""
    from jax._src import source_info_util

    try:
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))[:depth]
        return " < ".join(
            f"{f.file_name.split('/')[-1]}:{f.start_line} {f.function_name}" for f in frames
        )
    except (AttributeError, TypeError):  # jax's private API moved: its one-line summary
        return source_info_util.summarize(eqn.source_info)


def step_profile(
    gm, n_seqs: int, gen: int, ctx: int, kernels: str = "pallas", deterministic: bool = False
) -> str:
    """A markdown table: GPU time per kernel name over `gen` decode steps of n_seqs sequences.

    The traced generate_batch repeats the warm-ups' prompts, so prefix reuse leaves one prompt
    token each to prefill and the trace is (nearly) all decode."""
    m = minfer_jax.load(
        gguf_model=gm,
        ctx_size=ctx,
        kernels=kernels,
        weights="quantized",
        deterministic=deterministic,
    )
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, gm.config.vocab_size, 64)] for _ in range(n_seqs)]

    def run():
        return minfer_jax.generate_batch(m, prompts, max_new_tokens=gen)

    run()  # compiles; records every slot's prompt for reuse
    run()  # compiles the reuse path's one-token prefills, so the traced run compiles nothing
    events = device_kernel_events(run)
    return (
        kernel_table(events, gen, n_seqs) if events else f"B={n_seqs}: no GPU events in the trace"
    )


def kernel_table(events: list, steps: int, n_seqs: int) -> str:
    """(start ns, duration ns, name) events summed by name, per step. Instance suffixes (".3",
    "_12") are dropped, but not a format's own digit (gemm_q4_0 and gemm_q4_1 stay apart)."""
    by_name: dict[str, list[float]] = {}
    for _, dur, name in events:
        by_name.setdefault(re.sub(r"(?<!q\d)[._]\d+$", "", name), []).append(dur / 1e3)
    total = sum(sum(v) for v in by_name.values())
    span = (max(s + d for s, d, _ in events) - events[0][0]) / 1e3
    lines = [
        f"B={n_seqs}: {steps} steps, kernels {total / 1e3:.1f} ms, span {span / 1e3:.1f} ms, "
        f"{total / steps:.0f} us of kernels per step ({n_seqs * steps / span * 1e6:.0f} tok/s "
        "over the span)",
        "",
        "| kernel | calls | us per step | share |",
        "|---|---:|---:|---:|",
    ]
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(
            f"| {name[:60]} | {len(durs)} | {sum(durs) / steps:.1f} | {sum(durs) / total:.1%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
