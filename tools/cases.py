"""Case arguments shared by the kernel-variant tools: --shapes, --nt, --reps ->
(qtype, out, in, nt)."""

import argparse

from minfer_bench.bench import parsing

# The 7B Q4_K_M mix's matmuls (Qwen2.5-7B: d 3584, d_ff 18944, kv 512) and one ggml row.
DEFAULT_SHAPES = "q4_k:3584x3584,q4_k:18944x3584,q4_k:3584x18944,q6_k:3584x18944,q4_k:4096x14336"


def add_case_args(ap: argparse.ArgumentParser, nt: str = "1,8") -> None:
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="TYPE:OUTxIN list, as scripts/bench.py --shapes"
    )
    ap.add_argument("--nt", default=nt, help="token counts, as scripts/bench.py --nt")
    ap.add_argument("--reps", type=int, default=20)


def parse_cases(a: argparse.Namespace) -> list[tuple]:
    """(qtype, out, in, nt) for every shape x token count."""
    return [
        (qt, n, k, nt)
        for qt, n, k in parsing.parse_shapes(a.shapes)
        for nt in parsing.parse_int_range(a.nt, "--nt")
    ]
