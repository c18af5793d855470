r"""GPU: time few-token matmuls (a decode batch of 9 .. 64 rows) under every candidate kernel, in
one process.

usage: python tools/gemm_variants.py \
           --variants "route;dq;gemv8;gemm:bm=16,bn=64,bk=128,programs=512"
           [--shapes q4_k:3584x3584,...] [--nt 16,32,64] [--reps 20] [--jsonl out.jsonl]

Variants (';'-separated), each timed on every case beside the others:
  route                 what ops.matmul runs for this nt today (ops.kernel_case)
  dq                    dequantize to f16, then the float GEMM (the "dequant" prefill variant)
  gemvN                 the integer GEMV on groups of N <= 16 rows (weights read ceil(nt / N) times)
  gemm:FIELD=INT,...    the in-kernel-decode f16 GEMM (pallas/gemm.py) with GemmConfig fields
  i8:FIELD=INT,...      the int8 GEMM (pallas/gemm_int8.py) with Int8GemmConfig fields
`programs=P` (gemm, i8) picks the K split whose program count is nearest P instead of `splits`.
Every case is checked against its jnp reference. Not part of the package.
"""

import argparse
import dataclasses
import json

import jax.numpy as jnp

from cases import add_case_args, parse_cases  # tools/ is sys.path[0] when run as a script
from minfer_jax import ops
from minfer_jax.pallas import gemm, gemm_int8, gemv
from minfer_jax.quant.planes import get_format
from minfer_jax.sizes import round_up

from minfer_bench.bench import kernel_timing as KB


def parse_variant(text: str) -> tuple[str, dict]:
    kind, _, rest = text.strip().partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--variants: {item!r} is not FIELD=INT")
        fields[name.strip()] = (
            bool(int(value)) if name.strip() in ("magic_half", "field_major") else int(value)
        )
    if not (
        kind in ("route", "dq", "gemm", "i8") or (kind.startswith("gemv") and kind[4:].isdigit())
    ):
        raise SystemExit(f"--variants: unknown kind {kind!r}")
    return kind, fields


def build(kind: str, fields: dict, qt, n: int, k: int, nt: int, interpret: bool = False):
    """(label, call (x, planes) -> y, reference (x, planes) -> y) of one variant on one case."""
    impl = ops.Impl(kernels="interpret" if interpret else "pallas")
    if kind == "route":
        r, call, ref = ops.kernel_case(qt, n, nt, impl)
        return r.label, call, ref
    if kind == "dq":
        return (
            "dq+gemm",
            lambda x, w: ops._dequant_gemm(x, w, qt, n, interpret),
            ops.route_reference(ops.Route("gemm"), qt, n),
        )
    if kind.startswith("gemv"):
        g = int(kind[4:])

        def call(x, w):
            return jnp.concatenate(
                [
                    gemv.gemv_int8(x[i : i + g], w, qtype=qt, n_out=n, interpret=interpret)
                    for i in range(0, nt, g)
                ]
            )

        return kind, call, lambda x, w: gemv.gemv_int8_reference(x, w, qtype=qt, n_out=n)
    mod, cfg_cls = (
        (gemm, gemm.GemmConfig) if kind == "gemm" else (gemm_int8, gemm_int8.Int8GemmConfig)
    )
    fields = dict(fields)
    target = fields.pop("programs", None)
    cfg = dataclasses.replace(mod.choose_config(qt, nt, n, k), **fields)
    if target:  # the product's own split rule (whole blocks per split), at this program target
        bk = cfg.bk if kind == "gemm" else gemm_int8.XBLOCK
        cfg = dataclasses.replace(
            cfg,
            splits=gemm.few_token_splits(
                get_format(qt), n, k, cfg.bn, bk, target, round_up(nt, cfg.bm) // cfg.bm
            ),
        )
    fn = gemm.gemm if kind == "gemm" else gemm_int8.gemm_int8
    ref = gemm.gemm_reference if kind == "gemm" else gemm_int8.gemm_int8_reference
    return (
        f"{kind}:{cfg}",
        lambda x, w: fn(x, w, qtype=qt, n_out=n, config=cfg, interpret=interpret),
        lambda x, w: ref(x, w, qtype=qt, n_out=n),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variants", required=True, help="';'-separated: route, dq, gemvN, gemm:..., i8:..."
    )
    add_case_args(ap, nt="16,32,64")
    ap.add_argument("--jsonl", help="also append one JSON line per timed case here")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="Pallas interpreter (a CPU smoke test; no timing value)",
    )
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants.split(";") if v.strip()]
    for qt, n, k, nt in parse_cases(a):
        for kind, fields in variants:
            try:
                label, call, ref = build(kind, fields, qt, n, k, nt, a.interpret)
                res = KB.run_case(qt, n, k, nt, call, ref, impl=kind, reps=a.reps, trials=3)
            except Exception as e:  # noqa: BLE001 - one failing lowering must not hide the rest
                print(
                    f"{kind} {fields} {qt.name} {n}x{k} nt={nt} FAILED {type(e).__name__}: "
                    f"{str(e)[:400]}",
                    flush=True,
                )
                continue
            print(
                f"{qt.name:5s} {n:6d}x{k:6d} nt={nt:3d} {res.us:8.2f} us {res.gbps:7.1f} GB/s "
                f"err={res.rel_err:.1e}  {label}",
                flush=True,
            )
            if a.jsonl:
                with open(a.jsonl, "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "variant": label,
                                "qtype": qt.name,
                                "n": n,
                                "k": k,
                                "nt": nt,
                                "us": res.us,
                                "gbps": res.gbps,
                                "rel_err": res.rel_err,
                            }
                        )
                        + "\n"
                    )


if __name__ == "__main__":
    main()
