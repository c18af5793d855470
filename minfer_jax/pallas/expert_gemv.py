"""Grouped expert GEMV for decode: each (token, slot) pair of a mixture-of-experts layer multiplies
only its chosen expert's weight, one launch per product, the expert ids read inside the kernel
from a device array (no host sync, no data-dependent shapes; llama.cpp's mul_mat_vec_q_moe).

Three launches, each with its jnp reference beside it:
- `expert_gemv`: x [T, K] (every slot's input the token's row) or [T, k, K] -> [T, k, N];
- `expert_glu`: gate and up of the chosen expert with the gated activation fused (SwiGLU, gpt-oss's
  clamped SWIGLU_OAI; optional per-expert biases) -> [T, k, F]: one program computes the same rows
  of both weights, so the activation needs no second pass;
- `expert_down_sum`: down of each slot's row h [T, k, F], times the routing weight, summed over the
  k slots (optional per-expert bias) -> [T, N]. Its DOWN_VARIANTS: "fused" (one program walks
  the k slots of its token: T x Npad / bn programs, 128 for one Qwen3-30B token, too few bytes in
  flight: 0.40 TB/s on the H100, docs/BENCHMARKS.md), "split" (SPLIT_SLOTS slots per program,
  k / SPLIT_SLOTS times the programs) and "pairs" (one slot per program, as expert_gemv); the
  last two write [T, groups, Npad] weighted partials that XLA adds in slot order (one elementwise
  fusion, with the residual add where the caller has one).

Grid (pairs or tokens, Npad / bn); each program reads its expert id(s) and streams that expert's
rows [e * Npad + i * bn, + bn) of the stacked planes (expert_kernels). Nothing is split along K,
so every program finishes its rows. Token counts: any (the grid grows with T * k); ops routes T
<= ops.EXPERT_GEMV_MAX_NT here and sorts larger batches into the grouped GEMM (expert_gemm).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.pallas import device, expert_kernels, gemv, gemv_tuning, int8_words, tiles
from minfer_jax.pallas.expert_kernels import GLU_ACTIVATIONS, RowsBody, rows_body
from minfer_jax.quant.planes import QType, decode, get_format

# rows per program: the dense GEMV's one-token rows per format (gemv_tuning), halved to
# MIN_ROWS while fewer than MIN_PROGRAMS programs (scaled to the GPU's SMs) would run: a lone
# token's down projection has only Npad / bn programs (not measured on a GPU yet)
DECODED_ROWS = 32
MIN_ROWS = 16
MIN_PROGRAMS = 264  # 2 per SM on the H200's 132
NUM_WARPS = 4
# expert_down_sum's launches: slots per program "fused" k, "split" SPLIT_SLOTS, "pairs" 1
# (ops' expert path table picks one per token count; not measured on a GPU yet)
DOWN_VARIANTS = ("fused", "split", "pairs")
SPLIT_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    bn: int  # rows per program (a power of two dividing Npad)
    num_warps: int = NUM_WARPS


def choose_config(qtypes: tuple[QType, ...], grid_rows: int, npad: int) -> ExpertConfig:
    """Rows per program for weights of these formats, with grid_rows programs along the first
    grid axis (pairs or tokens)."""
    bn = min(
        gemv_tuning.row(q).rows_one_token if q in int8_words.SPECS else DECODED_ROWS for q in qtypes
    )
    if bn > MIN_ROWS and grid_rows * (npad // bn) < device.programs(MIN_PROGRAMS):
        bn = MIN_ROWS
    return ExpertConfig(bn=bn)


def _x_terms(precise: bool) -> int:
    return gemv_tuning.PRECISE_X_TERMS if precise else 1


def _whole(a: jax.Array) -> pl.BlockSpec:
    """The whole array in every program (ids, weights, stacked planes: read at dynamic offsets)."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def _x_operand(body: RowsBody, x2: jax.Array, rows: int, row_block):
    """x [R, K] laid out for body, blocked `rows` rows at a time, block row_block(program ids)."""
    xl = body.x_layout(x2)
    tail = (0,) * (xl.ndim - 1)
    return xl, pl.BlockSpec((rows, *xl.shape[1:]), lambda p, i: (row_block(p), *tail))


def _planes_npad(planes: dict) -> tuple[int, int]:
    """(experts, padded rows) of a stacked weight's planes [E, Npad, cols]."""
    first = next(iter(planes.values()))
    if first.ndim != 3:
        raise ValueError(f"expert planes are stacked [E, Npad, cols], got {first.shape}")
    return first.shape[0], first.shape[1]


def _bias_operand(bias: jax.Array | None, npad: int) -> list[jax.Array]:
    """A per-expert bias [E, N] as one flat f32 vector [E * Npad] (rows padded with zeros)."""
    if bias is None:
        return []
    e, n = bias.shape
    return [jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, npad - n))).reshape(e * npad)]


def _call(kernel, operands, specs, grid, out_rows, npad, cfg, interpret, name):
    tiles.silence_triton_deprecation()
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_rows, npad), jnp.float32),
        grid=grid,
        in_specs=specs,
        out_specs=pl.BlockSpec((None, cfg.bn), lambda p, i: (p, i)),
        compiler_params=tiles.compiler_params(cfg.num_warps, 1),
        interpret=interpret,
        name=name,
    )(*operands)


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "precise", "interpret"))
def expert_gemv(
    x: jax.Array,
    planes: dict,
    ids: jax.Array,
    *,
    qtype: QType,
    n_out: int,
    config: ExpertConfig | None = None,
    precise: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """x [T, K] or [T, k, K] (a row per slot) . W[ids[t, j]]^T -> [T, k, n_out] f32; planes
    stacked [E, Npad, cols], ids [T, k] int32. precise: x in gemv_tuning.PRECISE_X_TERMS int8
    terms (integer path; ops.Impl.precise), as for every expert_* launch."""
    t, k = ids.shape
    per_slot = x.ndim == 3
    x2 = x.reshape(t * k if per_slot else t, x.shape[-1])
    _, npad = _planes_npad(planes)
    cfg = config or choose_config((qtype,), t * k, npad)
    body = rows_body(qtype, cfg.bn, x2.shape[1], interpret, _x_terms(precise))
    flat_ids = ids.reshape(t * k).astype(jnp.int32)
    xl, x_spec = _x_operand(body, x2, 1, (lambda p: p) if per_slot else (lambda p: p // k))
    arrays = expert_kernels.kernel_planes(body, planes)
    kernel = _gemv_kernel(body, npad, cfg.bn)
    operands = [flat_ids, xl, *arrays]
    specs = [_whole(flat_ids), x_spec, *map(_whole, arrays)]
    grid = (t * k, npad // cfg.bn)
    name = f"expert_gemv_{qtype.name.lower()}"
    out = _call(kernel, operands, specs, grid, t * k, npad, cfg, interpret, name)
    return out[:, :n_out].reshape(t, k, n_out)


@functools.partial(
    jax.jit,
    static_argnames=("gate_qtype", "up_qtype", "n_out", "act", "config", "precise", "interpret"),
)
def expert_glu(
    x: jax.Array,
    gate_planes: dict,
    up_planes: dict,
    ids: jax.Array,
    *,
    gate_qtype: QType,
    up_qtype: QType,
    n_out: int,
    act: str = "silu",
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
    config: ExpertConfig | None = None,
    precise: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """act(x . Wg[e]^T (+ bg[e]), x . Wu[e]^T (+ bu[e])) for e = ids[t, j]: x [T, K] -> [T, k,
    n_out] f32 (act: a GLU_ACTIVATIONS name; biases [E, n_out])."""
    t, k = ids.shape
    _, npad = _planes_npad(gate_planes)
    assert _planes_npad(up_planes)[1] == npad, "gate and up have the same rows"
    cfg = config or choose_config((gate_qtype, up_qtype), t * k, npad)
    terms = _x_terms(precise)
    bodies = [rows_body(q, cfg.bn, x.shape[1], interpret, terms) for q in (gate_qtype, up_qtype)]
    flat_ids = ids.reshape(t * k).astype(jnp.int32)
    operands, specs = [flat_ids], [_whole(flat_ids)]
    for body in bodies:
        xl, x_spec = _x_operand(body, x, 1, lambda p: p // k)
        operands.append(xl)
        specs.append(x_spec)
    for body, planes in zip(bodies, (gate_planes, up_planes)):
        arrays = expert_kernels.kernel_planes(body, planes)
        operands += arrays
        specs += map(_whole, arrays)
    biases = _bias_operand(gate_bias, npad) + _bias_operand(up_bias, npad)
    operands += biases
    specs += map(_whole, biases)
    kernel = _glu_kernel(*bodies, npad, cfg.bn, act, gate_bias is not None, up_bias is not None)
    grid = (t * k, npad // cfg.bn)
    name = f"expert_glu_{gate_qtype.name.lower()}_{act}"
    out = _call(kernel, operands, specs, grid, t * k, npad, cfg, interpret, name)
    return out[:, :n_out].reshape(t, k, n_out)


def down_slots(variant: str, k: int) -> int:
    """Slots each program of expert_down_sum's `variant` walks, for k slots per token (a divisor
    of k: "split" takes one slot per program where SPLIT_SLOTS does not divide k)."""
    if variant not in DOWN_VARIANTS:
        raise ValueError(f"expert down variant {variant!r} is not one of {DOWN_VARIANTS}")
    if variant == "fused":
        return k
    return SPLIT_SLOTS if variant == "split" and k % SPLIT_SLOTS == 0 else 1


@functools.partial(
    jax.jit, static_argnames=("qtype", "n_out", "variant", "config", "precise", "interpret")
)
def expert_down_sum(
    h: jax.Array,
    planes: dict,
    ids: jax.Array,
    weights: jax.Array,
    *,
    qtype: QType,
    n_out: int,
    bias: jax.Array | None = None,
    variant: str = "fused",
    config: ExpertConfig | None = None,
    precise: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """sum_j weights[t, j] * (h[t, j] . W[ids[t, j]]^T (+ bias[ids[t, j]])): h [T, k, F] ->
    [T, n_out] f32 (bias [E, n_out]); variant: DOWN_VARIANTS (the same sums, grouped by launch)."""
    t, k = ids.shape
    slots = down_slots(variant, k)
    groups = k // slots  # programs per token and row block; XLA adds their partials
    _, npad = _planes_npad(planes)
    cfg = config or choose_config((qtype,), t * groups, npad)
    body = rows_body(qtype, cfg.bn, h.shape[-1], interpret, _x_terms(precise))
    flat_ids = ids.reshape(t * k).astype(jnp.int32)
    flat_w = weights.reshape(t * k).astype(jnp.float32)
    xl, x_spec = _x_operand(body, h.reshape(t * k, h.shape[-1]), slots, lambda p: p)
    arrays = expert_kernels.kernel_planes(body, planes)
    biases = _bias_operand(bias, npad)
    operands = [flat_ids, flat_w, xl, *arrays, *biases]
    specs = [_whole(flat_ids), _whole(flat_w), x_spec, *map(_whole, [*arrays, *biases])]
    kernel = _down_kernel(body, slots, npad, cfg.bn, bias is not None)
    name = f"expert_down_sum_{qtype.name.lower()}" + ("" if groups == 1 else f"_{variant}")
    grid = (t * groups, npad // cfg.bn)
    out = _call(kernel, operands, specs, grid, t * groups, npad, cfg, interpret, name)
    parts = out.reshape(t, groups, npad)[:, :, :n_out]
    return functools.reduce(jnp.add, [parts[:, g] for g in range(groups)])  # in slot order


# One kernel closure per configuration (jax#40847: a shared function object can reuse a trace).


@functools.cache
def _gemv_kernel(body: RowsBody, npad: int, bn: int):
    def kernel(ids_ref, x_ref, *refs):
        *plane_refs, o_ref = refs
        p, i = pl.program_id(0), pl.program_id(1)
        row0 = ids_ref[p] * npad + i * bn
        o_ref[...] = body.rows(x_ref, 0, plane_refs, row0)

    return kernel


@functools.cache
def _glu_kernel(
    gate: RowsBody, up: RowsBody, npad: int, bn: int, act: str, gate_bias: bool, up_bias: bool
):
    glu = GLU_ACTIVATIONS[act]

    def kernel(ids_ref, xg_ref, xu_ref, *refs):
        *in_refs, o_ref = refs
        gate_refs, rest = in_refs[: gate.n_refs], in_refs[gate.n_refs :]
        up_refs, bias_refs = rest[: up.n_refs], list(rest[up.n_refs :])
        p, i = pl.program_id(0), pl.program_id(1)
        row0 = ids_ref[p] * npad + i * bn
        g = gate.rows(xg_ref, 0, gate_refs, row0)
        u = up.rows(xu_ref, 0, up_refs, row0)
        if gate_bias:
            g = g + bias_refs.pop(0)[pl.ds(row0, bn)]
        if up_bias:
            u = u + bias_refs.pop(0)[pl.ds(row0, bn)]
        o_ref[...] = glu(g, u)

    return kernel


@functools.cache
def _down_kernel(body: RowsBody, slots: int, npad: int, bn: int, has_bias: bool):
    def kernel(ids_ref, w_ref, x_ref, *refs):
        *in_refs, o_ref = refs
        plane_refs, bias_refs = in_refs[: body.n_refs], in_refs[body.n_refs :]
        p, i = pl.program_id(0), pl.program_id(1)
        acc = jnp.zeros((bn,), jnp.float32)
        for j in range(slots):  # the program's slots (pairs p * slots + j), each its own expert
            row0 = ids_ref[p * slots + j] * npad + i * bn
            y = body.rows(x_ref, j, plane_refs, row0)
            if has_bias:
                y = y + bias_refs[0][pl.ds(row0, bn)]
            acc = acc + w_ref[p * slots + j] * y
        o_ref[...] = acc

    return kernel


# ----------------------------------------------------------------------------- references


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "precise"))
def expert_rows_reference(
    x: jax.Array, planes: dict, *, qtype: QType, n_out: int, precise: bool = False
) -> jax.Array:
    """What one program computes for a pair, on whole arrays: x [K] . W^T -> [n_out] f32 for one
    expert's planes [Npad, cols]: the integer GEMV's reference (same activation quantization,
    exact integer sums) for block formats with words, else an f32 decode and an f32 dot."""
    if qtype in int8_words.SPECS:
        return gemv.gemv_int8_reference(
            x[None], planes, qtype=qtype, n_out=n_out, x_terms=_x_terms(precise)
        )[0]
    w = decode(qtype, planes, jnp.float32)[:n_out]
    return jnp.dot(w, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "precise"))
def expert_gemv_reference(
    x: jax.Array, planes: dict, ids: jax.Array, *, qtype: QType, n_out: int, precise: bool = False
) -> jax.Array:
    """expert_gemv on whole arrays: each pair's expert planes gathered, then
    expert_rows_reference."""
    t, k = ids.shape
    xs = x if x.ndim == 3 else jnp.broadcast_to(x[:, None], (t, k, x.shape[-1]))

    def pair(xrow, e):
        return expert_rows_reference(
            xrow, {n: p[e] for n, p in planes.items()}, qtype=qtype, n_out=n_out, precise=precise
        )

    ys = jax.vmap(pair)(xs.reshape(t * k, -1), ids.reshape(t * k))
    return ys.reshape(t, k, n_out)


def expert_glu_reference(
    x, gate_planes, up_planes, ids, *, gate_qtype, up_qtype, n_out, act="silu", gate_bias=None,
    up_bias=None, precise=False,
) -> jax.Array:  # fmt: skip
    """expert_glu from two expert_gemv_reference products."""
    g = expert_gemv_reference(x, gate_planes, ids, qtype=gate_qtype, n_out=n_out, precise=precise)
    u = expert_gemv_reference(x, up_planes, ids, qtype=up_qtype, n_out=n_out, precise=precise)
    if gate_bias is not None:
        g = g + gate_bias[ids].astype(jnp.float32)
    if up_bias is not None:
        u = u + up_bias[ids].astype(jnp.float32)
    return GLU_ACTIVATIONS[act](g, u)


def expert_down_sum_reference(
    h, planes, ids, weights, *, qtype: QType, n_out: int, bias=None, precise=False
) -> jax.Array:
    """expert_down_sum from expert_gemv_reference: weighted, then summed over the slots."""
    y = expert_gemv_reference(h, planes, ids, qtype=qtype, n_out=n_out, precise=precise)
    if bias is not None:
        y = y + bias[ids].astype(jnp.float32)
    return jnp.sum(y * weights[..., None].astype(jnp.float32), axis=1)


def active_weight_nbytes(qtype: QType, n: int, k: int) -> int:
    """Bytes of one expert's [n, k] weight a pair streams (its planes' unpadded rows)."""
    fmt = get_format(qtype)
    return int(sum(n * (k // p.wpc) * jnp.dtype(p.dtype).itemsize for p in fmt.planes))
