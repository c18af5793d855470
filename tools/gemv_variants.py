"""GPU: time the decode GEMV under its chosen config and under config overrides, in one process.

usage: python tools/gemv_variants.py --variants "x_first=1;prequant=1;bn=64,num_warps=8"
           [--shapes q5_0:4096x14336,...] [--nt 1,8] [--reps 20] [--jsonl out.jsonl]

Each variant is a comma-separated list of GemvConfig fields (ints; 0/1 for flags) applied with
dataclasses.replace to gemv.choose_config's pick for every case (as_nt=N: its pick for N tokens,
e.g. as_nt=1 runs every token count with the one-token config); the default config is always
timed first. Same machine, same process: machines lent for the H200 differ by up to ~8 %, so a
change of tiles is only judged against its baseline timed beside it. Every case is checked
against gemv_reference. Not part of the package.
"""

import argparse
import dataclasses
import json

from cases import add_case_args, parse_cases  # tools/ is sys.path[0] when run as a script
from minfer_jax.pallas import gemv as G

from minfer_bench.bench import kernel_timing as KB


def parse_variants(text: str) -> list[dict]:
    """Parse "a=1,b=2;c=0" -> [{"a": 1, "b": 2}, {"c": 0}], fields checked against GemvConfig."""
    fields = {f.name: f.type for f in dataclasses.fields(G.GemvConfig)} | {"as_nt": int}
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        v = {}
        for item in part.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in fields:
                raise SystemExit(
                    f"--variants: {item!r} is not FIELD=INT with FIELD one of {sorted(fields)}"
                )
            try:
                v[name] = int(value)
            except ValueError:
                raise SystemExit(f"--variants: {item!r}: value must be an integer") from None
            if fields[name] in (bool, "bool"):
                v[name] = bool(v[name])
        out.append(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--variants", required=True, help="';'-separated overrides, each 'field=int,...'"
    )
    add_case_args(ap)
    ap.add_argument("--jsonl", help="also append one JSON line per timed case here")
    a = ap.parse_args()
    variants = [{}] + parse_variants(a.variants)
    cases = parse_cases(a)
    for qt, n, k, nt in cases:
        for v in variants:
            tag = ",".join(f"{k}={val}" for k, val in v.items()) or "default"
            fields = {f: val for f, val in v.items() if f != "as_nt"}
            cfg = dataclasses.replace(G.choose_config(qt, n, k, v.get("as_nt", nt)), **fields)

            def f(x, w, cfg=cfg, qt=qt, n=n):
                return G.gemv_int8(x, w, qtype=qt, n_out=n, config=cfg)

            def r(x, w, qt=qt, n=n):
                return G.gemv_int8_reference(x, w, qtype=qt, n_out=n)

            try:
                res = KB.run_case(qt, n, k, nt, f, r, impl="gemv", reps=a.reps)
            except Exception as e:  # noqa: BLE001 - one failing lowering must not hide the rest
                print(
                    f"{tag:24s} {qt.name:5s} {n}x{k} nt={nt} FAILED {type(e).__name__}: "
                    f"{str(e)[:600]}",
                    flush=True,
                )
                continue
            print(
                f"{tag:24s} {qt.name:5s} {n:6d}x{k:6d} nt={nt} {res.us:8.2f} us {res.gbps:7.1f} "
                f"GB/s err={res.rel_err:.1e} {cfg}",
                flush=True,
            )
            if a.jsonl:
                with open(a.jsonl, "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "variant": tag,
                                "qtype": qt.name,
                                "n": n,
                                "k": k,
                                "nt": nt,
                                "us": res.us,
                                "gbps": res.gbps,
                                "rel_err": res.rel_err,
                                "config": dataclasses.asdict(cfg),
                            }
                        )
                        + "\n"
                    )


if __name__ == "__main__":
    main()
