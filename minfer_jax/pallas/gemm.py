"""GEMM: y[M, N] = x[M, K] . W[N, K]^T for M >= 9 tokens, weight tiles decoded in-kernel.

ops.matmul runs it on a quantized weight's planes (the "f16" variant: by default for 9 ..
FEW_TOKEN_MAX_NT tokens, i.e. batched decode) or, for longer prefill chunks, on the transient
f16 matrix pallas/dequant.py made of them (the "dequant" variant: W is then an F16 weight and the
tile decode is a plain load).

Layout expected (quant.planes): each plane [Npad, K / wpc], rows padded to ROW_ALIGN; x is padded
by the wrapper to a multiple of bm rows (prefill buckets are powers of two, so usually it is).

Grid (Mpad / bm, Npad / bn, splits), the token axis fastest so that programs running together
share a weight tile (decoded from L2 rather than HBM). Each program walks its K range in bk
steps: the x tile [bm, bk] and the weight tile decoded into the compute dtype [bn, bk] meet in one
tensor-core dot with f32 accumulation. Few tokens split K (splits > 1) so that enough programs
run; XLA adds the partial sums. Formats whose quants sit in one plane of fields (nibbles, bytes)
then decode field-major: per K step one dot per field index i (8 for nibbles, 4 for bytes), of
the [bn, W] weights per * j + i, against x's columns that the wrapper permuted to match (a dot's
sum is order-free), so the decoded tile is never reshaped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from minfer_jax.pallas import device, tiles
from minfer_jax.quant.planes import (
    QType,
    field_ints,
    field_scales,
    fields_per_word,
    get_format,
    int_to_half,
)
from minfer_jax.sizes import round_up


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int = 8
    num_stages: int = 2
    splits: int = 1  # K split: partial sums [splits, M, N] added by XLA (few tokens: more programs)
    magic_half: bool = False  # integers to f16 by planes.int_to_half's bit trick
    # one dot per field index on x's permuted columns (planes.FIELD_PLANES)
    field_major: bool = False


# Tiles (bn, bk, num_warps, num_stages) from the H200 sweeps at 512 x 4096 x 14336
# (docs/BENCHMARKS.md); bm comes from the token count. Another GPU takes them with at most
# device.GENERIC_MAX_STAGES stages (device.stages).
# 32-weight blocks: narrow 64-row weight tiles on 4 warps (Q4_0 232 TFLOP/s, Q5_0 199, Q4_1 208)
# beat 128 x 128 on 8 warps (203, 153, 155): half as much decode work per program between dots.
# K-quants: bk 128 so one tile decodes half a super-block's scales; 3 stages (Q4_K 178, Q2_K 198,
# Q6_K 174) beat 2 (153, 160, 158). Float weights: nothing to decode, so a deep pipeline pays (F16
# 4 stages 500, 3 stages 464, 2 stages 254); f32 tiles fit only 3 stages in shared memory.
SMALL_BLOCK_TILE = (64, 64, 4, 3)
SUPERBLOCK_TILE = (128, 128, 8, 3)
HALF_TILE = (128, 64, 8, 4)
F32_TILE = (128, 64, 8, 3)

# Few tokens (a decode batch of 9 .. FEW_TOKEN_MAX_NT rows): one token block of bm = nt rows and K
# split until about FEW_TOKEN_PROGRAMS programs run (Npad / bn alone leaves most SMs idle); block
# formats take narrow 64 x 128 weight tiles on 4 warps, 3 stages (Q4_K, Q6_K: FEW_TOKEN_K_TILE),
# integers to f16 by the bit trick.
# H200, Q4_K / Q6_K at the 7B's shapes, 16 .. 64 tokens: 1.3-2.8x the dequantize-then-GEMM route
# (docs/BENCHMARKS.md, GEMV choices [G-few-tokens]). Float weights keep their tile, split the same
# way (not measured on the GPU: unsplit, 16 tokens of a 3584-row matrix run 28 programs).
FEW_TOKEN_MAX_NT = 64
FEW_TOKEN_TILE = (64, 128, 4, 3)
# Q4_K and Q6_K (field-major super-blocks): 256-weight steps, so each field's dot has 32 words,
# on 2 stages (H100, 16 / 32 tokens: 10-28 % less time at every 7B shape, [G-few-tokens-k])
FEW_TOKEN_K_TILE = (64, 256, 4, 2)
# ... and 512-weight steps where each program walks all of K (no split) for <= 16 tokens
FEW_TOKEN_K_LONG_STEP = 512
FEW_TOKEN_PROGRAMS = 528  # 4 per SM on the H200's 132 (device.programs scales it to another GPU)
# Formats measured to gain from the field-major decode (`field_major`): one dot per nibble index
# on [bn, bk / 8] words, with no reshape of the decoded tile (reshaped, it reached the dot through
# one scalar shared-memory store per weight: 38 % of the Q4_K kernel's stall samples under Nsight
# Compute). H200, Q4_K 37888 x 3584 at 16 / 32 tokens: 115 -> 79 / 129 -> 101 us
# ([G-field-major]); H100, Q8_0 151936 x 896 (the 0.5B's head) 139 -> 60 us at 16 tokens, Q5_0
# level to 7 % faster. Q5_1 and Q5_K can too (planes.FIELD_PLANES; compiled and tested on an
# H100) but are not timed, so off.
FIELD_MAJOR = frozenset({QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_0, QType.Q6_K, QType.Q8_0})
FIELD_MIN_WORDS = 16  # words per field dot: the f16 tensor-core dot's smallest K


def choose_config(qtype: QType, m: int, n: int, k: int) -> GemmConfig:
    """Tile sizes for one GEMM shape (tuned on the H200: device.py says what another GPU gets)."""
    bm = min(128, max(16, tiles.pow2_divisor(round_up(m, 16), 128)))
    fmt = get_format(qtype)
    if fmt.block == 256:
        bn, bk, warps, stages = SUPERBLOCK_TILE
    elif fmt.block == 32:
        bn, bk, warps, stages = SMALL_BLOCK_TILE
    else:
        bn, bk, warps, stages = F32_TILE if fmt.compute_dtype == jnp.float32 else HALF_TILE
    if m > FEW_TOKEN_MAX_NT:
        return GemmConfig(
            bm=bm,
            bn=bn,
            bk=tiles.pow2_divisor(k, bk),
            num_warps=warps,
            num_stages=device.stages(stages),
        )
    k_tile = fmt.block == 256 and qtype in FIELD_MAJOR  # Q4_K, Q6_K
    if fmt.ints is not None:  # block formats' few-token tiles (float weights keep theirs)
        bn, bk, warps, stages = FEW_TOKEN_K_TILE if k_tile else FEW_TOKEN_TILE
    bk = tiles.pow2_divisor(k, bk)
    splits = few_token_splits(fmt, n, k, bn, bk)
    if k_tile and splits == 1 and bm == 16:
        bk = tiles.pow2_divisor(k, FEW_TOKEN_K_LONG_STEP)
    return GemmConfig(
        bm=bm,
        bn=bn,
        bk=bk,
        num_warps=warps,
        num_stages=device.stages(stages),
        splits=splits,
        magic_half=fmt.ints is not None,
        field_major=qtype in FIELD_MAJOR and bk // fields_per_word(qtype) >= FIELD_MIN_WORDS,
    )


def few_token_splits(
    fmt, n: int, k: int, bn: int, bk: int, target: int | None = None, token_blocks: int = 1
) -> int:
    """The K split (a divisor of the K steps, each split whole blocks: the K-quants' d is one per
    256) whose program count lands nearest `target` (default FEW_TOKEN_PROGRAMS, scaled to this
    GPU); 1 when the rows alone reach it."""
    target = target or device.programs(FEW_TOKEN_PROGRAMS)
    programs = token_blocks * round_up(n, 128) // bn
    return (
        1 if programs >= target else tiles.nearest_split(k // max(bk, fmt.block), programs, target)
    )


@functools.cache
def tile_kernel(
    qtype: QType,
    bm: int,
    bn: int,
    bk: int,
    k: int,
    compute_dtype,
    magic_half: bool = False,
    field_major: bool = False,
    expert_npad: int = 0,
):
    """One kernel closure per configuration (jax#40847: a shared function object can reuse a
    trace). expert_npad > 0: the grouped expert GEMM's (expert_gemm.py): a first ref holds each
    token block's expert (-1: an empty tile, skipped), the plane refs are a stacked weight's
    whole planes flattened to [E * expert_npad, cols], and the block's expert's rows are read at
    e * expert_npad + (row block) * bn."""
    fmt = get_format(qtype)
    n_k = k // bk
    dn = (((1,), (1,)), ((), ()))
    per = fields_per_word(qtype) if field_major else 1
    words = bk // per

    def kernel(*refs):
        if not expert_npad:
            return tile_product(0, *refs)
        tile_expert_ref, *refs = refs
        e = tile_expert_ref[pl.program_id(0)]
        r0 = e * expert_npad + pl.program_id(1) * bn
        pl.when(e >= 0)(lambda: tile_product(r0, *refs))

    def tile_product(r0, x_ref, *refs):
        *plane_refs, o_ref = refs

        def step(j, acc):
            k0 = j * bk
            kx = k0 if isinstance(k0, int) else pl.multiple_of(k0, bk)
            if (
                field_major
            ):  # x's columns kx + i * words + j hold x[kx + per j + i] (permute_field_major)
                t = tiles.load_plane_tiles(fmt, plane_refs, r0, bn, k0, bk)
                a, b = field_scales(qtype, t, compute_dtype)  # [bn, words]
                for i in range(per):
                    q = field_ints(qtype, t, i)
                    q = int_to_half(q) if magic_half else q.astype(compute_dtype)
                    w = q * a if b is None else q * a + b  # [bn, words]: weights per j + i
                    xi = x_ref[:, pl.ds(kx + i * words, words)]  # [bm, words]
                    acc = acc + lax.dot_general(xi, w, dn, preferred_element_type=jnp.float32)
                return acc
            w = tiles.load_weight_tile(
                fmt, plane_refs, r0, bn, k0, bk, compute_dtype, magic_half
            )  # [bn, bk]
            xt = x_ref[:, pl.ds(kx, bk)]  # [bm, bk]
            return acc + lax.dot_general(xt, w, dn, preferred_element_type=jnp.float32)  # [bm, bn]

        acc = jnp.zeros((bm, bn), jnp.float32)
        o_ref[...] = tiles.k_steps(n_k, step, acc)

    return kernel


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "config", "interpret"))
def gemm(
    x: jax.Array,
    planes: dict,
    *,
    qtype: QType,
    n_out: int,
    config: GemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] . W^T -> [M, n_out] f32, W given as its planes."""
    m, k = x.shape
    fmt = get_format(qtype)
    cfg = config or choose_config(qtype, m, n_out, k)
    arrays = tiles.plane_arrays(fmt, planes)
    npad = arrays[0].shape[0]
    mpad = round_up(m, cfg.bm)
    k_split = k // cfg.splits
    assert npad % cfg.bn == 0 and k % cfg.splits == 0 and k_split % max(cfg.bk, fmt.block) == 0, (
        cfg,
        npad,
        k,
    )
    tiles.silence_triton_deprecation()

    xp = tiles.cast_rows(x, mpad, fmt.compute_dtype)  # [Mpad, K]
    if cfg.field_major:
        per = fields_per_word(qtype)
        assert cfg.bk // per >= FIELD_MIN_WORDS and fmt.compute_dtype == jnp.float16, cfg
        xp = permute_field_major(xp, cfg.bk, per)
    kernel = tile_kernel(
        qtype, cfg.bm, cfg.bn, cfg.bk, k_split, fmt.compute_dtype, cfg.magic_half, cfg.field_major
    )
    out = tiled_call(
        kernel,
        [xp],
        arrays,
        fmt,
        cfg.bm,
        cfg.bn,
        cfg.num_warps,
        cfg.num_stages,
        interpret,
        f"gemm_{fmt.name.lower()}",
        splits=cfg.splits,
    )
    return out[:m, :n_out]


def permute_field_major(x: jax.Array, bk: int, per: int) -> jax.Array:
    """x [M, K] -> columns permuted within each K step of bk: column i * (bk / per) + j <- per j + i
    (the field-major kernel's dot for field i then reads one contiguous column block)."""
    m, k = x.shape
    return x.reshape(m, k // bk, bk // per, per).transpose(0, 1, 3, 2).reshape(m, k)


def tiled_call(
    kernel,
    token_inputs,
    plane_arrays,
    fmt,
    bm: int,
    bn: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
    splits: int = 1,
) -> jax.Array:
    """Grid (Mpad / bm, Npad / bn, splits), token blocks fastest: token-side inputs [Mpad, cols]
    blocked by rows, planes blocked by weight rows, both by K range when split; output [Mpad, Npad]
    f32 (with splits > 1 the partial sums [splits, Mpad, Npad] added by XLA). Shared by both GEMM
    variants; every input's columns must be proportional to K (so a K range is a column block)."""
    mpad, npad = token_inputs[0].shape[0], plane_arrays[0].shape[0]
    k = plane_arrays[0].shape[1] * fmt.planes[0].wpc
    in_specs = [
        pl.BlockSpec((bm, t.shape[1] // splits), lambda i, j, s: (i, s)) for t in token_inputs
    ]
    in_specs += [
        pl.BlockSpec((bn, k // splits // p.wpc), lambda i, j, s: (j, s)) for p in fmt.planes
    ]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, mpad, npad), jnp.float32),
        grid=(mpad // bm, npad // bn, splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        compiler_params=tiles.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*token_inputs, *plane_arrays)
    return out[0] if splits == 1 else out.sum(axis=0)


# The jnp reference this kernel is tested against: the same decode on the whole matrix, one dot.
gemm_reference = tiles.dequant_matmul_reference
