"""The one matmul every weight goes through, and the static dispatch that picks its kernel.

`matmul(x, w, impl)` with x [..., K] and w a weight [N, K] returns [..., N] f32. The token count
nt = prod(x.shape[:-1]) is a Python int at trace time, so the choice is made once per shape
bucket and compiled into that bucket's executable:

    dense weight (CPU "dense" mode)   -> XLA dot
    QWeight, impl.kernels == "xla"    -> reference: whole-matrix decode + XLA dot
    QWeight, nt <= GEMV_MAX_NT        -> Pallas GEMV (pallas/gemv.py)
    QWeight, nt >  GEMV_MAX_NT        -> Pallas GEMM (pallas/gemm.py; impl.gemm == "int8":
                                         pallas/gemm_int8.py for block formats, opt-in until
                                         it has been measured on the GPU)

"pallas" runs the Triton kernels on the GPU; "interpret" runs the same kernels in Pallas'
interpreter (CPU tests of the full model through the kernels).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from minfer_jax.model.weights import DenseWeight, Weight
from minfer_jax.pallas import gemm, gemm_int8, gemv, tiles
from minfer_jax.quant.planes import get_format

GEMV_MAX_NT = gemv.MAX_NT  # nt = 1 .. 8 -> GEMV: weights read once for all tokens
KERNEL_MODES = ("pallas", "interpret", "xla")
GEMM_VARIANTS = ("f16", "int8")


@dataclasses.dataclass(frozen=True)
class Impl:
    """Static execution choices, part of every jit's static arguments."""

    kernels: str = "xla"  # "pallas" | "interpret" | "xla"
    gemv_max_nt: int = GEMV_MAX_NT
    gemm: str = "f16"  # prefill GEMM variant: "f16" dequant-in-kernel or "int8" (block formats)

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
        elif impl.gemm == "int8" and get_format(w.qtype).ints is not None:
            y = gemm_int8.gemm_int8(x2, w.planes, qtype=w.qtype, n_out=n, interpret=impl.kernels == "interpret")
        else:
            y = gemm.gemm(x2, w.planes, qtype=w.qtype, n_out=n, interpret=impl.kernels == "interpret")
    return y.reshape(*lead, y.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., d] f32 -> normalized * weight, computed in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
