"""GPU: A/B the decode GEMV of the working tree against the one of a git revision, in one process.

usage: python tools/gemv_ab.py --base 700604b[,DIR,...] [--shapes q5_0:4096x14336,...] [--nt 1,8] [--reps 20]

Machines lent for the H200 differ by up to ~8 % in these kernel times, so a change is only judged
against a baseline timed on the same machine in the same run. Each base is a git revision, whose
`pallas/gemv.py` and `quant/int8_words.py` are extracted with `git show`, or a directory holding
those two files (a code variant, or a revision the device copy's stale .git lacks); either goes
into a temporary package (the rest of minfer_jax is shared: planes, tiles, the reference). Every
case is timed by bench.kernel_timing.run_case (device timeline) for each base and the working tree, each
checked against the working tree's reference. Not part of the package.
"""

import argparse
import importlib
import os
import subprocess
import sys
import tempfile

from minfer_jax.bench import kernel_timing as KB
from minfer_jax.bench import parsing
from minfer_jax.pallas import gemv as G

DEFAULT_SHAPES = "q4_0:4096x14336,q5_0:4096x14336,q4_k:4096x14336,q6_k:4096x14336,q8_0:4096x14336"


def load_base(rev: str, root: str = ".", index: int = 0):
    """The gemv module of `rev` (a git revision or a directory with gemv.py and int8_words.py, that
    revision's / directory's int8_words imported by it) as a fresh module object."""
    pkg = tempfile.mkdtemp(prefix="gemv_ab_")
    name = f"gemv_ab_base{index}"
    os.makedirs(os.path.join(pkg, name))
    for src, dst in (("minfer_jax/pallas/gemv.py", "gemv.py"), ("minfer_jax/quant/int8_words.py", "int8_words.py")):
        if os.path.isdir(rev):
            with open(os.path.join(rev, dst)) as fh:
                text = fh.read()
        else:
            text = subprocess.run(["git", "-C", root, "show", f"{rev}:{src}"], check=True, capture_output=True,
                                  text=True).stdout
        text = text.replace("from minfer_jax.quant import int8_words", f"from {name} import int8_words")
        with open(os.path.join(pkg, name, dst), "w") as fh:
            fh.write(text)
    open(os.path.join(pkg, name, "__init__.py"), "w").close()
    sys.path.insert(0, pkg)
    return importlib.import_module(f"{name}.gemv")


def add_case_args(ap: argparse.ArgumentParser) -> None:
    """--shapes, --nt, --reps (shared with tools/gemv_variants.py)."""
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="TYPE:OUTxIN list, as scripts/bench.py --shapes")
    ap.add_argument("--nt", default="1,8", help="token counts, as scripts/bench.py --nt")
    ap.add_argument("--reps", type=int, default=20)


def parse_cases(a: argparse.Namespace) -> list[tuple]:
    """(qtype, out, in, nt) for every shape x token count."""
    return [(qt, n, k, nt) for qt, n, k in parsing.parse_shapes(a.shapes) for nt in parsing.parse_int_range(a.nt, "--nt")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revisions or variant directories to compare against, comma-separated")
    add_case_args(ap)
    a = ap.parse_args()
    cases = parse_cases(a)
    bases = [(rev, load_base(rev, index=i)) for i, rev in enumerate(a.base.split(","))]
    for qt, n, k, nt in cases:
        for tag, mod in (*bases, ("new", G)):
            f = lambda x, w, mod=mod: mod.gemv(x, w, qtype=qt, n_out=n)  # noqa: E731
            r = lambda x, w: G.gemv_reference(x, w, qtype=qt, n_out=n)  # noqa: E731
            try:
                res = KB.run_case(qt, n, k, nt, f, r, impl="gemv", reps=a.reps)
                print(f"{tag:12s} {qt.name:5s} {n:6d}x{k:6d} nt={nt} {res.us:8.2f} us {res.gbps:7.1f} GB/s "
                      f"err={res.rel_err:.1e} {mod.choose_config(qt, n, k, nt)}", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing lowering must not hide the rest
                print(f"{tag} {qt.name} {n}x{k} nt={nt} FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)


if __name__ == "__main__":
    main()
