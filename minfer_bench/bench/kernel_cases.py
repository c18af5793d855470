"""Kernel cases: which (type, out, in) matmuls to time -- ggml's reference rows, a model's matmuls
as the loader stores them (model.weights.layer_matmuls), an explicit list -- and one case's row.

Each case is timed for a list of token counts nt through ops.matmul's dispatch (GEMV for
nt <= ops.GEMV_MAX_NT, GEMM above, or the XLA reference), inside one executable; on a GPU the
time is the executable's span on the device timeline (bench.kernel_timing.run_case says why).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from minfer_bench.bench.env import Env, utc_stamp

# ggml's CUDA MUL_MAT times on the H200 (llama.cpp built from the llama-cpp-python 0.3.36 sdist,
# test-backend-ops perf -o MUL_MAT, f32 activations): (type, out, in) -> {nt: microseconds}.
# --ggml-shapes runs exactly these cases.
GGML_REFERENCE_US: dict[tuple[str, int, int], dict[int, float]] = {
    ("Q4_0", 4096, 14336): {1: 14.6, 8: 32.7, 512: 307.0},
    ("Q5_0", 4096, 14336): {1: 17.6},
    ("Q8_0", 4096, 14336): {1: 23.2, 512: 311.0},
    ("Q4_K", 4096, 14336): {1: 15.7, 8: 46.5, 512: 347.0},
    ("Q6_K", 4096, 14336): {1: 24.1, 512: 423.0},
    ("Q4_K", 4096, 4096): {1: 7.3},
    ("Q4_K", 14336, 4096): {1: 19.6},
}

# The weight matrices of one Qwen2 layer, in the order a token meets them, then the head.
_ROLE_ORDER = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "output",
]


@dataclasses.dataclass
class KernelCase:
    qtype: Any  # QType
    n: int  # out
    k: int  # in
    nts: tuple[int, ...]
    tensors: str = ""  # roles, e.g. "ffn_down x22, ffn_down x6"
    count: int | None = None  # calls per decode token in the model
    source: str = ""


def model_matmul_cases(
    tensor_types: dict[str, Any],
    shapes: dict[str, tuple],
    tied: bool,
    nts: Sequence[int],
    source: str,
) -> list[KernelCase]:
    """Distinct (type, out, in) of the matmuls a model runs, with the tensors behind each: every
    layer's matmuls as the loader stores them (model.weights.layer_matmuls: neighbouring q/k/v and
    gate/up projections of one format are one matmul, e.g. "attn_q+attn_k" [d + kv, d] when v has
    another format), then the head (a tied token_embd is the head's matrix)."""
    from minfer_jax.model.weights import layer_matmuls
    from minfer_jax.quant.planes import QType

    groups: dict[tuple, collections.Counter] = {}

    def add(qtype, n: int, k: int, role: str):
        groups.setdefault((QType(qtype), int(n), int(k)), collections.Counter())[role] += 1

    layers = sorted({int(m.group(1)) for name in shapes if (m := re.match(r"blk\.(\d+)\.", name))})
    for layer in layers:
        for mm in layer_matmuls(tensor_types, shapes, layer):
            add(mm.qtype, mm.n, mm.k, mm.role)
    head = "token_embd.weight" if tied else "output.weight"
    add(tensor_types[head], shapes[head][0], shapes[head][1], "output")

    def rank(role: str) -> int:
        return _ROLE_ORDER.index(role.split("+")[0])

    def order(item):
        (qt, n, k), roles = item
        return (min(rank(r) for r in roles), qt.name, n, k)

    cases = []
    for (qt, n, k), roles in sorted(groups.items(), key=order):
        label = ", ".join(
            f"{r} x{c}" if c > 1 else r
            for r, c in sorted(roles.items(), key=lambda rc: rank(rc[0]))
        )
        cases.append(
            KernelCase(
                qt, n, k, tuple(nts), tensors=label, count=sum(roles.values()), source=source
            )
        )
    return cases


def ggml_cases(nts: Sequence[int] | None) -> list[KernelCase]:
    """ggml's reference rows (GGML_REFERENCE_US), at `nts` or at ggml's own token counts."""
    from minfer_jax.quant.planes import QType

    return [
        KernelCase(
            QType[q],
            n,
            k,
            tuple(nts) if nts else tuple(sorted(ref)),
            source="ggml (test-backend-ops)",
        )
        for (q, n, k), ref in GGML_REFERENCE_US.items()
    ]


def auto_kernel_reps(wbytes: int, env: Env, impl: str) -> int:
    """Calls per timed executable: 40, fewer when the weight copies would not fit a budget."""
    if impl == "interpret":
        return 2
    budget = (16 << 30) if env.platform == "gpu" else (1 << 30)
    return int(max(2, min(40, budget // max(wbytes, 1))))


def run_kernel_case(
    case: KernelCase,
    nt: int,
    env: Env,
    *,
    impl: str,
    trials: int,
    reps: int | None,
    warmup: bool,
    seed: int,
    gemm: str = "auto",
) -> dict:
    """Time one case at nt tokens (bench.kernel_timing.run_case) and return its row
    (KERNEL_FIELDS)."""
    from minfer_jax import ops

    from minfer_bench.bench import kernel_timing as kb

    route, call, reference = ops.kernel_case(
        case.qtype, case.n, nt, ops.Impl(kernels=impl, gemm=gemm)
    )
    wbytes = kb.weight_nbytes(case.qtype, case.n, case.k)
    nreps = reps or auto_kernel_reps(wbytes, env, impl)
    test_time = utc_stamp()
    res = kb.run_case(
        case.qtype,
        case.n,
        case.k,
        nt,
        call,
        reference,
        impl=impl,
        reps=nreps,
        trials=trials,
        seed=seed,
        warmup=warmup,
    )
    kind = route.kind
    avg = res.avg_us
    gbps = wbytes / avg / 1e3 if avg > 0 else None
    pct = 100.0 * gbps * 1e9 / env.mem_bw if (gbps and env.mem_bw) else None
    ggml = GGML_REFERENCE_US.get((case.qtype.name, case.n, case.k), {}).get(nt)
    return {
        "build_commit": env.build_commit,
        "build_number": env.build_number,
        "cpu_info": env.cpu_info,
        "gpu_info": env.gpu_info,
        "backends": env.backend,
        "jax_version": env.jax_version,
        "device": env.device_label,
        "model_filename": case.source,
        "qtype": case.qtype.name,
        "n_out": case.n,
        "n_in": case.k,
        "nt": nt,
        "kernel": kind,
        "impl": impl,
        "tensors": case.tensors,
        "count": case.count,
        "weight_bytes": wbytes,
        "reps": nreps,
        "test_time": test_time,
        "avg_us": avg,
        "stddev_us": res.stddev_us,
        "best_us": res.us,
        "gbps": gbps,
        "mem_bw_gbps": None if env.mem_bw is None else env.mem_bw / 1e9,
        "pct_mem_bw": pct,
        "tflops": 2.0 * nt * case.n * case.k / avg / 1e6 if avg > 0 else None,
        "rel_err": res.rel_err,
        "compile_s": res.compile_s,
        "ggml_us": ggml,
        "speedup_vs_ggml": (ggml / avg) if (ggml and avg > 0) else None,
        "command": env.command,
        "samples_us": res.samples_us,
    }
