#!/usr/bin/env python
"""Speculative decoding through the kernels: do verified tokens equal plain greedy decoding?

    PYTHONPATH=. python tools/spec_check.py --synthetic qwen2.5-7b:q4_k_m -m default \
        --modes default,deterministic -n 64 --out $OUT/spec_check.md

For each model and mode (load(deterministic=...)), each prompt (the natural prompts of
tests/data/invariance_prompts.json where the model has a tokenizer, else random ids) is decoded
greedily three ways: plain, with prompt lookup (generate(speculative="lookup")) and with drafts
replayed from the plain output and spoiled on purpose (minfer_bench/spec_replay.py: every
verification bucket meets accepted and rejected tokens), then all prompts decoded together with
every other one drafting (one verification step for the batch, as the server runs it; its
sequences against their lone plain tokens). It prints how many sequences differ
from plain decoding and, for each that does, the plain run's top-2 logit margin at the first
differing position (a near tie, or a bug). The deterministic mode must give 0 differences.
The same check runs on the CPU with --kernels interpret (slow: a tiny model only).
--qwen35 NAME takes a small synthetic Qwen3.5 file (minfer_bench.synthetic_qwen35, e.g.
qwen35-tiny-v3-mtp, with an MTP block); --mtp loads the MTP block and adds its drafter
(generate(speculative="draft-mtp")):

    PYTHONPATH=. python tools/spec_check.py --qwen35 qwen35-tiny-v3-mtp --mtp -n 32 --prompts 4

With -md (a GGUF path, synthetic:<spec>, or `self`: the target as its own draft) one more way
drafts with that draft model (generate(speculative="draft"), --draft-p-min, default 0: always
draft); `self` must accept ~every draft (the draft model's decode path is the target's).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import minfer_jax
from minfer_jax.engine.lookup import Speculation
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.files.model_source import resolve_model
from minfer_jax.files.prompts import encode_chat

from minfer_bench.spec_replay import replayed
from minfer_bench.synthetic import synthetic_model
from minfer_bench.synthetic_qwen35 import qwen35_model

PROMPTS = "tests/data/invariance_prompts.json"


def prompt_ids(model, count: int, seed: int) -> list[list[int]]:
    if model.tokenizer is not None:
        texts = json.load(open(PROMPTS))["prompts"][:count]
        msgs = [[{"role": "user", "content": t}] for t in texts]
        return [encode_chat(model.tokenizer, m, model.ctx_size) for m in msgs]
    rng = np.random.default_rng(seed)
    vocab = min(model.config.vocab_size, 32000)
    return [rng.integers(0, vocab, 24 + 40 * i).tolist() for i in range(count)]


def margin_at(model, prompt: list[int], tokens: list[int], other: list[int]) -> tuple[int, float]:
    """The first position where other parts from tokens, and the top-2 gap of the logits there
    (from the plain prefix)."""
    i = next(j for j, (a, b) in enumerate(zip(tokens + [-1], other + [-2])) if a != b)
    logits = model.logits(prompt + tokens[:i])[-1]
    top = np.sort(logits)[-2:]
    return i, float(top[1] - top[0])


def draft_for(model, ref: str | None):
    """-md's DraftModel for model (None without -md)."""
    if ref is None:
        return None
    if ref == "self":
        return minfer_jax.DraftModel(model, model)
    if ref.startswith("synthetic:"):
        return minfer_jax.load_draft(model, gguf_model=synthetic_model(ref))
    return minfer_jax.load_draft(model, resolve_model(ref))


def check(
    model, label: str, mode: str, prompts, n_gen: int, draft_max: int, draft=None, p_min=0.0
) -> list[dict]:
    rows = []
    for p in prompts:
        plain = minfer_jax.generate(model, p, max_new_tokens=n_gen, ignore_eos=True)
        runs = [("lookup", "lookup")] + ([("mtp", "draft-mtp")] if model.has_mtp else [])
        results = [
            (kind, minfer_jax.generate(
                model, p, max_new_tokens=n_gen, ignore_eos=True, speculative=spec,
                draft_max=draft_max,
            ))
            for kind, spec in runs
        ]  # fmt: skip
        results.append(("replay", replayed(model, p, plain.tokens, draft_max=draft_max)))
        if draft is not None:
            results.append(
                ("draft", minfer_jax.generate(
                    model, p, max_new_tokens=n_gen, ignore_eos=True, speculative="draft",
                    draft_model=draft, draft_max=draft_max, draft_p_min=p_min,
                ))
            )  # fmt: skip
        for kind, res in results:
            same = res.tokens == plain.tokens
            where, gap = (None, None) if same else margin_at(model, p, plain.tokens, res.tokens)
            rows.append(
                {
                    "model": label,
                    "mode": mode,
                    "drafter": kind,
                    "prompt_tokens": len(p),
                    "same": same,
                    "first_diff": where,
                    "top2_gap": gap,
                    "accepted": res.speculation.accepted,
                    "drafted": res.speculation.drafted,
                }  # fmt: skip
            )
    return rows


def batch_check(model, label: str, mode: str, prompts, n_gen: int, draft_max: int) -> list[dict]:
    """The prompts decoded together as the server does (one slot each, one token per step),
    every other one drafting by prompt lookup, so steps verify drafting and plain rows in one
    executable (engine/verify_batch.py): each sequence against its lone plain tokens."""
    sched = Scheduler(model, model.plan(len(prompts), decode_steps=1))
    reqs = [
        sched.submit(
            p,
            max_new_tokens=n_gen,
            constraint=model.constraint(ignore_eos=True),
            speculation=Speculation(draft_max=draft_max) if i % 2 == 0 else None,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]
    sched.run(reqs)
    rows = []
    for p, req in zip(prompts, reqs):
        res = req.result()
        plain = minfer_jax.generate(model, p, max_new_tokens=n_gen, ignore_eos=True)
        same = res.tokens == plain.tokens
        where, gap = (None, None) if same else margin_at(model, p, plain.tokens, res.tokens)
        stats = res.speculation
        rows.append(
            {
                "model": label,
                "mode": mode,
                "drafter": "batch-plain" if stats is None else "batch-lookup",
                "prompt_tokens": len(p),
                "same": same,
                "first_diff": where,
                "top2_gap": gap,
                "accepted": 0 if stats is None else stats.accepted,
                "drafted": 0 if stats is None else stats.drafted,
            }  # fmt: skip
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=[], help="a GGUF path or default")
    ap.add_argument("--synthetic", action="append", default=[], help="e.g. qwen2.5-7b:q4_k_m")
    ap.add_argument("--qwen35", action="append", default=[], help="e.g. qwen35-tiny-v3-mtp")
    ap.add_argument("--mtp", action="store_true", help="load the MTP block, draft with it too")
    ap.add_argument("--layers", type=int, default=None, help="synthetic: layer count")
    ap.add_argument("--kernels", default=None, help="pallas (GPU default) or interpret")
    ap.add_argument("--modes", default="default,deterministic")
    ap.add_argument("-n", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("-md", "--model-draft", default=None, help="path, synthetic:<spec> or self")
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    args = ap.parse_args(argv)
    sources = [(f"synthetic:{s}", synthetic_model(s, layers=args.layers)) for s in args.synthetic]
    sources += [(f"synthetic:{s}", qwen35_model(s)) for s in args.qwen35]
    sources += [(m, resolve_model(m)) for m in args.model]
    rows = []
    for label, src in sources:
        for mode in args.modes.split(","):
            kw = dict(
                kernels=args.kernels, deterministic=mode == "deterministic", ctx_size=2048,
                mtp=args.mtp,
            )  # fmt: skip
            model = (
                minfer_jax.load(src, **kw) if isinstance(src, str) else
                minfer_jax.load(gguf_model=src, **kw)
            )  # fmt: skip
            prompts = prompt_ids(model, args.prompts, 0)
            got = check(
                model, label, mode, prompts, args.n, args.draft_max,
                draft_for(model, args.model_draft), args.draft_p_min,
            )  # fmt: skip
            got += batch_check(model, label, mode, prompts, args.n, args.draft_max)
            rows += got
            differ = [r for r in got if not r["same"]]
            acc = {
                kind: sum(r["accepted"] for r in got if r["drafter"] == kind)
                / max(sum(r["drafted"] for r in got if r["drafter"] == kind), 1)
                for kind in dict.fromkeys(r["drafter"] for r in got)
            }
            print(
                f"{label} {mode}: {len(differ)} of {len(got)} sequences differ from plain "
                f"decoding (drafts accepted: "
                f"{', '.join(f'{k} {a:.0%}' for k, a in acc.items())})",
                flush=True,
            )
            for r in differ:
                print(f"  {r['drafter']} prompt of {r['prompt_tokens']}: token {r['first_diff']}, "
                      f"plain top-2 gap {r['top2_gap']:.4f}")  # fmt: skip
            del model
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    bad = [r for r in rows if r["mode"] == "deterministic" and not r["same"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
