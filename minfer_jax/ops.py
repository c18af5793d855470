"""The one matmul every weight goes through, and the static dispatch that picks its kernel.

`matmul(x, w, impl)` with x [..., K] and w a weight [N, K] returns [..., N] f32. The token count
nt = prod(x.shape[:-1]) is a Python int at trace time, so the choice is made once per shape
bucket and compiled into that bucket's executable:

    dense weight (CPU "dense" mode)   -> XLA dot
    QWeight, impl.kernels == "xla"    -> reference: whole-matrix decode + XLA dot
    QWeight, nt <= GEMV_MAX_NT        -> Pallas GEMV (pallas/gemv.py)
    QWeight, nt >  GEMV_MAX_NT        -> prefill, by impl.gemm:
        "auto" (default)  -> "dequant" for nt >= DEQUANT_MIN_NT, else "f16"
        "f16"             -> Pallas GEMM decoding weight tiles in-kernel (pallas/gemm.py)
        "dequant"         -> Pallas dequantization into a transient f16 matrix
                             (pallas/dequant.py), then the same GEMM on float weights
        "int8"            -> int8 activations x int8 quants (pallas/gemm_int8.py; block
                             formats; opt-in: slower on the H200, docs/BENCHMARKS.md)
Float weights (F16/BF16/F32) always take the plain GEMM.

"pallas" runs the Triton kernels on the GPU; "interpret" runs the same kernels in Pallas'
interpreter (CPU tests of the full model through the kernels).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from minfer_jax.model.weights import DenseWeight, Weight
from minfer_jax.pallas import dequant, gemm, gemm_int8, gemv, tiles
from minfer_jax.quant.planes import QType, get_format

GEMV_MAX_NT = gemv.MAX_NT  # nt = 1 .. 8 -> GEMV: weights read once for all tokens
KERNEL_MODES = ("pallas", "interpret", "xla")
GEMM_VARIANTS = ("auto", "f16", "dequant", "int8")
# "auto": from this many tokens dequantize-then-GEMM. On the H200 it won at every token count
# swept, 16 .. 512 (4096 x 14336: Q4_K 169 vs 363 us at 16 tokens, 182 vs 362 at 512; Q4_0 154
# vs 162 and 171 vs 276): the f16 write costs less than decoding every weight tile once per token
# block, and a 16-token in-kernel GEMM has only Npad / bn programs (docs/BENCHMARKS.md). So every
# prefill size (nt > GEMV_MAX_NT) takes it; "f16" stays selectable.
DEQUANT_MIN_NT = GEMV_MAX_NT + 1
_FLOAT_QTYPE = {jnp.dtype(jnp.float16): QType.F16, jnp.dtype(jnp.bfloat16): QType.BF16,
                jnp.dtype(jnp.float32): QType.F32}


@dataclasses.dataclass(frozen=True)
class Impl:
    """Static execution choices, part of every jit's static arguments."""

    kernels: str = "xla"  # "pallas" | "interpret" | "xla"
    gemv_max_nt: int = GEMV_MAX_NT
    gemm: str = "auto"  # prefill variant: "auto" | "f16" (decode in-kernel) | "dequant" | "int8"

    def __post_init__(self):
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"Impl.kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")
        if not 1 <= self.gemv_max_nt <= gemv.NT_PAD:
            raise ValueError(f"gemv_max_nt must be in 1..{gemv.NT_PAD}")
        if self.gemm not in GEMM_VARIANTS:
            raise ValueError(f"Impl.gemm must be one of {GEMM_VARIANTS}, got {self.gemm!r}")


def default_impl(platform: str | None = None) -> Impl:
    platform = platform or jax.default_backend()
    return Impl(kernels="pallas" if platform == "gpu" else "xla")


def matmul(x: jax.Array, w: Weight, impl: Impl) -> jax.Array:
    """x [..., K] . w[N, K]^T -> [..., N] float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    nt = math.prod(lead)
    x2 = x.reshape(nt, k)
    if isinstance(w, DenseWeight):
        wm = w.w if w.transposed else w.w.T  # [K, N]
        y = jnp.dot(x2.astype(wm.dtype), wm, preferred_element_type=jnp.float32)
    else:
        n = w.shape[0]
        if impl.kernels == "xla":
            y = tiles.dequant_matmul_reference(x2, w.planes, qtype=w.qtype, n_out=n)
        elif nt <= impl.gemv_max_nt:
            y = gemv.gemv(x2, w.planes, qtype=w.qtype, n_out=n, interpret=impl.kernels == "interpret")
        else:
            y = _prefill_matmul(x2, w, gemm_variant(impl.gemm, w.qtype, nt), impl.kernels == "interpret")
    return y.reshape(*lead, y.shape[-1])


def gemm_variant(requested: str, qtype: QType, nt: int) -> str:
    """The prefill kernel that runs: float weights always take the plain GEMM ("f16")."""
    if get_format(qtype).ints is None:
        return "f16"
    if requested == "auto":
        return "dequant" if nt >= DEQUANT_MIN_NT else "f16"
    return requested


def _prefill_matmul(x: jax.Array, w, variant: str, interpret: bool) -> jax.Array:
    n = w.shape[0]
    if variant == "int8":
        return gemm_int8.gemm_int8(x, w.planes, qtype=w.qtype, n_out=n, interpret=interpret)
    if variant == "dequant":
        wd = dequant.dequantize(w.planes, qtype=w.qtype, interpret=interpret)  # [Npad, K] f16, transient
        return gemm.gemm(x, {"w": wd}, qtype=_FLOAT_QTYPE[wd.dtype], n_out=n, interpret=interpret)
    return gemm.gemm(x, w.planes, qtype=w.qtype, n_out=n, interpret=interpret)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., d] f32 -> normalized * weight, computed in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
