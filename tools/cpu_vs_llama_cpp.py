"""How fast does the CPU path prefill and decode the built-in model beside llama.cpp, in one run?

llama-cpp-python (n_threads=2) and minfer_jax take the same GGUF and the same prompt ids; each
engine runs `--reps` times, alternating, and the best rate of each is kept (other processes share
the cores: the best is the least disturbed). Decode is greedy for `-n` tokens; the greedy tokens of
both are compared.

    PYTHONPATH=. python tools/cpu_vs_llama_cpp.py -p 64 -n 64 --reps 3
    PYTHONPATH=. python tools/cpu_vs_llama_cpp.py --weights dense     # the f32 dense path, for A/B
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
    ap.add_argument("--weights", default=None, help="minfer_jax's weight storage (load(weights=))")
    ap.add_argument("--no-llama", action="store_true", help="minfer_jax alone")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()

    path = resolve_model(a.model)
    t = time.perf_counter()
    kw = {} if a.weights is None else {"weights": a.weights}
    model = minfer_jax.load(path, ctx_size=a.ctx_size, **kw)
    load_s = time.perf_counter() - t
    ids = model.tokenizer.encode(PROMPT * (1 + a.n_prompt // 20))[: a.n_prompt]
    llm = None
    if not a.no_llama:
        from llama_cpp import Llama

        llm = Llama(path, n_threads=2, n_threads_batch=2, n_ctx=a.ctx_size, verbose=False)
    ours = minfer_jax.generate(model, ids, max_new_tokens=a.n_gen, ignore_eos=True)  # compiles
    rows: dict[str, list] = {"ours_pp": [], "ours_tg": [], "llama_pp": [], "llama_tg": []}
    llama_tokens: list[int] = []
    for _ in range(a.reps):
        r = minfer_jax.generate(model, ids, max_new_tokens=a.n_gen, ignore_eos=True)
        rows["ours_pp"].append(r.prefill_tps)
        rows["ours_tg"].append(r.decode_tps)
        if llm is not None:
            pp, tg, llama_tokens = llama_run(llm, ids, a.n_gen)
            rows["llama_pp"].append(pp)
            rows["llama_tg"].append(tg)
    best = {k: max(v) if v else float("nan") for k, v in rows.items()}
    print(f"model {path}  prompt {len(ids)} tokens, {a.n_gen} generated, reps {a.reps}")
    print(f"minfer_jax load {load_s:.1f} s, weights {model.weight_mode}")
    for what in ("pp", "tg"):
        o, ll = best[f"ours_{what}"], best[f"llama_{what}"]
        print(
            f"{what}: minfer_jax {o:7.1f} t/s  llama.cpp {ll:7.1f} t/s  ratio {o / ll:5.2f}x"
            f"   (all: {[round(x, 1) for x in rows[f'ours_{what}']]} vs "
            f"{[round(x, 1) for x in rows[f'llama_{what}']]})"
        )
    if llama_tokens:
        same = next((i for i, (x, y) in enumerate(zip(ours.tokens, llama_tokens)) if x != y), None)
        print(f"greedy tokens: {'identical' if same is None else f'first difference at {same}'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, best=best, n_prompt=len(ids), n_gen=a.n_gen), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
