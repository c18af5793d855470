"""Which expert kernels run a mixture-of-experts layer for nt tokens: one table (EXPERT_PATHS),
read by ops.expert_route at trace time, that a measurement changes by one line.

A path is a grouped-GEMV path (pallas/expert_gemv.py: the fused gate+up+activation launch, then
the down+weights+sum launch of the variant GEMV_PATHS names) or a sorted grouped-GEMM variant
(pallas/expert_gemm.py VARIANTS, for gate, up and down alike). tools/expert_bench.py times every
path at every token count of a Qwen3-30B-A3B layer (router + gate/up + down+sum, one executable
per case) and prints the table its fastest paths give (`--table`).
"""

from __future__ import annotations

from minfer_jax.pallas import expert_gemm, expert_gemv

# grouped-GEMV path -> its down+sum launch variant (expert_gemv.DOWN_VARIANTS)
GEMV_PATHS = {"gemv": "fused", "gemv-split": "split", "gemv-pairs": "pairs"}
PATHS = (*GEMV_PATHS, *expert_gemm.VARIANTS)

# (largest token count of the range, path), ranges in increasing order; None: every larger count.
# GEMV rows come first (the deterministic mode computes every row as the one-token row does).
# Not measured on a GPU yet: "gemv" up to llama.cpp's MMVQ limit of 8 tokens, "ragged" beyond
# (whose dense expansion in XLA costs E x the FLOPs: expert_gemm's docstring); the H100's first
# decode profile has the fused down launch at 0.40 TB/s (docs/BENCHMARKS.md). Measure with
# `python tools/expert_bench.py --suite` and paste its table here.
EXPERT_PATHS: tuple[tuple[int | None, str], ...] = (
    (8, "gemv"),
    (None, "ragged"),
)


def check_table(table: tuple[tuple[int | None, str], ...]) -> None:
    """ValueError unless table is a valid EXPERT_PATHS: known paths, increasing bounds, the last
    None, GEMV rows first (at least one)."""
    bounds = [b for b, _ in table]
    if not table or bounds[-1] is not None or None in bounds[:-1]:
        raise ValueError(f"expert path table needs bounds ending in None, got {bounds}")
    if any(b <= a for a, b in zip(bounds[:-2], bounds[1:-1])):  # type: ignore[operator]
        raise ValueError(f"expert path table's bounds must increase, got {bounds}")
    paths = [p for _, p in table]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"expert paths {unknown} are not among {PATHS}")
    kinds = [p in GEMV_PATHS for p in paths]
    if not kinds[0] or kinds != sorted(kinds, reverse=True):
        raise ValueError(f"expert path table must start with its GEMV rows, got {paths}")


def path(nt: int, table=None) -> str:
    """The path of the first row whose range holds nt tokens (table: default EXPERT_PATHS, read
    at every call)."""
    for bound, name in table or EXPERT_PATHS:
        if bound is None or nt <= bound:
            return name
    raise ValueError(f"expert path table {table} ends without a None bound")


def gemv_max_nt(table=None) -> int | None:
    """The most tokens a grouped-GEMV path takes (the GEMV rows' last bound; None: any)."""
    return [b for b, p in table or EXPERT_PATHS if p in GEMV_PATHS][-1]


def down_variant(nt: int, deterministic: bool = False, table=None) -> str:
    """The down+sum launch variant of the GEMV path for nt tokens; deterministic: the one-token
    row's at every count (each row computed as alone), as for a GEMM path in that mode."""
    name = path(1 if deterministic else nt, table)
    return GEMV_PATHS.get(name, GEMV_PATHS[path(1, table)])


check_table(EXPERT_PATHS)
assert all(v in expert_gemv.DOWN_VARIANTS for v in GEMV_PATHS.values())
