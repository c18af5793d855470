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
Float weights (F16/BF16/F32) always take the plain GEMM. `norm_matmuls` is the same dispatch for
matmuls that read an RMSNorm's output: on the GEMV path the norm is folded into them.

"pallas" runs the Triton kernels on the GPU; "interpret" runs the same kernels in Pallas'
interpreter (CPU tests of the full model through the kernels).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from minfer_jax import validate
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.model.weights import DenseWeight, QWeight, Weight
from minfer_jax.pallas import dequant, gemm, gemm_int8, gemv, tiles
from minfer_jax.quant import int8_words
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
    # GEMV path: RMSNorm folded into the matmuls that read it (norm_matmuls). Off by default: on
    # the H200 it did not pay (0.5B tg128 1,034 / 1,045 tok/s folded vs 1,059 not; XLA keeps the
    # rsqrt reduction as its own fusion, and every GEMV program loads the norm weight too).
    fold_norm: bool = False

    def __post_init__(self):
        validate.choice("Impl.kernels", self.kernels, KERNEL_MODES)
        validate.integer("Impl.gemv_max_nt", self.gemv_max_nt, 1, gemv.NT_PAD)
        validate.choice("Impl.gemm", self.gemm, GEMM_VARIANTS)
        if not isinstance(self.fold_norm, bool):
            raise InvalidArgumentError(f"Impl.fold_norm must be a bool, got {self.fold_norm!r}")


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


def norm_matmuls(x: jax.Array, norm_weight: jax.Array, eps: float, weights, impl: Impl) -> list[jax.Array]:
    """[matmul(rms_norm(x, norm_weight, eps), w) for w in weights]: x [..., K] -> each [..., N_w] f32.

    On the GEMV path (kernels, nt <= gemv_max_nt, block-format weights, impl.fold_norm) the norm
    is folded into the matmuls: W (r g x) = r (W (g x)) with r = rsqrt(mean(x^2) + eps) one scalar
    per token, so each GEMV scales x by g as it loads it and r multiplies the outputs in the
    fusion that already adds the split-K partial sums. The fusion that wrote the normalized x (one
    launch per norm in every decode step) is gone; r's reduction over x remains.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    nt = math.prod(lead)
    # Block formats only: their GEMV keeps g * x in f32 up to its per-group int8 quantization,
    # while float weights would round the unnormalized g * x to f16 (residual outliers overflow).
    fold = (impl.fold_norm and impl.kernels != "xla" and nt <= impl.gemv_max_nt
            and all(isinstance(w, QWeight) and w.qtype in int8_words.SPECS for w in weights))
    if not fold:
        h = rms_norm(x, norm_weight, eps)
        return [matmul(h, w, impl) for w in weights]
    x2 = x.reshape(nt, k).astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x2 * x2, axis=-1, keepdims=True) + eps)  # [nt, 1]
    interpret = impl.kernels == "interpret"
    return [(gemv.gemv(x2, w.planes, qtype=w.qtype, n_out=w.shape[0], x_scale=norm_weight, interpret=interpret)
             * r).reshape(*lead, w.shape[0]) for w in weights]


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
