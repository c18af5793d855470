"""Fold Nsight Compute's per-instruction SASS table into one row per opcode
(not part of the package).

usage: ncu -i REPORT.ncu-rep --page source --print-source sass --csv > sass.csv
       python tools/ncu_sass_summary.py sass.csv [--top 25]

Per opcode (predicates and modifiers after the first '.' dropped): static instruction count and
the sum of every numeric column whose name mentions executed instructions or stall samples, so
'where do the issue slots and stalls go' reads off one table (e.g. I2F, LDS/STS from layout
conversions, SHFL from reductions).
"""

import argparse
import collections
import csv
import io
import re
import sys


def _number(v: str):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def _opcode(src: str) -> str:
    src = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return src.split(" ")[0].split(".")[0] or "?"


def summarize(text: str, top: int) -> str:
    lines = text.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if '"Source"' in ln or ln.startswith("Address")), None
    )
    if start is None:
        return "no SASS table found; first lines:\n" + "\n".join(lines[:20])
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    cols = [c for c in rows[0] if c and re.search(r"Executed|Samples|Stall", c)]
    agg = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        if not r.get("Source"):
            continue
        op = _opcode(r["Source"])
        agg[op]["static"] += 1
        for c in cols:
            v = _number(r.get(c) or "")
            if v is not None:
                agg[op][c] += v
    key = next((c for c in cols if "Samples" in c), cols[0] if cols else "static")
    total = {c: sum(a[c] for a in agg.values()) or 1 for c in ["static", *cols]}
    out = [
        f"columns: {cols}",
        f"{'opcode':12s} {'static':>7s} " + " ".join(f"{c[:28]:>30s}" for c in cols),
    ]
    for op, a in sorted(agg.items(), key=lambda kv: -kv[1][key])[:top]:
        out.append(
            f"{op:12s} {a['static']:7.0f} "
            + " ".join(f"{a[c]:14.0f} ({100 * a[c] / total[c]:5.1f}%)      " for c in cols)
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="?", default="-")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    text = sys.stdin.read() if a.csv == "-" else open(a.csv).read()
    print(summarize(text, a.top))


if __name__ == "__main__":
    main()
