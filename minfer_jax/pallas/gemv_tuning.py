"""GEMV policy: one frozen tuning row per weight format (TUNING) and the per-shape GemvConfig it
gives.

Everything the GEMV decides per format lives in its row; everything shared by all formats of a
path is a named constant below. Every value was measured on the H200 (device.TUNED_ON); the
evidence is one row each in docs/BENCHMARKS.md, section "GEMV choices", under the key the
comment names ([G-...]). Another GPU gets `row(qtype)`'s safe default: the format's row with the
measured toggles off (the plainest kernel of each path), its numerics (exact_round) kept, and
program targets scaled to its SMs (device.programs).

Integer path (block formats): every program one straight-line step of INT8_STEP_WEIGHTS weights
per row (no K loop: all its loads issue at once), K split into as many chunks as that takes.
For few tokens x is quantized inside every program; from PREQUANT_MIN_NT tokens on, for matrices
of PREQUANT_MIN_WEIGHTS or more, by one XLA fusion before the kernel, where a few formats take
other tiles (Int8Row.prequant_*).
Float formats: a [bn, bk] decoded tile per step, K split to about TARGET_PROGRAMS programs.
"""

from __future__ import annotations

import dataclasses

from minfer_jax.pallas import device, int8_words, tiles
from minfer_jax.quant.planes import QType
from minfer_jax.sizes import round_up

NT_PAD = 16  # x rows fed to the float formats' dot: Triton needs >= 16 on every dot side
MAX_NT = 8  # largest token count routed here (ops.GEMV_MAX_NT mirrors it)
OFF = (
    MAX_NT + 1
)  # an Int8Row token threshold past every default-routed token count: the choice is off

INT8_STEP_WEIGHTS = 512  # weights per row in a program's one step [G-step]
INT8_BN_TOKENS = 32  # rows per program from 2 tokens on [G-step]
INT8_MAX_PROGRAMS = 16384  # cap on row blocks x K splits [G-step]
PREQUANT_MIN_NT = 3  # from this token count on, x is quantized before the kernel [G-prequant-nt]
# ... for matrices of at least this many weights: below it the prepass launch costs more than
# the in-kernel quantization it saves (the 0.5B's matrices, the 7B's k / v) [G-prequant-size]
PREQUANT_MIN_WEIGHTS = 1 << 23
# prequant_rows / prequant_steps only while this many programs remain [G-prequant-tiles]
PREQUANT_MIN_PROGRAMS = 896

# the RMSNorm before a GEMV computed in each of its programs (ops.norm_matmuls) up to this many
# inputs and tokens: every program reads x's whole rows for the sums of squares [G-fold-norm]
# (the deterministic mode folds at every row count, so that a row's numerics never change)
FOLD_NORM_MAX_K = 1024
FOLD_NORM_MAX_NT = 1
# int8 terms of x in every integer GEMV of the precise mode (ops.Impl.precise): two keep the
# logits near a float64 forward's where a token forms a massive activation, but cost 15-27 % per
# 7B GEMV, so one term is the default [G-x-terms]
PRECISE_X_TERMS = 2
# integer path: programs ordered by row block, each row block's K splits one after another
# (GemvConfig.split_major), for GEMVs of at least this many K splits (0: never) [G-split-major]
SPLIT_MAJOR_FROM_SPLITS = 16
# integer path, x quantized in the kernel: weights of at least this many row blocks run one
# program per row block over all of K (a K loop) instead of one step per program (0: never)
# [G-loop-k]
LOOP_K_FROM_ROW_BLOCKS = 0
# folded GEMVs of the same x (a layer's q / k / v or gate / up in formats of their own) run as
# one launch, each program branching to its weight's format [G-group]
GROUP_FOLDED_GEMVS = True

TARGET_PROGRAMS = 1024  # float formats: ~8 programs per SM on the H200's 132 SMs [G-float-split]
TILE_ELEMS = 8192  # float formats: bn * bk ceiling (decoded tile + intermediates in registers)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One call's resolved blocks and path (choose_config's answer; tools may pass their own)."""

    bn: int
    bk: int  # weights per step (integer path: groups per step * group)
    splits: int
    num_warps: int = 4
    num_stages: int = 1  # Triton's software pipelining of these loads measured slower [G-stages]
    # float formats, nt == 1: CUDA-core multiply-add into a [bn, bk] f32 accumulator [G-fma]
    fma: bool = False
    # integer path: x quantized by XLA before the kernel (int8_words.quantize_x)
    prequant: bool = False
    # integer path: x loaded (and quantized) before the weights are decoded [G-x-first]
    x_first: bool = False
    # integer path, x quantized in the kernel: int8 terms of x (2: its rounding residual too,
    # int8_words.quantize_slot_terms) [G-x-terms]
    x_terms: int = 1
    # integer path: grid (splits, row blocks), so that consecutive programs read one row block's
    # K splits (contiguous weight rows) rather than one split of many row blocks
    split_major: bool = False


@dataclasses.dataclass(frozen=True)
class Int8Row:
    """A block format's integer-path choices (the columns of TUNING)."""

    rows_one_token: int  # bn at one token: 16-weight groups (heavier decode) take 16 [G-step]
    x_first_from: int  # in-kernel x: loaded before the weights from this token count on [G-x-first]
    prequant_x_first_from: int  # pre-quantized x: the same [G-x-first-prequant]
    prequant_rows: int  # pre-quantized x: rows per program [G-prequant-tiles]
    prequant_steps: int  # pre-quantized x: steps per program (a K loop) [G-prequant-tiles]
    prequant_3d: bool  # pre-quantized x: per-group values as [bn, gt, 1] tiles [G-prequant-tiles]
    exact_round: bool  # x rounded by int8_words.round_to_int, else floor(v + 0.5) [G-round]

    def config(self, qtype: QType, n: int, k: int, nt: int, x_terms: int = 1) -> GemvConfig:
        npad = round_up(n, 128)
        group = int8_words.SPECS[qtype].group
        gt = tiles.pow2_divisor(k // group, INT8_STEP_WEIGHTS // group)
        # x in more than one term is quantized in the kernel (quantize_x makes one term)
        prequant = nt >= PREQUANT_MIN_NT and n * k >= PREQUANT_MIN_WEIGHTS and x_terms == 1
        bn = self.rows_one_token if nt == 1 else INT8_BN_TOKENS
        chunks, steps = k // (gt * group), 1
        if prequant:
            # fewer, longer programs only where as many programs remain as where it was measured
            if (npad // self.prequant_rows) * chunks >= PREQUANT_MIN_PROGRAMS:
                bn = self.prequant_rows
            steps = tiles.pow2_divisor(chunks, self.prequant_steps)
            while steps > 1 and (npad // bn) * (chunks // steps) < PREQUANT_MIN_PROGRAMS:
                steps //= 2
        elif 0 < LOOP_K_FROM_ROW_BLOCKS <= npad // bn:
            steps = chunks  # the row blocks alone fill the GPU: one program per row block
        splits = one_step_splits(chunks // steps, npad // bn)
        x_first = nt >= (self.prequant_x_first_from if prequant else self.x_first_from)
        return GemvConfig(
            bn=bn,
            bk=gt * group,
            splits=splits,
            prequant=prequant,
            x_first=x_first,
            x_terms=x_terms,
            split_major=0 < SPLIT_MAJOR_FROM_SPLITS <= splits,
        )

    def tile_shapes(self, prequant: bool) -> tuple[bool, bool]:
        """(dims3, flat): per-group values as [bn, gt, 1] tiles (prequant_3d rows, pre-quantized x);
        one-word quant views (Q2_K, Q3_K) as [bn, gt] on the other pre-quantized kernels
        [G-flat-words]."""
        dims3 = prequant and self.prequant_3d
        return dims3, prequant and not dims3


@dataclasses.dataclass(frozen=True)
class FloatRow:
    """A float format's choices: tile width and the one-token multiply-add path."""

    max_bk: int = 256  # weights per step, at most
    # token count that multiply-adds on CUDA cores instead of the 16-row dot [G-fma]
    fma_nt: int = 1

    def config(self, qtype: QType, n: int, k: int, nt: int) -> GemvConfig:
        npad = round_up(n, 128)
        bk = tiles.pow2_divisor(k, self.max_bk)
        bn = max(16, min(64, TILE_ELEMS // bk))
        return GemvConfig(bn=bn, bk=bk, splits=_splits(k // bk, npad // bn), fma=nt == self.fma_nt)


# fmt: off
TUNING: dict[QType, Int8Row | FloatRow] = {  # measured on device.TUNED_ON (the H200)
    #                   rows at  x first from        pre-quantized x
    #                   1 token  in-kernel prequant  rows steps 3-D    exact_round
    QType.Q8_0: Int8Row(32,      2,        OFF,      32,  1,    False, True),
    QType.Q4_0: Int8Row(32,      2,        3,        64,  1,    True,  False),
    QType.Q4_1: Int8Row(32,      2,        8,        32,  1,    False, True),
    QType.Q5_0: Int8Row(32,      1,        OFF,      32,  1,    False, True),
    QType.Q5_1: Int8Row(32,      1,        OFF,      32,  1,    False, True),
    QType.Q4_K: Int8Row(32,      OFF,      8,        32,  4,    True,  True),
    QType.Q5_K: Int8Row(32,      1,        OFF,      32,  1,    False, True),
    QType.Q6_K: Int8Row(16,      1,        3,        32,  1,    False, True),
    QType.Q3_K: Int8Row(16,      1,        OFF,      32,  1,    False, True),
    QType.Q2_K: Int8Row(16,      OFF,      OFF,      32,  1,    False, True),
    # not measured: the rows of the closest 4-bit layout (one scale per 32 nibbles: Q4_0; 32-weight
    # sub-scales under a super-block d: Q4_K)
    QType.IQ4_NL: Int8Row(32,    2,        3,        64,  1,    True,  False),
    QType.MXFP4: Int8Row(32,     2,        3,        64,  1,    True,  False),
    QType.IQ4_XS: Int8Row(32,    OFF,      8,        32,  4,    True,  True),
    QType.F32: FloatRow(),
    QType.F16: FloatRow(),
    QType.BF16: FloatRow(),
}
# fmt: on


def generic(r: Int8Row | FloatRow) -> Int8Row | FloatRow:
    """A row for a GPU it was not measured on: x loaded after the weights, one step of 32 rows
    per pre-quantized program, flat tiles; one-token rows and rounding (numerics) as measured."""
    if isinstance(r, FloatRow):
        return r
    return dataclasses.replace(
        r,
        x_first_from=OFF,
        prequant_x_first_from=OFF,
        prequant_rows=INT8_BN_TOKENS,
        prequant_steps=1,
        prequant_3d=False,
    )


def row(qtype: QType) -> Int8Row | FloatRow:
    """The format's TUNING row on the GPU it was measured on, else its generic() default."""
    r = TUNING[qtype]
    return r if device.current().tuned else generic(r)


def choose_config(
    qtype: QType, n: int, k: int, nt: int = 1, deterministic: bool = False, precise: bool = False
) -> GemvConfig:
    """Blocks and path for one weight shape and token count: the format's row applied.

    deterministic: one configuration for every token count (the one-token blocks, x quantized
    in the kernel, the float formats' tensor-core dot), so that each token's sums run in the
    same order whatever else is in the call. precise: the integer path's x in PRECISE_X_TERMS
    int8 terms, quantized in the kernel at every token count (ops.Impl.precise)."""
    r, count = row(qtype), 1 if deterministic else nt
    if isinstance(r, FloatRow):  # x is not quantized on the float path
        cfg = r.config(qtype, n, k, count)
    else:
        cfg = r.config(qtype, n, k, count, PRECISE_X_TERMS if precise else 1)
    return dataclasses.replace(cfg, fma=False) if deterministic else cfg


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(chunks: int, programs: int) -> int:
    """The K split (a divisor of chunks) whose program count lands nearest TARGET_PROGRAMS
    [G-float-split]."""
    return tiles.nearest_split(chunks, programs, device.programs(TARGET_PROGRAMS))


def one_step_splits(chunks: int, row_programs: int) -> int:
    """Integer path: the K split that gives every program a single step (no K loop: straight-line
    code whose loads all issue at once), capped at INT8_MAX_PROGRAMS (then the largest divisor
    of chunks under the cap)."""
    return max((d for d in _divisors(chunks) if row_programs * d <= INT8_MAX_PROGRAMS), default=1)
