"""llama-batched-bench's mode: B sequences of PP prompt tokens each, then TG tokens decoded
together.

Columns as llama-batched-bench prints them: PP TG B N_KV T_PP S_PP T_TG S_TG T S (T_PP: all B
prompts prefilled, one after another in the plan's chunks; T_TG: one decode executable of TG steps
for the B rows). Timed after one warm-up run, on a fresh cache (engine_runs.time_batched).
"""

from __future__ import annotations

import json

from minfer_bench.bench.engine_runs import time_batched

COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def md_header() -> str:
    return (
        "| " + " | ".join(f"{c:>9}" for c in COLUMNS) + " |\n"
        "|" + "|".join("-" * 10 + ":" for _ in COLUMNS) + "|"
    )


def md_row(row: dict) -> str:
    def cell(c):
        v = row[c]
        return (
            f"{v:>9d}"
            if isinstance(v, int)
            else f"{v:>9.3f}"
            if c.startswith("T")
            else f"{v:>9.2f}"
        )

    return "| " + " | ".join(cell(c) for c in COLUMNS) + " |"


def run(model, label: str, pps, tgs, npls, *, seed: int, out_files, log) -> list[dict]:
    """Every (PP, TG, B) combination on one model, printed as it completes."""
    print(f"\nmodel: {label}\n\n{md_header()}", flush=True)
    rows = []
    for pp in pps:
        for tg in tgs:
            for b in npls:
                log(f"batched PP {pp} TG {tg} B {b}")
                row = time_batched(model, n_pp=pp, n_tg=tg, n_seqs=b, seed=seed)
                row["model"] = label
                print(md_row(row), flush=True)
                for f in out_files:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                rows.append(row)
    return rows
