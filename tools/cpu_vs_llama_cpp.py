"""How fast does the CPU path prefill and decode the built-in model beside llama.cpp, in one run?

llama-cpp-python (n_threads=2) and minfer_jax take the same GGUF and the same prompt ids; each
engine runs `--reps` times, alternating, and the best rate of each is kept (other processes share
the cores: the best is the least disturbed). Decode is greedy for `-n` tokens; the greedy tokens of
both are compared.

    PYTHONPATH=. python tools/cpu_vs_llama_cpp.py -p 64 -n 64 --reps 3
    PYTHONPATH=. python tools/cpu_vs_llama_cpp.py --weights int8,dense   # A/B with the f32 path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import minfer_jax  # noqa: E402
from minfer_jax.files.model_source import resolve_model  # noqa: E402

PROMPT = (
    "Write a Python function that reads a CSV file of sales records, groups them by region and "
    "month, and prints a table of the totals. Explain each step of the code as you go, and handle "
    "missing values, malformed dates and duplicate rows. "
)


def _llama_argmax(llm) -> int:
    """The argmax of the last evaluated token's logits (eval keeps no scores without
    logits_all)."""
    row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return int(np.argmax(row))


def llama_run(llm, ids: list[int], n_gen: int) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode tokens/s, greedy tokens) of llama.cpp."""
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t
    out = [_llama_argmax(llm)]
    t = time.perf_counter()
    for _ in range(n_gen - 1):
        llm.eval([out[-1]])
        out.append(_llama_argmax(llm))
    decode_s = time.perf_counter() - t
    return len(ids) / prefill_s, (n_gen - 1) / decode_s, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF path (default: the built-in model)")
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument(
        "--weights",
        default="default",
        help="minfer_jax weight storages to run, comma-separated (load(weights=); default: the "
        "platform's)",
    )
    ap.add_argument("--no-llama", action="store_true", help="minfer_jax alone")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()

    path = resolve_model(a.model)
    models = {}
    for mode in a.weights.split(","):
        t = time.perf_counter()
        kw = {} if mode == "default" else {"weights": mode}
        models[mode] = minfer_jax.load(path, ctx_size=a.ctx_size, **kw)
        print(f"minfer_jax load ({models[mode].weight_mode}) {time.perf_counter() - t:.1f} s")
    first = next(iter(models.values()))
    ids = first.tokenizer.encode(PROMPT * (1 + a.n_prompt // 20))[: a.n_prompt]
    llm = None
    if not a.no_llama:
        from llama_cpp import Llama

        llm = Llama(path, n_threads=2, n_threads_batch=2, n_ctx=a.ctx_size, verbose=False)
    for model in models.values():  # compiles
        minfer_jax.generate(model, ids, max_new_tokens=a.n_gen, ignore_eos=True)
    rows: dict[str, list] = {}
    for rep in range(a.reps):
        # a new first token every repetition: the slot's prompt cache would otherwise serve the
        # prompt again (and prefill_tps counts only the uncached tokens)
        ids = [1000 + rep, *ids[1:]]
        for mode, model in models.items():
            r = minfer_jax.generate(model, ids, max_new_tokens=a.n_gen, ignore_eos=True)
            assert r.cached_tokens == 0, r.cached_tokens
            rows.setdefault(f"{mode}_tokens", []).append(r.tokens)
            rows.setdefault(f"{mode}_pp", []).append(r.prefill_tps)
            rows.setdefault(f"{mode}_tg", []).append(r.decode_tps)
        if llm is not None:
            pp, tg, llama_tokens = llama_run(llm, ids, a.n_gen)
            rows.setdefault("llama.cpp_tokens", []).append(llama_tokens)
            rows.setdefault("llama.cpp_pp", []).append(pp)
            rows.setdefault("llama.cpp_tg", []).append(tg)
    tokens = {k[: -len("_tokens")]: v[-1] for k, v in rows.items() if k.endswith("_tokens")}
    best = {k: max(v) for k, v in rows.items() if not k.endswith("_tokens")}
    print(f"model {path}  prompt {len(ids)} tokens, {a.n_gen} generated, reps {a.reps}, best of")
    for what in ("pp", "tg"):
        for mode in [*models, "llama.cpp"] if llm is not None else models:
            ratio = ""
            if llm is not None and mode != "llama.cpp":
                ratio = f"  {best[f'{mode}_{what}'] / best[f'llama.cpp_{what}']:5.2f}x llama.cpp"
            print(
                f"{what} {mode:10s} {best[f'{mode}_{what}']:7.1f} t/s{ratio}"
                f"   (all: {[round(x, 1) for x in rows[f'{mode}_{what}']]})"
            )
    ref = tokens.get("llama.cpp", next(iter(tokens.values())))
    for mode, toks in tokens.items():
        same = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), None)
        print(f"greedy tokens {mode}: {'identical' if same is None else f'differ at {same}'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, best=best, n_prompt=len(ids), n_gen=a.n_gen), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
