"""bench.py --spec: speculative decoding against plain decode, one sequence, same model, same run
(--spec lookup: prompt lookup; --spec draft -md M: the draft model M).

Two named workloads, each generated greedily with and without speculation (tokens/s of the decode
phase, accepted draft tokens per verification step, and whether the tokens are the same):
- `code-edit`: a Python function quoted in the prompt, to be re-emitted with one name changed
  (the output copies its input: where prompt lookup shines);
- `text`: a request for new prose (little to copy: what speculation must not slow down).
A model without a tokenizer (the synthetic ones) gets token-id stand-ins: the code-edit prompt
is a random block quoted twice with a cut-off third copy, the text prompt random ids; a random
model's greedy output says nothing of real acceptance, so the verification table below is its
meaningful part.
Then `verify`: the milliseconds of one verification step at each draft bucket K (1 + K rows)
beside one plain decode step, and the tokens/s it would give if every draft were accepted.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np

import minfer_jax
from minfer_jax.engine import steps
from minfer_jax.engine.lookup import DEFAULT_DRAFT_MAX
from minfer_jax.engine.sampling import GREEDY, GREEDY_MODE, RowSettings
from minfer_jax.engine.spec_plan import draft_bucket, verify_key
from minfer_jax.files.prompts import encode_chat

CODE = '''def summarize(orders, tax_rate=0.2, currency="EUR"):
    """Totals per customer, with tax, sorted by the amount spent."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        if order.get("discount"):
            amount = amount * (1 - order["discount"])
        totals[customer] = totals.get(customer, 0.0) + amount
    report = []
    for customer, amount in totals.items():
        with_tax = round(amount * (1 + tax_rate), 2)
        report.append({"customer": customer, "net": round(amount, 2), "gross": with_tax,
                       "currency": currency})
    report.sort(key=lambda row: row["gross"], reverse=True)
    return report


def print_report(report):
    for row in report:
        print(f"{row['customer']:<20} {row['net']:>10.2f} {row['gross']:>10.2f} {row['currency']}")
'''
WORKLOADS = {
    "code-edit": "Rename the variable `totals` to `spent_by_customer` in this code. Reply with the "
    "whole code, changed, and nothing else.\n\n```python\n" + CODE + "```",
    "text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def workload_ids(model, name: str, seed: int) -> list[int]:
    """The workload's prompt as token ids: through the chat template where the model has a
    tokenizer, else the token-id stand-in (module docstring)."""
    tok = model.tokenizer
    rng = np.random.default_rng(seed)
    if tok is not None:
        return encode_chat(tok, [{"role": "user", "content": WORKLOADS[name]}], model.ctx_size)
    vocab = min(model.config.vocab_size, 32000)
    if name == "text":
        return rng.integers(0, vocab, 64).tolist()
    block = rng.integers(0, vocab, 300).tolist()
    return rng.integers(0, vocab, 20).tolist() + block + rng.integers(0, vocab, 10).tolist() + block


def run_workload(model, name: str, n_gen: int, spec_kw: dict, reps: int, seed: int) -> dict:
    """Plain and speculative greedy generation of n_gen tokens (best of reps, after a warm-up);
    spec_kw: generate()'s speculation keywords."""
    prompt = workload_ids(model, name, seed)
    kw = dict(max_new_tokens=n_gen, ignore_eos=True)

    def best(extra):
        minfer_jax.generate(model, prompt, **kw, **extra)  # compiles, warms up
        runs = [minfer_jax.generate(model, prompt, **kw, **extra) for _ in range(reps)]
        return max(runs, key=lambda r: r.decode_tps)

    plain, spec = best({}), best(spec_kw)
    s = spec.speculation
    return {
        "workload": name,
        "prompt_tokens": len(prompt),
        "n_gen": n_gen,
        "drafter": spec_kw["speculative"],
        "draft_max": spec_kw["draft_max"],
        "plain_tps": plain.decode_tps,
        "spec_tps": spec.decode_tps,
        "speedup": spec.decode_tps / plain.decode_tps,
        "tokens_per_step": s.tokens_per_step,
        "accepted": s.accepted,
        "drafted": s.drafted,
        "verify_steps": s.verify_steps,
        "plain_chunks": s.plain_chunks,
        "same_tokens": spec.tokens == plain.tokens,
    }


def verify_costs(model, depth: int, draft_max: int, reps: int = 20) -> list[dict]:
    """ms per verification step at each draft bucket up to draft_max, and per plain decode step,
    at `depth` tokens of context (the cache's contents do not change the time)."""
    plan = model.plan(1, ctx=depth + 64)
    cache = model.new_cache(plan.n_slots, plan.cache_len)
    state = steps.init_slot_state(1, plan.history)
    rows = RowSettings.of([GREEDY], [0], vocab=model.config.vocab_size)
    out = []
    decode = model.executable(plan.decode_key(1, depth + plan.decode_steps, GREEDY_MODE))[0]
    slot, pos = np.zeros((1,), np.int32), np.full((1,), depth, np.int32)
    for _ in range(2):
        t0 = time.perf_counter()
        toks, state, cache = decode(model.params, cache, state, slot, pos, rows)
        jax.block_until_ready(toks)
        step_ms = (time.perf_counter() - t0) * 1e3 / plan.decode_steps
    out.append({"rows": 1, "ms_per_step": step_ms, "tps_all_accepted": 1e3 / step_ms})
    buckets = sorted({draft_bucket(n) for n in range(1, draft_max + 1)})
    for k in buckets:
        exe = model.executable(verify_key(plan, k, depth + 1, GREEDY_MODE))[0]
        drafts = np.zeros((k,), np.int32)
        args = (np.int32(0), np.int32(depth), drafts, np.int32(k), rows)
        toks, n, state, cache = exe(model.params, cache, state, *args)  # warm
        jax.block_until_ready(toks)
        t0 = time.perf_counter()
        for _ in range(reps):
            toks, n, state, cache = exe(model.params, cache, state, *args)
        jax.block_until_ready(toks)
        ms = (time.perf_counter() - t0) * 1e3 / reps
        out.append({"rows": 1 + k, "ms_per_step": ms, "tps_all_accepted": (1 + k) * 1e3 / ms})
    return out


def draft_costs(draft, depth: int, draft_max: int, reps: int = 20) -> dict[int, float]:
    """ms per draft of k tokens (each bucket k <= draft_max) of the draft model (a DraftModel) at
    `depth` tokens of context, host wait included: drafts at p_min 0 after the same sequence
    (its cache rolled back each time)."""
    vocab = min(draft.model.config.vocab_size, 1000)
    seq = np.random.default_rng(0).integers(0, vocab, depth + 1).tolist()
    owner = _Owner()
    out = {}
    for k in sorted({draft_bucket(n) for n in range(1, draft_max + 1)}):
        draft.draft(owner, seq, k, 0.0)  # prefills seq once, compiles once
        t0 = time.perf_counter()
        for _ in range(reps):
            draft.draft(owner, seq, k, 0.0)
        out[k] = (time.perf_counter() - t0) * 1e3 / reps
    return out


def projected_speedups(step_ms: float, verify_ms: dict, draft_ms: dict, rate: float) -> dict:
    """Speed-up over plain decode per draft length k if each draft token is accepted with
    probability `rate` (independently): expected tokens (1 - rate^(k+1)) / (1 - rate) per
    verification plus draft of k tokens, against one plain step per token."""
    return {
        k: (1 - rate ** (k + 1)) / (1 - rate) * step_ms / (verify_ms[k] + draft_ms[k])
        for k in draft_ms
    }


def _draft_table(draft, depth: int, draft_max: int, rows: list[dict]) -> None:
    """The draft model's ms per draft of k tokens, and the speed-up a verification + draft of k
    would give at a few acceptance rates (the costs measured above; rows: the verify table's)."""
    step_ms = next(r["ms_per_step"] for r in rows if r.get("rows") == 1)
    verify_ms = {r["rows"] - 1: r["ms_per_step"] for r in rows if r.get("rows", 1) > 1}
    draft_ms = draft_costs(draft, depth, draft_max)
    rates = (0.5, 0.6, 0.7, 0.8, 0.9)
    print(f"\ndraft model at depth {depth}: ms per draft, speed-up at acceptance rate r\n")
    print("| k | draft ms | verify ms | " + " | ".join(f"r={r}" for r in rates) + " |")
    print("|--:|--:|--:|" + "--:|" * len(rates))
    speedups = {r: projected_speedups(step_ms, verify_ms, draft_ms, r) for r in rates}
    for k, ms in draft_ms.items():
        rows.append({"draft": True, "depth": depth, "k": k, "ms_per_draft": ms,
                     **{f"speedup_r{r}": speedups[r][k] for r in rates}})  # fmt: skip
        cells = " | ".join(f"{speedups[r][k]:.2f}x" for r in rates)
        print(f"| {k} | {ms:.3f} | {verify_ms[k]:.3f} | {cells} |", flush=True)


class _Owner:
    """The drafter a DraftModel slot is held for (any object with a weak reference)."""


def run(model, label: str, *, spec: dict, n_gen: int, reps: int, depth: int, seed: int,
        out_files, log) -> None:  # fmt: skip
    """Both tables for one model, printed as markdown (rows also as JSON lines to out_files);
    spec: generate()'s speculation keywords (speculative, draft_max, a draft model's)."""
    spec = {**spec, "draft_max": spec.get("draft_max") or DEFAULT_DRAFT_MAX}
    draft_max = spec["draft_max"]
    drafter = spec["speculative"]
    if "draft_model" in spec:
        drafter += f" ({spec['draft_model'].model.source})"
    print(f"\nmodel: {label}, drafter: {drafter}\n")
    print("| workload | prompt | n | plain t/s | spec t/s | speed-up | tokens/step | accepted "
          "| same tokens |\n|---|--:|--:|--:|--:|--:|--:|--:|---|")  # fmt: skip
    rows: list[dict] = []
    for name in WORKLOADS:
        log(f"spec workload {name}")
        r = run_workload(model, name, n_gen, spec, reps, seed)
        rows.append(r)
        print(
            f"| {name} | {r['prompt_tokens']} | {n_gen} | {r['plain_tps']:.1f} | "
            f"{r['spec_tps']:.1f} | {r['speedup']:.2f}x | {r['tokens_per_step']:.2f} | "
            f"{r['accepted']}/{r['drafted']} | {r['same_tokens']} |",
            flush=True,
        )
    log("spec verification costs")
    print(f"\nverification at depth {depth}\n")
    print("| rows | ms / step | t/s if all accepted |\n|--:|--:|--:|")
    for c in verify_costs(model, depth, draft_max):
        rows.append({"verify": True, "depth": depth, **c})
        print(f"| {c['rows']} | {c['ms_per_step']:.3f} | {c['tps_all_accepted']:.1f} |", flush=True)
    if "draft_model" in spec:
        log("spec draft model costs")
        _draft_table(spec["draft_model"], depth, draft_max, rows)
    for f in out_files:
        for r in rows:
            f.write(json.dumps({"model": label, **r}) + "\n")
