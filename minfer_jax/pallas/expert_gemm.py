"""Expert products for prefill and large batches: the (token, slot) pairs sorted by expert on the
device, then one grouped GEMM (llama.cpp's expert-sorted MMQ, mmid.cu), with static shapes only.

Three variants of `expert_matmul_sorted` (x [T, K] or [T, k, K], stacked planes [E, Npad, cols],
ids [T, k] -> [T, k, N] f32), picked by the caller (ops' expert path table):
- "ragged": every expert's weight dequantized into a transient f16 [E, Npad, K]
  (pallas/dequant.py on the flattened planes), then `jax.lax.ragged_dot_general` over the sorted
  rows and the per-expert group sizes. On NVIDIA GPUs XLA has no grouped GEMM for it: its
  RaggedDotRewriter (xla/hlo/transforms/expanders/ragged_dot_rewriter.cc) turns it into one
  dense dot over an [E, P, K] masked copy of the rows, E times the FLOPs (128x for Qwen3-30B),
  unless the experimental cuDNN fusion (XLA flag xla_gpu_experimental_use_ragged_dot_fusion)
  takes it;
- "pallas": the rows placed in token blocks of bm rows that each belong to one expert (each
  expert's rows padded to a multiple of bm), and the f16 GEMM (gemm._kernel with expert_npad)
  run on a static grid of the most blocks any routing can need, each block reading its expert
  from a device array and decoding that expert's weight tiles in-kernel; blocks past the used
  ones are skipped (their expert is -1);
- "dequant": as "pallas", on every expert's weight dequantized first into a transient f16
  [E * Npad, K] (the dense prefill's dequantize-then-GEMM, ops "dq+gemm"): a plain tile load
  per block where "pallas" decodes each expert's tiles once per token block of it.
"pallas" reads each expert's weight once per token block of it; "ragged" and "dequant" read it
once and write and reread its f16 copy, whichever tokens chose it; the GEMV (expert_gemv.py)
reads it once per pair. The blocked variants gather their token blocks straight from x and
their outputs straight into pair order (one gather each; no sorted copy, no scatter of rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from minfer_jax.pallas import dequant, gemm, tiles
from minfer_jax.quant.planes import QType, decode, fields_per_word, get_format
from minfer_jax.sizes import pow2_at_least

VARIANTS = ("ragged", "pallas", "dequant")
_FLOAT_QTYPE = {jnp.dtype(jnp.float16): QType.F16, jnp.dtype(jnp.bfloat16): QType.BF16}
MIN_BM, MAX_BM = 16, 64  # token-block rows of the Pallas variant: ~ pairs per expert, clamped


def sort_pairs(ids: jax.Array, n_experts: int):
    """The pairs of ids [T, k] in expert order, on the device -> (order [P]: pair index of each
    sorted row, sizes [E] int32: rows per expert)."""
    flat = ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    return order, sizes


def pair_rows(x: jax.Array, ids: jax.Array) -> jax.Array:
    """Each pair's input row: x [T, K] (shared by the token's slots) or [T, k, K] -> [P, K]."""
    t, k = ids.shape
    if x.ndim == 3:
        return x.reshape(t * k, x.shape[-1])
    return jnp.repeat(x, k, axis=0)


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "variant", "config", "interpret"))
def expert_matmul_sorted(
    x: jax.Array,
    planes: dict,
    ids: jax.Array,
    *,
    qtype: QType,
    n_out: int,
    variant: str = "ragged",
    config: gemm.GemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [T, K] or [T, k, K] . W[ids[t, j]]^T -> [T, k, n_out] f32 through the expert-sorted
    grouped GEMM of `variant` (VARIANTS)."""
    t, k = ids.shape
    n_experts = next(iter(planes.values())).shape[0]
    order, sizes = sort_pairs(ids, n_experts)
    if variant == "ragged":
        y_sorted = _ragged(pair_rows(x, ids)[order], planes, sizes, qtype, interpret)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)  # back to pair order
    elif variant in ("pallas", "dequant"):
        x2 = x.reshape(t * k if x.ndim == 3 else t, x.shape[-1])
        src_of_pair = jnp.arange(t * k, dtype=jnp.int32) // (1 if x.ndim == 3 else k)
        if variant == "dequant" and get_format(qtype).ints is not None:
            w = _dequantized(planes, qtype, interpret)  # f16 (bf16 for MXFP4)
            planes, qtype = {"w": w}, _FLOAT_QTYPE[jnp.dtype(w.dtype)]
        y = _blocked(x2, src_of_pair, order, sizes, planes, qtype, n_out, config, interpret)
    else:
        raise ValueError(f"expert GEMM variant {variant!r} is not one of {VARIANTS}")
    return y[:, :n_out].reshape(t, k, n_out)


def _dequantized(planes, qtype: QType, interpret: bool) -> jax.Array:
    """Every expert's weight decoded into f16 [E, Npad, K] (pallas/dequant.py, transient)."""
    e, npad = next(iter(planes.values())).shape[:2]
    flat = {name: p.reshape(e * npad, *p.shape[2:]) for name, p in planes.items()}
    w = dequant.dequantize(flat, qtype=qtype, interpret=interpret)  # [E * Npad, K]
    return w.reshape(e, npad, w.shape[-1])


def _ragged(rows, planes, sizes, qtype: QType, interpret: bool) -> jax.Array:
    """ragged_dot over every expert's dequantized f16 weight -> [P, Npad] f32."""
    w = _dequantized(planes, qtype, interpret)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(
        rows.astype(w.dtype), w, sizes, dims, preferred_element_type=jnp.float32
    )


def block_rows(n_pairs: int, n_experts: int) -> int:
    """Token-block rows of the Pallas variant: about the pairs per expert, a power of two."""
    return min(MAX_BM, max(MIN_BM, pow2_at_least(max(1, n_pairs // n_experts))))


def block_layout(sizes: jax.Array, n_pairs: int, bm: int):
    """Where each expert-sorted row goes in token blocks of bm rows, each block one expert's:
    -> (dest [P]: the row of each sorted pair, tile_expert [n_blocks]: each block's expert or -1
    past the used blocks, n_blocks: static, the most any routing needs)."""
    n_experts = sizes.shape[0]
    n_blocks = -(-n_pairs // bm) + min(n_experts, n_pairs)  # each expert wastes < one block
    padded = (sizes + bm - 1) // bm * bm
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    sorted_start = jnp.cumsum(sizes) - sizes
    expert_of_row = jnp.repeat(
        jnp.arange(n_experts, dtype=jnp.int32), sizes, total_repeat_length=n_pairs
    )
    rank = jnp.arange(n_pairs, dtype=jnp.int32) - sorted_start[expert_of_row]
    dest = padded_start[expert_of_row] + rank
    block_start = jnp.arange(n_blocks, dtype=jnp.int32) * bm
    owner = jnp.searchsorted(padded_end, block_start, side="right").astype(jnp.int32)
    tile_expert = jnp.where(owner < n_experts, owner, -1)
    return dest, tile_expert, n_blocks


def _blocked(x2, src_of_pair, order, sizes, planes, qtype: QType, n_out: int, config, interpret):
    """The Pallas grouped GEMM on token blocks of one expert each -> [P, Npad] f32 in pair order:
    x2 [R, K] the input rows, src_of_pair [P] each pair's row of x2, order / sizes sort_pairs'."""
    fmt = get_format(qtype)
    n_pairs, k = order.shape[0], x2.shape[1]
    e, npad = next(iter(planes.values())).shape[:2]
    cfg = config or gemm.choose_config(qtype, gemm.FEW_TOKEN_MAX_NT + 1, n_out, k)
    bm = config.bm if config else block_rows(n_pairs, e)
    dest, tile_expert, n_blocks = block_layout(sizes, n_pairs, bm)
    # each block row's x row (past the pairs: x2's row count, which the gather fills with 0)
    row_of_block_row = jnp.full((n_blocks * bm,), x2.shape[0], jnp.int32)
    row_of_block_row = row_of_block_row.at[dest].set(src_of_pair[order])
    xp = jnp.take(x2, row_of_block_row, axis=0, mode="fill", fill_value=0)
    xp = xp.astype(fmt.compute_dtype)
    if cfg.field_major:
        xp = gemm.permute_field_major(xp, cfg.bk, fields_per_word(qtype))
    arrays = [planes[p.name].reshape(e * npad, planes[p.name].shape[-1]) for p in fmt.planes]
    kernel = gemm.tile_kernel(
        qtype, bm, cfg.bn, cfg.bk, k, fmt.compute_dtype, cfg.magic_half, cfg.field_major, npad
    )
    tiles.silence_triton_deprecation()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_blocks * bm, npad), jnp.float32),
        grid=(n_blocks, npad // cfg.bn),
        in_specs=[
            pl.BlockSpec(tile_expert.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            *[pl.BlockSpec(a.shape, lambda i, j: (0, 0)) for a in arrays],
        ],
        out_specs=pl.BlockSpec((bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=tiles.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=f"expert_gemm_{fmt.name.lower()}",
    )(tile_expert, xp, *arrays)
    block_row_of_pair = jnp.zeros((n_pairs,), jnp.int32).at[order].set(dest)
    return out[block_row_of_pair]


@functools.partial(jax.jit, static_argnames=("qtype", "n_out"))
def expert_matmul_sorted_reference(
    x: jax.Array, planes: dict, ids: jax.Array, *, qtype: QType, n_out: int
) -> jax.Array:
    """What both variants compute, per pair on whole arrays: its expert's weight decoded in the
    compute dtype, x in the compute dtype, an f32-accumulated dot -> [T, k, n_out]."""
    t, k = ids.shape
    dtype = get_format(qtype).compute_dtype

    def pair(row, e):
        w = decode(qtype, {n: p[e] for n, p in planes.items()}, dtype)[:n_out]
        # in f32 at full precision: exact products, so only the summation order differs from
        # the kernels (a bf16 GEMV on the GPU may round its products, TF32 its inputs)
        w, row = w.astype(jnp.float32), row.astype(dtype).astype(jnp.float32)
        return jnp.dot(w, row, precision=jax.lax.Precision.HIGHEST)

    ys = jax.vmap(pair)(pair_rows(x, ids), ids.reshape(-1))
    return ys.reshape(t, k, n_out)
