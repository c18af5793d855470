r"""How much an 8-bit KV cache changes a model's output: the mean KL divergence of its next-token
distributions from the float cache's on natural text, and whether greedy answers stay the same.

    PYTHONPATH=. python tools/kv_quality.py -ctk q8_0 -ctv q8_0            # the built-in model
    PYTHONPATH=. python tools/kv_quality.py -m model.gguf -ctk fp8 -ctv fp8 --gen 32

Each prompt of --prompts (a JSON {"prompts": [...]}, default tests/data/invariance_prompts.json)
runs through model.logits() twice, once with the float cache (f32 on a CPU, f16 on a GPU) and
once with -ctk / -ctv: per position KL(P_float || P_8bit) in nats (llama-perplexity's
--kl-divergence measure), their mean and maximum over every position of every prompt, and how
often the top token agrees. --gen N > 0: each prompt's N greedy tokens with either cache (batched,
generate_batch), the prompts whose answers differ and where. Prints one JSON object.

--needle N: the long-context check instead: a secret sentence hidden at each --depths fraction of
an N-token haystack of the prompts' natural text, then a chat question about it; each cache's
greedy answer, and whether it names the secret (a CPU run of N = 32000 on the built-in model takes
tens of minutes: every prompt prefills N tokens twice).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import minfer_jax
from minfer_jax.engine import options

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "invariance_prompts.json")


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def divergence(base, test, token_lists) -> dict:
    """Mean / max KL(base || test) over every position of every token list, and the top-1
    agreement, from the two models' prompt logits."""
    kls, same_top = [], []
    for ids in token_lists:
        lp, lq = log_softmax64(base.logits(ids)), log_softmax64(test.logits(ids))
        kls.append(np.sum(np.exp(lp) * (lp - lq), axis=-1))
        same_top.append(np.argmax(lp, axis=-1) == np.argmax(lq, axis=-1))
    kl, top = np.concatenate(kls), np.concatenate(same_top)
    return {
        "positions": int(kl.size),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "same_top_token": float(top.mean()),
    }


def greedy_answers(base, test, token_lists, n_new: int) -> dict:
    """Each prompt's n_new greedy tokens with either model: how many agree, and where the others
    part."""
    a = minfer_jax.generate_batch(base, token_lists, max_new_tokens=n_new)
    b = minfer_jax.generate_batch(test, token_lists, max_new_tokens=n_new)
    parted = {}
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = list(x.tokens), list(y.tokens)
        if x != y:
            parted[i] = next(
                (j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))
            )
    return {
        "prompts": len(token_lists),
        "same_answers": len(token_lists) - len(parted),
        "first_difference": parted,
    }


def compare(path, cache_types: tuple[str, str], texts, n_new: int = 0, **load) -> dict:
    """The whole check on the model at path (None: the built-in one): JSON-ready results."""
    base = minfer_jax.load(path, **load)
    test = minfer_jax.load(path, cache_type_k=cache_types[0], cache_type_v=cache_types[1], **load)
    token_lists = [base.tokenizer.encode(t) for t in texts]
    out = {
        "model": os.path.basename(base.source),
        "cache": {"base": str(base.cache_dtype), "k": cache_types[0], "v": cache_types[1]},
        **divergence(base, test, token_lists),
    }
    if n_new:
        out["greedy"] = greedy_answers(base, test, token_lists, n_new)
    return out


SECRET = "violet-harbor-7319"
NEEDLE = f" The passphrase of the old archive is {SECRET}. Remember it. "
QUESTION = "What is the passphrase of the old archive? Answer with the passphrase only."


def haystack(tokenizer, texts, n_tokens: int, depth: float) -> list[dict]:
    """Chat messages: about n_tokens of the texts repeated, the needle at `depth` of them, then
    the question."""
    filler = " ".join(texts)
    per_copy = max(1, len(tokenizer.encode(filler)))
    body = " ".join([filler] * (n_tokens // per_copy + 1))
    ids = tokenizer.encode(body)[:n_tokens]
    cut = int(len(ids) * depth)
    text = tokenizer.decode(ids[:cut]) + NEEDLE + tokenizer.decode(ids[cut:])
    return [{"role": "user", "content": text + "\n\n" + QUESTION}]


def needle(path, cache_types, texts, n_tokens: int, depths, **load) -> dict:
    """Each depth's greedy answer with the float cache and with cache_types."""
    ctx = n_tokens + 512
    models = {
        "base": minfer_jax.load(path, ctx_size=ctx, **load),
        "test": minfer_jax.load(
            path, ctx_size=ctx, cache_type_k=cache_types[0], cache_type_v=cache_types[1], **load
        ),
    }
    rows = []
    for depth in depths:
        messages = haystack(models["base"].tokenizer, texts, n_tokens, depth)
        row = {"depth": depth}
        for name, model in models.items():
            out = minfer_jax.generate(model, messages, chat=True, max_new_tokens=24)
            row[name] = {
                "answer": out.text,
                "found": SECRET in out.text,
                "prompt_tokens": len(out.prompt_tokens),
            }
            print(f"depth {depth} {name}: {out.text!r}", file=sys.stderr, flush=True)
        row["same"] = row["base"]["answer"] == row["test"]["answer"]
        rows.append(row)
    base = models["base"]
    return {
        "model": os.path.basename(base.source),
        "needle_tokens": n_tokens,
        "cache": {"base": str(base.cache_dtype), "k": cache_types[0], "v": cache_types[1]},
        "rows": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF path (default: the built-in model)")
    p.add_argument("-ctk", "--cache-type-k", default="q8_0", choices=options.CACHE_TYPES)
    p.add_argument("-ctv", "--cache-type-v", default="q8_0", choices=options.CACHE_TYPES)
    p.add_argument("--prompts", default=PROMPTS, help="JSON {'prompts': [...]} of texts")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens per prompt (0: skip)")
    p.add_argument("--kernels", default=None, help="pallas | interpret | xla (default: platform's)")
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("--needle", type=int, default=0, help="haystack tokens (0: the KL check)")
    p.add_argument("--depths", default="0.5", help="needle positions, fractions (e.g. 0.1,0.9)")
    a = p.parse_args(argv)
    with open(a.prompts) as f:
        texts = json.load(f)["prompts"]
    if a.needle:
        depths = [float(d) for d in a.depths.split(",")]
        caches = (a.cache_type_k, a.cache_type_v)
        result = needle(a.model, caches, texts, a.needle, depths, kernels=a.kernels)
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    texts = texts[: a.limit] if a.limit else texts
    result = compare(
        a.model,
        (a.cache_type_k, a.cache_type_v),
        texts,
        a.gen,
        kernels=a.kernels,
        ctx_size=a.ctx_size,
    )
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
