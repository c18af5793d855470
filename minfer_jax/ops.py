"""The one matmul every weight goes through, and the one static decision of which kernel runs it.

`matmul(x, w, impl)` with x [..., K] and w a weight [N, K] returns [..., N] f32. The token count
nt = prod(x.shape[:-1]) is a Python int at trace time, so `route(w, nt, impl)` is decided once
per shape bucket and compiled into that bucket's executable. Its kinds (Route.kind):

    "dense"       dense weight (CPU "dense" mode)   -> XLA dot
    "int8"        Int8Weight (the CPU's default)    -> XLA dot with q * a (+ b) decoded inside it
                  (one row; more rows read its dense copy where it has one: quant/int8_dot.py)
    "xla"         QWeight, impl.kernels == "xla"    -> reference: whole-matrix decode + XLA dot
    "gemv"        block format, nt <= GEMV_MAX_NT   -> integer Pallas GEMV (pallas/gemv.py)
    "gemv-float"  float format, nt <= GEMV_MAX_NT   -> float Pallas GEMV (pallas/gemv.py)
    QWeight, nt > GEMV_MAX_NT                       -> GEMM, by impl.gemm:
      "gemm"      "f16", or "auto" below DEQUANT_MIN_NT (a decode batch of 9 .. 64 rows): Pallas
                  GEMM decoding weight tiles in-kernel (pallas/gemm.py, K split for few tokens);
                  float weights always take it
      "dq+gemm"   "auto" from DEQUANT_MIN_NT tokens (prefill chunks) or "dequant": Pallas
                  dequantization into a transient f16 matrix (pallas/dequant.py), then the GEMM
                  on float weights
      "gemm-i8"   "int8": int8 activations x int8 quants (pallas/gemm_int8.py; block formats;
                  opt-in: slower on the H200, docs/BENCHMARKS.md)
With impl.deterministic on the kernels every matmul of up to DETERMINISTIC_MAX_NT rows (any
decode batch) computes each row exactly as a one-row call does (Route.row_chunk): the one-token
GEMV's configuration at every row count, in calls of at most GEMV_MAX_NT rows where the GEMM would
otherwise take over. (The XLA paths get batch invariance from decoder.forward_decode instead: its
rows run one after another, XLA's dots and reductions depending on the row count.)
With impl.precise every integer GEMV quantizes x in two int8 terms inside the kernel
(Route.precise): where a token forms a massive activation, which amplifies the first layers'
rounding, the logits stay about 0.2 from a float64 forward's where one term can leave them 5 away.
`norm_matmuls` asks the same route for matmuls that read an RMSNorm's output: where a weight's
route is a "gemv" that quantizes x in the kernel and impl.fused_decode is set, the GEMV applies the
norm itself (Route.fold_norm): up to gemv_tuning.FOLD_NORM_MAX_K inputs and FOLD_NORM_MAX_NT
tokens (any row count in the deterministic mode) every program computes the rows' rsqrt from
their whole rows ("gemv+fold"); past that, or wherever the rows' sums of squares are given (a
residual add's: pallas/split_sums.py), the kernel computes it from those sums ("gemv+rsqrt",
one XLA reduce making them where not given). Folded GEMVs of the same x (q / k / v, gate / up of
different formats) run as one launch where their configs allow (gemv.groupable).
`norm_matmul_parts` and `matmul_parts` return products before their split-K partials are added,
for a kernel that adds them itself (impl.fused_decode: pallas/decode_qkv.py, split_sums.py).
The kernel benchmark asks it too (`kernel_case`: the route, its kernel call and its reference).

"pallas" runs the Triton kernels on the GPU; "interpret" runs the same kernels in Pallas'
interpreter (CPU tests of the full model through the kernels).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from minfer_jax import experts, validate
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.pallas import (
    dequant,
    expert_gemm,
    expert_gemv,
    expert_tuning,
    gemm,
    gemm_int8,
    gemv,
    gemv_tuning,
    tiles,
)
from minfer_jax.quant.int8_dot import dense_matmul, int8_matmul
from minfer_jax.quant.matrix import DenseWeight, Int8Weight, QWeight, Weight
from minfer_jax.quant.planes import QType, get_format
from minfer_jax.validate import Choices

GEMV_MAX_NT = gemv.MAX_NT  # nt = 1 .. 8 -> GEMV: weights read once for all tokens
# quantized experts on the kernels: the grouped expert GEMV up to this many tokens, a sorted
# grouped GEMM beyond; both and their variants per token count from expert_tuning.EXPERT_PATHS
EXPERT_GEMV_MAX_NT = expert_tuning.gemv_max_nt()
# impl.deterministic: matmuls of up to this many rows compute each row as alone (plan.MAX_SEQS,
# the largest decode batch; prefill chunks this short take the same path)
DETERMINISTIC_MAX_NT = 64


KERNELS = Choices(
    (
        ("pallas", "Triton kernels, GPU"),
        ("interpret", "the same kernels in Pallas' interpreter: very slow, tiny shapes only"),
        ("xla", "reference: dequantize + XLA dot"),
    )
)
GEMMS = Choices(
    (  # past GEMV_MAX_NT tokens, block formats (route() below)
        ("auto", f"the split f16 GEMM up to {gemm.FEW_TOKEN_MAX_NT} tokens, dequant beyond"),
        ("f16", "weight tiles decoded inside the GEMM"),
        ("dequant", "weights decoded into a transient f16 matrix, then a float GEMM"),
        ("int8", "int8 activations x int8 quants; slower on the H200"),
    )
)
KERNEL_MODES = KERNELS.names
GEMM_VARIANTS = GEMMS.names
# "auto": up to gemm.FEW_TOKEN_MAX_NT tokens the in-kernel-decode GEMM with a K split (batched
# decode, [G-few-tokens]); from this many on dequantize-then-GEMM, which won at every prefill size
# swept against the unsplit GEMM (docs/BENCHMARKS.md, GEMV choices [G-dequant-nt]).
DEQUANT_MIN_NT = gemm.FEW_TOKEN_MAX_NT + 1
_FLOAT_QTYPE = {
    jnp.dtype(jnp.float16): QType.F16,
    jnp.dtype(jnp.bfloat16): QType.BF16,
    jnp.dtype(jnp.float32): QType.F32,
}


@dataclasses.dataclass(frozen=True)
class Impl:
    """Static execution choices, part of every jit's static arguments."""

    kernels: str = "xla"  # "pallas" | "interpret" | "xla"
    gemv_max_nt: int = GEMV_MAX_NT
    gemm: str = "auto"  # prefill variant: "auto" | "f16" (decode in-kernel) | "dequant" | "int8"
    # batch invariance: every row of a decode batch computed as it is alone (kernels: route's
    # row_chunk, the attention's fixed key splits, a lone row run as two by
    # decoder.forward_decode; XLA: forward_decode runs the rows one after another); slower decode,
    # most past 8 rows (docs/BENCHMARKS.md, "Batch invariance")
    deterministic: bool = False
    # kernels, decode: a layer's q / k / v epilogue (partial sums, biases, RoPE, cache writes),
    # the attention's split merge, the residual adds and the gated activation each one Pallas
    # launch (pallas/decode_qkv.py, decode_attention.merge_splits_kernel, split_sums.py) where
    # XLA runs two to five (docs/BENCHMARKS.md, "Decode fusion"), and the RMSNorm before q/k/v
    # and gate/up GEMVs applied inside them (norm_matmuls, [G-fold-norm]); off: the XLA ops,
    # for A/B
    fused_decode: bool = True
    # kernels: every integer GEMV quantizes its x in gemv_tuning.PRECISE_X_TERMS int8 terms (the
    # rounding residual as a second term), inside the kernel at every token count: closer to a
    # float64 forward, 15-27 % slower per GEMV ([G-x-terms]). Batches past gemv_max_nt rows keep
    # the GEMM, whose x is f16
    precise: bool = False

    def __post_init__(self):
        validate.choice("Impl.kernels", self.kernels, KERNEL_MODES)
        validate.integer("Impl.gemv_max_nt", self.gemv_max_nt, 1, gemv.NT_PAD)
        validate.choice("Impl.gemm", self.gemm, GEMM_VARIANTS)
        for name in ("deterministic", "fused_decode", "precise"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"Impl.{name} must be a bool, got {getattr(self, name)!r}"
                )


def default_impl(platform: str | None = None) -> Impl:
    platform = platform or jax.default_backend()
    return Impl(kernels="pallas" if platform == "gpu" else "xla")


ROUTE_KINDS = ("dense", "int8", "xla", "gemv", "gemv-float", "gemm", "dq+gemm", "gemm-i8")
_PREFILL_KINDS = {
    "f16": "gemm",
    "dequant": "dq+gemm",
    "int8": "gemm-i8",
}  # gemm_variant -> Route.kind


@dataclasses.dataclass(frozen=True)
class Route:
    """Which kernel runs one matmul: static, fixed at trace time by the weight, nt and Impl."""

    kind: str  # one of ROUTE_KINDS
    # "gemv" only, the RMSNorm before it applied in the GEMV: "fold" (every program computes the
    # rows' rsqrt from their whole rows) or "rsqrt" (from the rows' sums of squares, given);
    # None: XLA's norm first
    fold_norm: str | None = None
    # impl.deterministic, GEMV: rows per call (<= GEMV_MAX_NT), each computed with the one-token
    # config, so as alone; None: all rows in one call, the config chosen for their count
    row_chunk: int | None = None
    # "gemv" only, impl.precise: x in gemv_tuning.PRECISE_X_TERMS int8 terms
    precise: bool = False

    @property
    def label(self) -> str:
        """The kind, "+fold" or "+rsqrt" appended when the norm is applied in the GEMV (e.g.
        "gemv+fold"), "/rows" when each row is computed as alone (deterministic), "/precise"
        when x comes in two int8 terms."""
        fold = f"+{self.fold_norm}" if self.fold_norm else ""
        rows = "/rows" if self.row_chunk else ""
        return self.kind + fold + rows + ("/precise" if self.precise else "")


def route(
    w: Weight, nt: int, impl: Impl, *, after_norm: bool = False, sumsq: bool = False
) -> Route:
    """The kernel matmul(x, w, impl) runs for nt tokens; after_norm: x is an RMSNorm's output
    (norm_matmuls), so the GEMV applies the norm where impl.fused_decode lets it
    (Route.fold_norm); sumsq: the norm input's sums of squares are given."""
    if isinstance(w, DenseWeight):
        return Route("dense")
    if isinstance(w, Int8Weight):  # the dense copy for many rows (quant/int8_dot.py)
        return Route("dense" if nt > 1 and w.dense is not None else "int8")
    r = _quantized_route(w.qtype, nt, impl)
    if after_norm and impl.fused_decode and r.kind == "gemv":
        return dataclasses.replace(r, fold_norm=_fold_mode(w.qtype, *w.shape, nt, r, sumsq))
    return r


def _xla_quantizes_x(qtype: QType, n: int, k: int, nt: int, r: Route) -> bool:
    """Whether the GEMV's x is quantized by an XLA fusion before it (gemv_tuning's prequant),
    which then fuses the ops that make x too: nothing for the kernel to take over."""
    alone = r.row_chunk is not None
    count = min(nt, r.row_chunk or nt)
    return gemv.choose_config(qtype, n, k, count, alone, r.precise).prequant


def _fold_mode(qtype: QType, n: int, k: int, nt: int, r: Route, sumsq: bool) -> str | None:
    """How a GEMV applies the norm before it (Route.fold_norm), or None where x is quantized by
    XLA (which fuses the norm's multiply there itself). Given sums of squares cost nothing to
    read; else every program recomputing the rsqrt from whole rows costs less than XLA's reduce
    launch only for narrow x and few tokens. The deterministic mode (r.row_chunk) folds at every
    row count and width: a row's numerics must not depend on the batch."""
    alone = r.row_chunk is not None
    if _xla_quantizes_x(qtype, n, k, nt, r):
        return None
    if sumsq:
        return "rsqrt"
    if alone:  # an XLA reduce's order may depend on the row count: each program's sums never do
        return "fold"
    narrow = k <= gemv_tuning.FOLD_NORM_MAX_K
    return "fold" if narrow and nt <= gemv_tuning.FOLD_NORM_MAX_NT else "rsqrt"


def _quantized_route(qtype: QType, nt: int, impl: Impl) -> Route:
    if impl.kernels == "xla":
        return Route("xla")
    alone = impl.deterministic and nt <= DETERMINISTIC_MAX_NT
    if nt > impl.gemv_max_nt and not alone:
        return Route(_PREFILL_KINDS[gemm_variant(impl.gemm, qtype, nt)])
    chunk = impl.gemv_max_nt if alone else None
    if get_format(qtype).ints is None:  # float formats
        return Route("gemv-float", row_chunk=chunk)
    return Route("gemv", row_chunk=chunk, precise=impl.precise)


def gemm_variant(requested: str, qtype: QType, nt: int) -> str:
    """The prefill kernel that runs: float weights always take the plain GEMM ("f16")."""
    if get_format(qtype).ints is None:
        return "f16"
    if requested == "auto":
        return "dequant" if nt >= DEQUANT_MIN_NT else "f16"
    return requested


def route_call(r: Route, qtype: QType, n_out: int, impl: Impl, partials: bool = False):
    """The kernel call of a quantized weight's route: (x [nt, K], planes) -> [nt, n_out] f32;
    partials ("gemv" and "gemv-float" only): the GEMV's split-K partials unadded. (A folded
    norm's GEMVs are called by _norm_products, in groups.)"""
    kw: dict[str, Any] = dict(qtype=qtype, n_out=n_out)
    interpret = impl.kernels == "interpret"
    if r.kind == "xla":
        return lambda x, planes: tiles.dequant_matmul_reference(x, planes, **kw)
    if r.kind in ("gemv", "gemv-float"):
        kw["deterministic"] = r.row_chunk is not None
        kw["partials"] = partials
    if r.kind == "gemv":
        kw["precise"] = r.precise
        return lambda x, planes: gemv.gemv_int8(x, planes, interpret=interpret, **kw)
    if r.kind == "gemv-float":
        return lambda x, planes: gemv.gemv_float(x, planes, interpret=interpret, **kw)
    if r.kind == "gemm":
        return lambda x, planes: gemm.gemm(x, planes, interpret=interpret, **kw)
    if r.kind == "dq+gemm":
        return lambda x, planes: _dequant_gemm(x, planes, qtype, n_out, interpret)
    if r.kind == "gemm-i8":
        return lambda x, planes: gemm_int8.gemm_int8(x, planes, interpret=interpret, **kw)
    raise ValueError(f"route_call takes a quantized weight's route, not {r.kind!r}")


def route_reference(r: Route, qtype: QType, n_out: int):
    """The jnp reference of exactly what route_call(r, ...) computes, (x, planes) -> [nt, n_out]
    f32: the integer GEMV's own (same activation quantization, exact integer sums), the int8 GEMM's,
    or whole-matrix decode in the compute dtype + one f32-accumulated dot (float GEMV, both f16 GEMM
    variants, the XLA path)."""
    fn = {"gemv": gemv.gemv_int8_reference, "gemm-i8": gemm_int8.gemm_int8_reference}.get(
        r.kind, tiles.dequant_matmul_reference
    )
    return lambda x, planes: fn(x, planes, qtype=qtype, n_out=n_out)


def kernel_case(qtype: QType, n: int, nt: int, impl: Impl):
    """What the kernel benchmark times for a [n, K] weight of qtype and nt tokens: (the route
    ops.matmul takes, its kernel call (x, planes), that call's jnp reference (x, planes))."""
    r = _quantized_route(QType(qtype), nt, impl)
    return r, route_call(r, QType(qtype), n, impl), route_reference(r, QType(qtype), n)


def expert_kernel_path(nt: int) -> str:
    """The expert kernels' path for nt tokens (expert_tuning.PATHS): a grouped-GEMV path or an
    expert_gemm variant."""
    return expert_tuning.path(nt)


def matmul(x: jax.Array, w: Weight, impl: Impl) -> jax.Array:
    """x [..., K] . w[N, K]^T -> [..., N] float32, through route(w, nt, impl)'s kernel."""
    lead, k = x.shape[:-1], x.shape[-1]
    nt = math.prod(lead)
    x2 = x.reshape(nt, k)
    r = route(w, nt, impl)
    if isinstance(w, DenseWeight):  # r.kind == "dense"
        y = dense_matmul(x2, w)
    elif isinstance(w, Int8Weight):  # "int8", or "dense" from its dense copy
        y = int8_matmul(x2, w)
    else:
        y = by_rows(route_call(r, w.qtype, w.shape[0], impl), r.row_chunk, x2, w.planes)
    return y.reshape(*lead, y.shape[-1])


EXPERT_ROUTE_KINDS = ("gather", "tiles", "expert-gemv", "expert-gemm")


def expert_route(w: Weight, nt: int, impl: Impl) -> str:
    """Which grouped matmul runs an expert tensor for nt tokens (static, like route): on the
    kernels, quantized experts take "expert-gemv" (pallas/expert_gemv.py; with the fused
    expert_glu / expert_down_sum launches) up to EXPERT_GEMV_MAX_NT tokens and in the
    deterministic mode (one fixed config), "expert-gemm" (pallas/expert_gemm.py) beyond; else
    "gather" (experts.gather_matmul, the reference) up to GEMV_MAX_NT tokens (deterministic:
    DETERMINISTIC_MAX_NT) and "tiles" (experts.tiled_matmul) beyond."""
    alone = impl.deterministic and nt <= DETERMINISTIC_MAX_NT
    if isinstance(w, QWeight) and impl.kernels != "xla":
        gemv_path = expert_kernel_path(nt) in expert_tuning.GEMV_PATHS
        return "expert-gemv" if alone or gemv_path else "expert-gemm"
    return "gather" if nt <= GEMV_MAX_NT or alone else "tiles"


EXPERT_CALLS = {
    "gather": experts.gather_matmul,
    "tiles": experts.tiled_matmul,
}


def _expert_gemv_kw(impl: Impl) -> dict[str, Any]:
    """The expert GEMV launches' settings from impl: one config at every token count in the
    deterministic mode, x in two int8 terms in the precise mode."""
    cfg = expert_gemv.ExpertConfig(bn=expert_gemv.MIN_ROWS) if impl.deterministic else None
    return dict(config=cfg, precise=impl.precise, interpret=impl.kernels == "interpret")


def expert_matmul(x: jax.Array, w: Weight, ids: jax.Array, impl: Impl) -> jax.Array:
    """x [T, K] (or [T, k, K]: one row per chosen expert) . expert ids [T, k] of w (an expert
    tensor, E x [N, K]) -> [T, k, N] f32, through expert_route's grouped matmul."""
    if not w.experts:
        raise ValueError("expert_matmul takes an expert tensor (a weight with experts > 0)")
    x = x.astype(jnp.float32)
    kind = expert_route(w, ids.shape[0], impl)
    if kind == "expert-gemv":
        assert isinstance(w, QWeight)
        return expert_gemv.expert_gemv(
            x, w.planes, ids, qtype=w.qtype, n_out=w.shape[0], **_expert_gemv_kw(impl)
        )
    if kind == "expert-gemm":
        assert isinstance(w, QWeight)
        return expert_gemm.expert_matmul_sorted(
            x, w.planes, ids, qtype=w.qtype, n_out=w.shape[0],
            variant=expert_kernel_path(ids.shape[0]), interpret=impl.kernels == "interpret",
        )  # fmt: skip
    return EXPERT_CALLS[kind](x, w, ids)


def expert_glu(
    x: jax.Array,
    w_gate: Weight,
    w_up: Weight,
    ids: jax.Array,
    act: str,
    impl: Impl,
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
) -> jax.Array:
    """act(x . gate[e] (+ gate_bias[e]), x . up[e] (+ up_bias[e])) for each token's chosen
    experts: x [T, K], ids [T, k] -> [T, k, F] f32 (act: a name of experts.GLU_ACTIVATIONS, e.g.
    "silu"; biases [E, F]). On the "expert-gemv" route one launch computes both products and
    the activation."""
    t = ids.shape[0]
    fused = all(expert_route(w, t, impl) == "expert-gemv" for w in (w_gate, w_up))
    if fused:
        assert isinstance(w_gate, QWeight) and isinstance(w_up, QWeight)
        return expert_gemv.expert_glu(
            x.astype(jnp.float32), w_gate.planes, w_up.planes, ids, gate_qtype=w_gate.qtype,
            up_qtype=w_up.qtype, n_out=w_gate.shape[0], act=act, gate_bias=gate_bias,
            up_bias=up_bias, **_expert_gemv_kw(impl),
        )  # fmt: skip
    gate = experts.add_bias(expert_matmul(x, w_gate, ids, impl), gate_bias, ids)
    up = experts.add_bias(expert_matmul(x, w_up, ids, impl), up_bias, ids)
    return experts.GLU_ACTIVATIONS[act](gate, up)


def expert_down_sum(
    h: jax.Array,
    w_down: Weight,
    ids: jax.Array,
    weights: jax.Array,
    impl: Impl,
    bias: jax.Array | None = None,
) -> jax.Array:
    """sum_j weights[t, j] * (h[t, j] . down[ids[t, j]] (+ bias[ids[t, j]])): h [T, k, F], ids
    and routing weights [T, k] -> [T, N] f32, the k products added in slot order (llama.cpp's).
    On the "expert-gemv" route the down+sum launch of expert_tuning's variant computes the
    products and weights, and the sum (or per-slot partials that XLA adds in slot order)."""
    t = ids.shape[0]
    if expert_route(w_down, t, impl) == "expert-gemv":
        assert isinstance(w_down, QWeight)
        return expert_gemv.expert_down_sum(
            h.astype(jnp.float32), w_down.planes, ids, weights, qtype=w_down.qtype,
            n_out=w_down.shape[0], bias=bias,
            variant=expert_tuning.down_variant(t, impl.deterministic), **_expert_gemv_kw(impl),
        )  # fmt: skip
    y = experts.add_bias(expert_matmul(h, w_down, ids, impl), bias, ids)
    return experts.weighted_sum(y, weights.astype(jnp.float32))


def by_rows(call, row_chunk: int | None, x: jax.Array, *operands) -> jax.Array:
    """call(x, *operands) [nt, N], in calls of row_chunk rows (Route.row_chunk; one call if
    None)."""
    nt = x.shape[0]
    if row_chunk is None or nt <= row_chunk:
        return call(x, *operands)
    parts = [call(x[i : i + row_chunk], *operands) for i in range(0, nt, row_chunk)]
    return jnp.concatenate(parts, axis=0)


def norm_matmuls(
    x: jax.Array, norm_weight: jax.Array, eps: float, weights, impl: Impl, sumsq=None
) -> list[jax.Array]:
    """[matmul(rms_norm(x, norm_weight, eps), w) for w in weights]: x [..., K] -> each [..., N_w]
    f32. sumsq (optional, [nt, P] f32): x's rows' sums of squares in P pieces
    (split_sums.add_partials').

    Where a weight's route folds the norm (Route.fold_norm) its GEMV reads x itself: "fold" has
    every program compute the rsqrt(mean(x^2) + eps) of the rows it reads, "rsqrt" computes it
    from the sums of squares (sumsq, else one XLA reduce); each then quantizes
    (x * rsqrt) * norm_weight as it loads its slice, so the norm's multiply (and with given sums
    or "fold" its reduce) leaves the decode step. Folded GEMVs run as one launch where their
    configs allow (_folded_groups)."""
    lead, k = x.shape[:-1], x.shape[-1]
    outs = _norm_products(x.reshape(-1, k), norm_weight, eps, weights, impl, False, sumsq)
    return [y.reshape(*lead, y.shape[-1]) for y in outs]


def norm_matmul_parts(
    x: jax.Array, norm_weight: jax.Array, eps: float, weights, impl: Impl, sumsq=None
) -> list[jax.Array]:
    """norm_matmuls before the split-K partial sums are added: x [nt, K] -> for each weight
    [S, R >= nt, Np >= N] f32 whose S slices add up to its output in rows [0, nt) and columns
    [0, N): a one-call GEMV's partials, else the finished product as one slice."""
    return _norm_products(x, norm_weight, eps, weights, impl, True, sumsq)


def matmul_parts(x: jax.Array, w: Weight, impl: Impl) -> jax.Array:
    """matmul(x, w) before its split-K partials are added: x [nt, K] -> [S, R >= nt, Np >= N]
    f32, as norm_matmul_parts (the deterministic mode's row chunks finished, as there: one path
    at every row count)."""
    r = route(w, x.shape[0], impl)
    if not isinstance(w, QWeight) or r.kind not in ("gemv", "gemv-float") or r.row_chunk:
        return matmul(x, w, impl)[None]
    return route_call(r, w.qtype, w.shape[0], impl, partials=True)(x, w.planes)


def _norm_products(x, norm_weight, eps: float, weights, impl: Impl, partials: bool, sumsq) -> list:
    """norm_matmuls on x [nt, K] (partials: as norm_matmul_parts)."""
    nt = x.shape[0]
    x = x.astype(jnp.float32)
    routes = [route(w, nt, impl, after_norm=True, sumsq=sumsq is not None) for w in weights]
    if sumsq is None and any(r.fold_norm == "rsqrt" for r in routes):
        sumsq = jnp.sum(x * x, axis=-1, keepdims=True)  # [nt, 1]: one XLA reduce
    h = rms_norm(x, norm_weight, eps) if not all(r.fold_norm for r in routes) else None
    out: list = [None] * len(weights)
    for group, configs in _folded_groups(routes, weights, nt):
        r = routes[group[0]]
        whole = partials and r.kind in ("gemv", "gemv-float") and r.row_chunk is None
        if not r.fold_norm:
            [i] = group
            w = weights[i]
            assert h is not None  # an unfolded route: the norm was computed above
            if whole:
                out[i] = route_call(r, w.qtype, w.shape[0], impl, partials=True)(h, w.planes)
            else:
                out[i] = matmul(h, w, impl)
                out[i] = out[i][None] if partials else out[i]
            continue
        members = [weights[i] for i in group]

        def call(xs, rs, members=members, r=r, whole=whole, configs=configs):
            return gemv.gemv_int8_group(
                xs,
                tuple(w.planes for w in members),
                qtypes=tuple(w.qtype for w in members),
                n_outs=tuple(w.shape[0] for w in members),
                configs=configs,
                x_scale=norm_weight,
                row_sumsq=rs,
                norm_eps=float(eps),
                deterministic=r.row_chunk is not None,
                partials=whole,
                interpret=impl.kernels == "interpret",
            )

        chunk = r.row_chunk or nt
        pieces = [
            call(x[i : i + chunk], sumsq[i : i + chunk] if r.fold_norm == "rsqrt" else None)
            for i in range(0, nt, chunk)
        ]
        for m, i in enumerate(group):
            y = pieces[0][m] if len(pieces) == 1 else jnp.concatenate([p[m] for p in pieces])
            out[i] = y if whole or not partials else y[None]
    return out


def _folded_groups(routes, weights, nt: int) -> list[tuple[list[int], tuple | None]]:
    """The weights' indices in launches, each with its GEMV configs: folded GEMVs of one fold mode
    and row chunk whose configs are gemv.groupable together (gemv_tuning.GROUP_FOLDED_GEMVS), every
    other weight alone (configs None: its route decides)."""
    groups: list[tuple[list[int], list]] = []
    for i, (r, w) in enumerate(zip(routes, weights)):
        if not r.fold_norm:
            groups.append(([i], []))
            continue
        rows, alone = min(nt, r.row_chunk or nt), r.row_chunk is not None
        n, k = w.shape
        cfg = gemv.choose_config(w.qtype, n, k, rows, alone, r.precise)  # each chunk's
        for members, cfgs in groups if gemv_tuning.GROUP_FOLDED_GEMVS else ():
            first = routes[members[0]]
            same = cfgs and (first.fold_norm, first.row_chunk) == (r.fold_norm, r.row_chunk)
            if same and gemv.groupable([*cfgs, cfg]):
                members.append(i)
                cfgs.append(cfg)
                break
        else:
            groups.append(([i], [cfg]))
    return [(members, tuple(cfgs) or None) for members, cfgs in groups]


def _dequant_gemm(x: jax.Array, planes, qtype: QType, n_out: int, interpret: bool) -> jax.Array:
    wd = dequant.dequantize(planes, qtype=qtype, interpret=interpret)  # [Npad, K] f16, transient
    return gemm.gemm(x, {"w": wd}, qtype=_FLOAT_QTYPE[wd.dtype], n_out=n_out, interpret=interpret)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., d] f32 -> normalized * weight, computed in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
