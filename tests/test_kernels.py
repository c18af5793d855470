"""Pallas GEMV / GEMM kernels vs their jnp references, interpreted on the CPU or compiled on a GPU
(tests/kernel_mode.py: MINFER_TEST_KERNELS=compiled), and ops.route's every branch.

Every format x token counts x shapes with tails: K = 896 and 4864 (the 0.5B widths; K-quants
need K % 256 == 0, so they use 512 and 4864), N not a multiple of any row block. Each kernel and
its reference do the same arithmetic (same compute dtype or same activation quantization, f32
accumulation), so they differ only by summation order; the integer paths are also held within
the activation-quantization error of the f16 decode.
"""

import dataclasses
import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_mode import INTERPRET, KERNELS
from minfer_jax.pallas import dequant, gemm, gemm_int8, gemv, gemv_tuning, int8_words, tiles
from minfer_jax.quant.planes import (
    FORMATS,
    QType,
    affine,
    decode,
    field_ints,
    field_scales,
    fields_per_word,
    get_format,
)

from minfer_bench.bench.kernel_timing import random_planes

SUPERBLOCKS = sorted(q for q, f in FORMATS.items() if f.block == 256)  # K-quants, IQ4_XS


# The codebook formats share one word path (their tables and scales differ): one shape each, the
# GEMV at 1 and 3 tokens, to keep their CI time near a minute (tests/test_codebooks.py has the rest)
CODEBOOKS = (QType.IQ4_NL, QType.IQ4_XS, QType.MXFP4)


def shapes_for(qtype):
    shapes = [(200, 512), (136, 4864)] if qtype in SUPERBLOCKS else [(200, 896), (136, 4864)]
    return shapes[:1] if qtype in CODEBOOKS else shapes


CASES = [(q, n, k) for q in FORMATS for n, k in shapes_for(q)]
GEMV_CASES = [
    (q, n, k, nt) for q, n, k in CASES for nt in (1, 2, 3, 8) if q not in CODEBOOKS or nt in (1, 3)
]


def gemv_family(qtype):
    """The GEMV entry point of qtype's family and its reference
    (ops.route picks the same family)."""
    if qtype in int8_words.SPECS:
        return gemv.gemv_int8, gemv.gemv_int8_reference
    return gemv.gemv_float, gemv.gemv_float_reference


@functools.cache
def planes_for(qtype, n, k):
    return random_planes(jax.random.PRNGKey(n + k), qtype, n, k)


def check(got, ref, qtype):
    chex.assert_equal_shape([got, ref])
    chex.assert_tree_all_finite(got)
    rtol = 2e-2 if qtype == QType.BF16 else 1e-3  # only the summation order differs
    scale = float(jnp.max(jnp.abs(ref)))
    chex.assert_trees_all_close(got, ref, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("qtype,n,k,nt", GEMV_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_gemv_matches_reference(qtype, n, k, nt):
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, k), jnp.float32)
    kernel, reference = gemv_family(qtype)
    got = kernel(x, w, qtype=qtype, n_out=n, interpret=INTERPRET)
    check(got, reference(x, w, qtype=qtype, n_out=n), qtype)
    if (
        qtype in int8_words.SPECS
    ):  # int8 activations: within their quantization error of the f16 decode
        f16 = gemm.gemm_reference(x, w, qtype=qtype, n_out=n)
        chex.assert_trees_all_close(got, f16, atol=2e-2 * float(jnp.max(jnp.abs(f16))), rtol=0)


# 512 tokens at K = 4864 take minutes in the interpreter: 512 is covered at the narrow shape.
GEMM_CASES = [
    (q, n, k, nt)
    for q, n, k in CASES
    for nt in (9, 16, 100, 512)
    if (nt < 512 or k <= 1024) and (q not in CODEBOOKS or nt in (16, 100))
]


@pytest.mark.parametrize("qtype,n,k,nt", GEMM_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_gemm_matches_reference(qtype, n, k, nt):
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, k), jnp.float32)
    got = gemm.gemm(x, w, qtype=qtype, n_out=n, interpret=INTERPRET)
    check(got, gemm.gemm_reference(x, w, qtype=qtype, n_out=n), qtype)


def test_gemv_split_k_and_explicit_config():
    qtype, n, k = QType.Q4_0, 256, 2048
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, k))
    ref = gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n)
    for cfg in [gemv.GemvConfig(bn=32, bk=128, splits=4), gemv.GemvConfig(bn=64, bk=256, splits=1)]:
        check(
            gemv.gemv_int8(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET), ref, qtype
        )


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K, QType.F16], ids=lambda q: q.name)
def test_gemm_explicit_configs(qtype):
    """Narrow weight tiles, a deeper pipeline and a token tail (40 tokens in 32-row blocks)."""
    n, k = 200, 512
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(1), (40, k))
    ref = gemm.gemm_reference(x, w, qtype=qtype, n_out=n)
    for cfg in [
        gemm.GemmConfig(bm=32, bn=64, bk=256, num_stages=3),
        gemm.GemmConfig(bm=16, bn=128, bk=256),
    ]:
        check(gemm.gemm(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET), ref, qtype)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_gemm_few_tokens_split_k(qtype):
    """A decode batch (9 .. 64 rows): K split into whole blocks, partial sums added, integers to f16
    by the bit trick; every split count and both GEMM variants match their references."""
    n, k = 128, 1024
    cfg = gemm.choose_config(qtype, 16, n, k)
    assert (
        cfg.magic_half
        and cfg.bm == 16
        and cfg.splits > 1
        and (k // cfg.splits) % get_format(qtype).block == 0
    )
    assert (
        gemm.choose_config(qtype, 16, 18944, 3584).splits == 2
    )  # 296 row blocks: split once to ~528 programs
    assert gemm.choose_config(qtype, gemm.FEW_TOKEN_MAX_NT + 1, n, k).splits == 1  # prefill tiles
    f16 = gemm.choose_config(QType.F16, 16, 3584, 3584)  # float weights: their own tile, split too
    assert (f16.bn, f16.splits, f16.magic_half) == (gemm.HALF_TILE[0], 14, False)
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(3), (24, k))
    ref, ref8 = (
        f(x, w, qtype=qtype, n_out=n) for f in (gemm.gemm_reference, gemm_int8.gemm_int8_reference)
    )
    assert cfg.field_major == (qtype in gemm.FIELD_MAJOR)
    for splits in (1, 2, 4):
        c = dataclasses.replace(
            cfg,
            bm=32,
            splits=splits,
            magic_half=splits != 2,
            field_major=cfg.field_major and splits != 4,
        )
        check(gemm.gemm(x, w, qtype=qtype, n_out=n, config=c, interpret=INTERPRET), ref, qtype)
        c8 = gemm_int8.Int8GemmConfig(bm=32, bn=64, num_warps=4, splits=splits)
        check(
            gemm_int8.gemm_int8(x, w, qtype=qtype, n_out=n, config=c8, interpret=INTERPRET),
            ref8,
            qtype,
        )


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_few_token_k_quant_steps(qtype):
    """Q4_K / Q6_K at 9 .. 64 tokens step 256 weights (FEW_TOKEN_K_TILE), 512 where an unsplit
    program walks all of K for at most 16 tokens; the other formats keep FEW_TOKEN_TILE; the
    long step's product matches the reference."""
    assert gemm.choose_config(qtype, 32, 37888, 3584).bk == gemm.FEW_TOKEN_K_TILE[1]
    assert gemm.choose_config(qtype, 16, 3584, 18944).bk == gemm.FEW_TOKEN_K_TILE[1]  # split K
    long = gemm.choose_config(qtype, 12, 37888, 3584)
    assert (long.bm, long.splits, long.bk) == (16, 1, gemm.FEW_TOKEN_K_LONG_STEP)
    q4_0 = gemm.choose_config(QType.Q4_0, 16, 4096, 14336)
    assert q4_0.bk == gemm.choose_config(QType.Q4_0, 12, 37888, 3584).bk == gemm.FEW_TOKEN_TILE[1]
    n, k = 64, 1024
    cfg = dataclasses.replace(gemm.choose_config(qtype, 16, n, k), splits=1, bk=512)
    assert cfg.field_major and cfg.magic_half
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(5), (16, k))
    check(
        gemm.gemm(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET),
        gemm.gemm_reference(x, w, qtype=qtype, n_out=n),
        qtype,
    )


FIELD_FORMATS = [q for q, f in FORMATS.items() if f.field is not None]


@pytest.mark.parametrize("qtype", FIELD_FORMATS, ids=lambda q: q.name)
def test_field_major_decode(qtype):
    """Per field index i, field_ints * field_scales are exactly the decoded weights per j + i, and
    the field-major few-token GEMM (x permuted to match) gives the reference's product."""
    n, k = 136, 1024
    per = fields_per_word(qtype)
    w = planes_for(qtype, n, k)
    full = decode(qtype, w, jnp.float16)
    a, b = field_scales(qtype, w, jnp.float16)
    for i in range(per):
        q = field_ints(qtype, w, i).astype(jnp.float16)
        chex.assert_trees_all_equal(q * a if b is None else affine(q, a, b), full[:, i::per])
    perm = gemm.permute_field_major(jnp.arange(2 * 256)[None], 256, per)[0]
    assert (
        list(perm[:3]) == [0, per, 2 * per]
        and list(perm[256 // per :][:2]) == [1, per + 1]
        and int(perm[256]) == 256
    )
    x = jax.random.normal(jax.random.PRNGKey(4), (16, k))
    cfg = gemm.GemmConfig(
        bm=16, bn=64, bk=256, num_warps=4, num_stages=3, splits=2, magic_half=True, field_major=True
    )
    check(
        gemm.gemm(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET),
        gemm.gemm_reference(x, w, qtype=qtype, n_out=n),
        qtype,
    )


def test_int_to_half_is_exact():
    from minfer_jax.quant.planes import int_to_half

    q = jnp.arange(-512, 512, dtype=jnp.int32)
    chex.assert_trees_all_equal(int_to_half(q), q.astype(jnp.float16))


@pytest.mark.parametrize("qtype", SUPERBLOCKS, ids=lambda q: q.name)
@pytest.mark.parametrize("nt", [1, 3])
def test_gemv_k_split_inside_super_blocks(qtype, nt):
    """Splits of 4 groups cut every 256-weight super-block: per-super-block planes (d, dmin, Q3_K's
    shared qh words) are gathered at absolute group numbers, so the sums must not change."""
    n, k = 136, 2560
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, k))
    group = int8_words.SPECS[qtype].group
    cfg = gemv.GemvConfig(bn=16, bk=4 * group, splits=k // group // 4)
    check(
        gemv.gemv_int8(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET),
        gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n),
        qtype,
    )


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0, QType.Q3_K])
def test_gemv_prequantized_tile_shapes(qtype, monkeypatch):
    """The tiles of the measured several-token rules, on a small matrix (pre-quantized here, as
    from PREQUANT_MIN_WEIGHTS on): Q4_K 4 steps per program (a K loop over 3-D tiles), Q4_0 64
    rows of 3-D tiles, Q3_K flat one-word quant views."""
    monkeypatch.setattr(gemv_tuning, "PREQUANT_MIN_WEIGHTS", 0)
    n, k, nt = 136, 4096, 3
    cfg = gemv.choose_config(qtype, n, k, nt)
    assert cfg.prequant
    if qtype == QType.Q4_K:
        cfg = dataclasses.replace(cfg, splits=k // cfg.bk // 4)
    if qtype == QType.Q4_0:
        cfg = dataclasses.replace(cfg, bn=64)
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(5), (nt, k))
    check(
        gemv.gemv_int8(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET),
        gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n),
        qtype,
    )


def test_gemv_one_token_config_is_one_step_per_program():
    """One token: K split into single-step chunks (7B ffn_down, K = 18944: 37 splits), capped in
    programs."""
    cfg = gemv.choose_config(QType.Q4_K, 3584, 18944, 1)
    assert (cfg.bn, cfg.bk, cfg.splits) == (32, 16 * 32, 37)
    cfg = gemv.choose_config(QType.Q6_K, 4096, 14336, 1)  # 16-weight groups: 32 of them per step
    assert (cfg.bn, cfg.bk, cfg.splits, cfg.prequant) == (16, 32 * 16, 28, False)
    cfg = gemv.choose_config(
        QType.Q8_0, 4096, 14336, 8
    )  # several tokens: one step too, x quantized before
    assert (cfg.bn, cfg.bk, cfg.splits, cfg.prequant) == (32, 16 * 32, 28, True)
    cfg = gemv.choose_config(QType.Q4_0, 4096, 14336, 8)  # measured exceptions: 64 rows ...
    assert (cfg.bn, cfg.bk, cfg.splits, cfg.prequant) == (64, 16 * 32, 28, True)
    cfg = gemv.choose_config(QType.Q4_K, 4096, 14336, 8)  # ... or 4 steps per program
    assert (cfg.bn, cfg.bk, cfg.splits, cfg.prequant) == (32, 16 * 32, 7, True)
    cfg = gemv.choose_config(QType.Q4_K, 896, 896, 8)  # 0.5B: 7 chunks, no power-of-two step count
    assert (cfg.bk, cfg.splits) == (128, 7)
    # x quantized in the kernel at every token count below PREQUANT_MIN_WEIGHTS (the 0.5B's
    # matrices, the 7B's k / v), before it from 3 tokens on for the larger ones
    assert [
        gemv.choose_config(q, n, k, nt).prequant
        for q, n, k, nt in [
            (QType.Q5_0, 896, 896, 4),
            (QType.Q5_0, 4864, 896, 8),
            (QType.Q6_K, 512, 3584, 8),
            (QType.Q4_K, 3584, 3584, 2),
            (QType.Q4_K, 3584, 3584, 3),
            (QType.Q4_K, 18944, 3584, 8),
        ]
    ] == [False, False, False, False, True, True]
    cfg = gemv.choose_config(QType.Q4_K, 896, 4864, 8)  # 19 chunks: one step each
    assert (cfg.bk, cfg.splits) == (256, 19)
    # x before the weights where measured faster: per format, path and (Q8_0) token count
    assert [
        gemv.choose_config(q, 4096, 14336, nt).x_first
        for q, nt in [
            (QType.Q5_0, 1),
            (QType.Q4_K, 1),
            (QType.Q2_K, 1),
            (QType.Q8_0, 1),
            (QType.Q8_0, 2),
            (QType.Q4_0, 8),
            (QType.Q5_0, 8),
            (QType.Q4_K, 3),
            (QType.Q4_K, 8),
        ]
    ] == [True, False, False, False, True, True, False, False, True]
    cfg = gemv.choose_config(QType.Q4_K, 2048, 2048, 8)  # too few programs for 4 steps (3B shapes)
    assert (cfg.bn, cfg.splits) == (32, 4)
    cfg = gemv.choose_config(QType.Q4_0, 896, 896, 3)  # ... or for 64 rows
    assert (cfg.bn, cfg.splits) == (32, 7)
    cfg = gemv.choose_config(
        QType.Q8_0, 151936, 896, 1
    )  # the 0.5B head: 4748 row programs x 7 > cap
    assert cfg.splits == 1


def test_tuning_has_one_row_per_format():
    """gemv_tuning.TUNING: an integer-path row for every format with int8 words, a float row for the
    rest."""
    from minfer_jax.pallas import gemv_tuning

    assert set(gemv_tuning.TUNING) == set(FORMATS)
    for qtype, row in gemv_tuning.TUNING.items():
        assert isinstance(row, gemv_tuning.Int8Row) == (qtype in int8_words.SPECS), qtype.name
    # the tile rules per path: 3-D only pre-quantized and where the row says so, flat words the
    # other pre-quantized
    q4k, q3k = gemv_tuning.TUNING[QType.Q4_K], gemv_tuning.TUNING[QType.Q3_K]
    assert [q4k.tile_shapes(False), q4k.tile_shapes(True), q3k.tile_shapes(True)] == [
        (False, False),
        (True, False),
        (False, True),
    ]


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q5_1, QType.Q4_K, QType.Q6_K, QType.Q3_K])
@pytest.mark.parametrize("nt", [1, 3])
def test_gemv_x_quantized_in_kernel_or_before(qtype, nt):
    """Both activation paths (quantized per program, or by int8_words.quantize_x before the kernel)
    against the reference, each on the default config's tiles for this nt."""
    n, k = 130, 1024
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(5), (nt, k), jnp.float32)
    ref = gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n)
    base = gemv.choose_config(qtype, n, k, nt)
    for prequant in (False, True):
        cfg = dataclasses.replace(base, prequant=prequant)
        check(
            gemv.gemv_int8(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET), ref, qtype
        )


def _pallas_launches(fn, *args) -> list[str]:
    """The names of the Pallas kernels fn(*args) launches, in trace order (nested jits too)."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params.get("name_and_src_info", eqn.params.get("name"))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize(
    "qtypes,k",
    [
        ((QType.Q5_0, QType.Q5_0), 896),
        ((QType.Q5_0, QType.Q8_0), 896),  # the 0.5B's q+k and v: two formats, one launch
        ((QType.Q4_K, QType.Q6_K), 768),
        ((QType.Q6_K, QType.Q6_K), 1024),
        ((QType.Q4_K, QType.Q6_K), 2048),  # past FOLD_NORM_MAX_K: XLA's sums, the kernel's rsqrt
        ((QType.F16, QType.F16), 1024),
    ],
    ids=lambda v: "+".join(q.name for q in v) if isinstance(v, tuple) else str(v),
)
@pytest.mark.parametrize("nt,deterministic", [(1, False), (2, False), (3, True)])
def test_norm_folded_into_gemv(qtypes, k, nt, deterministic):
    """ops.norm_matmuls with the RMSNorm applied inside the GEMVs == the norm first, then the same
    GEMVs. Narrow x at one token ("fold"): each program sums the rows' squares in power-of-two
    pieces (896 = 512 + 256 + 128); wider x or more rows ("rsqrt"): XLA's sums of squares, the
    rsqrt in the kernel. The weights run as one launch even in two formats; float weights take
    the plain path. The deterministic mode folds at every row count and width."""
    from minfer_jax import ops
    from minfer_jax.quant.matrix import QWeight

    impl = ops.Impl(KERNELS, deterministic=deterministic)
    sizes = (130, 70)
    ws = [
        QWeight(random_planes(jax.random.PRNGKey(s), q, n, k), q, (n, k))
        for s, q, n in zip((6, 7), qtypes, sizes)
    ]
    x = (
        jax.random.normal(jax.random.PRNGKey(8), (nt, k), jnp.float32) * 30.0
    )  # a residual stream's scale
    g = 1.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(9), (k,), jnp.float32)
    modes = {ops.route(w, nt, impl, after_norm=True).fold_norm for w in ws}
    narrow = deterministic or (
        k <= gemv_tuning.FOLD_NORM_MAX_K and nt <= gemv_tuning.FOLD_NORM_MAX_NT
    )
    want = None if qtypes[0] == QType.F16 else "fold" if narrow else "rsqrt"
    assert modes == {want}
    launches = _pallas_launches(lambda x: ops.norm_matmuls(x, g, 1e-6, ws, impl), x)
    assert len(launches) == (2 if want is None else 1), launches
    folded = ops.norm_matmuls(x, g, 1e-6, ws, impl)
    plain = ops.norm_matmuls(x, g, 1e-6, ws, dataclasses.replace(impl, fused_decode=False))
    parts = ops.norm_matmul_parts(x, g, 1e-6, ws, impl)
    for a, b, p, n in zip(folded, plain, parts, sizes):
        chex.assert_shape(a, (nt, n))
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5 * scale)
        summed = tiles.sum_splits(p, 0, True)[:nt, :n]
        np.testing.assert_allclose(np.asarray(summed), np.asarray(a), rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize(
    "qtypes,k,nt", [((QType.Q5_0, QType.Q8_0), 896, 1), ((QType.Q4_K, QType.Q6_K), 2048, 3)]
)
def test_norm_from_given_sums_of_squares(qtypes, k, nt):
    """With the rows' sums of squares given in pieces (a residual add's, split_sums), every GEMV
    after the norm takes them ("rsqrt", narrow x too) and equals the norm first, then the GEMVs;
    no launch besides the GEMV's. 8 and 17 pieces: a count not a power of two is padded."""
    from minfer_jax import ops
    from minfer_jax.quant.matrix import QWeight

    impl = ops.Impl(KERNELS)
    ws = [
        QWeight(random_planes(jax.random.PRNGKey(s), q, n, k), q, (n, k))
        for s, q, n in zip((6, 7), qtypes, (130, 70))
    ]
    x = jax.random.normal(jax.random.PRNGKey(8), (nt, k), jnp.float32) * 30.0
    g = 1.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(9), (k,), jnp.float32)
    sumsq = jnp.pad(jnp.sum((x * x).reshape(nt, k // 128, 128), -1), ((0, 0), (0, 1)))
    assert {ops.route(w, nt, impl, after_norm=True, sumsq=True).fold_norm for w in ws} == {"rsqrt"}
    launches = _pallas_launches(lambda x, s: ops.norm_matmuls(x, g, 1e-6, ws, impl, s), x, sumsq)
    assert len(launches) == 1, launches
    got = ops.norm_matmuls(x, g, 1e-6, ws, impl, sumsq)
    plain = ops.norm_matmuls(x, g, 1e-6, ws, dataclasses.replace(impl, fused_decode=False))
    for a, b in zip(got, plain):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5 * scale)


def _outlier_rows(nt: int, k: int, seed: int) -> jax.Array:
    """Normal rows with one large feature, as a residual stream has: its group's scale leaves the
    group's other inputs few int8 steps."""
    x = jax.random.normal(jax.random.PRNGKey(seed), (nt, k), jnp.float32)
    return x.at[:, 5].set(60.0)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K, QType.Q6_K, QType.Q8_0])
def test_two_term_x_matches_its_reference_and_comes_closer_to_the_exact_product(qtype):
    """GemvConfig.x_terms = 2 (x's rounding residual quantized as a second int8 term) equals its
    reference, and lands far closer to the f32 product of the dequantized weights than one term."""
    n, k, nt = 130, 1024, 2
    w = planes_for(qtype, n, k)
    x = _outlier_rows(nt, k, 3)
    cfg = dataclasses.replace(gemv.choose_config(qtype, n, k, nt), x_terms=2)
    assert not cfg.prequant
    got = gemv.gemv_int8(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET)
    two = gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n, x_terms=2)
    check(got, two, qtype)
    one = gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n)
    exact = jnp.dot(x, decode(qtype, w, jnp.float32)[:n].T, precision=jax.lax.Precision.HIGHEST)
    err_one, err_two = (float(jnp.max(jnp.abs(y - exact))) for y in (one, two))
    assert err_two < err_one / 20, (err_one, err_two)
    assert float(jnp.max(jnp.abs(got - exact))) < err_one / 20


def test_precise_reaches_the_normed_gemvs():
    """ops.Impl.precise gives x two int8 terms in every GEMV that applies the norm itself
    (ops.norm_matmuls), which brings them near the norm-then-f32 product."""
    from minfer_jax import ops
    from minfer_jax.quant.matrix import QWeight

    k, nt = 896, 1
    qtypes = (QType.Q5_0, QType.Q8_0)
    ws = [
        QWeight(random_planes(jax.random.PRNGKey(s), q, n, k), q, (n, k))
        for s, q, n in zip((6, 7), qtypes, (130, 70))
    ]
    x = _outlier_rows(nt, k, 4)
    g = 1.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(9), (k,), jnp.float32)
    h = ops.rms_norm(x, g, 1e-6)
    exact = [
        jnp.dot(h, decode(q, w.planes, jnp.float32)[: w.shape[0]].T, precision="highest")
        for q, w in zip(qtypes, ws)
    ]
    errors = {}
    for precise, terms in ((False, 1), (True, 2)):
        got = ops.norm_matmuls(x, g, 1e-6, ws, ops.Impl(KERNELS, precise=precise))
        for y, w, q in zip(got, ws, qtypes):
            ref = gemv.gemv_int8_reference(
                x, w.planes, qtype=q, n_out=w.shape[0], x_scale=g, norm_eps=1e-6, x_terms=terms
            )
            check(y, ref, q)
        errors[terms] = max(float(jnp.max(jnp.abs(y - e))) for y, e in zip(got, exact))
    assert errors[2] < errors[1] / 20, errors


def test_precise_configs_quantize_x_in_the_kernel_at_every_token_count(monkeypatch):
    """choose_config(precise=True): x in PRECISE_X_TERMS terms, never pre-quantized (quantize_x
    makes one term), and otherwise the blocks the default takes where x is quantized in the
    kernel."""
    cases = ((QType.Q4_K, 18944, 3584, 8), (QType.Q4_0, 4096, 14336, 3))
    precise = [gemv.choose_config(*case, precise=True) for case in cases]
    assert all(gemv.choose_config(*case).prequant for case in cases)
    monkeypatch.setattr(gemv_tuning, "PREQUANT_MIN_WEIGHTS", 1 << 40)  # in-kernel x everywhere
    for case, cfg in zip(cases, precise):
        assert gemv_tuning.PRECISE_X_TERMS == 2
        assert cfg == dataclasses.replace(gemv.choose_config(*case), x_terms=2)
    alone = gemv.choose_config(QType.Q4_K, 896, 896, 8, deterministic=True, precise=True)
    assert alone.x_terms == 2 and not alone.prequant
    assert gemv.choose_config(QType.F16, 896, 896, 1, precise=True).x_terms == 1  # not quantized


def test_gemv_group_matches_each_weight_alone():
    """gemv_int8_group: one launch through weights of three formats == gemv_int8 on each, and
    configs that do not share a K split are refused."""
    k, nt = 512, 2
    qtypes, sizes = (QType.Q4_K, QType.Q6_K, QType.Q8_0), (200, 64, 130)
    ws = [planes_for(q, n, k) for q, n in zip(qtypes, sizes)]
    x = jax.random.normal(jax.random.PRNGKey(1), (nt, k), jnp.float32)
    got = gemv.gemv_int8_group(x, tuple(ws), qtypes=qtypes, n_outs=sizes, interpret=INTERPRET)
    for y, w, q, n in zip(got, ws, qtypes, sizes):
        check(y, gemv.gemv_int8_reference(x, w, qtype=q, n_out=n), q)
    cfgs = [gemv.choose_config(q, n, k, nt) for q, n in zip(qtypes, sizes)]
    cfgs[1] = dataclasses.replace(cfgs[1], splits=cfgs[0].splits * 2, bk=cfgs[1].bk // 2)
    assert not gemv.groupable(cfgs)
    with pytest.raises(ValueError, match="one K split"):
        gemv.gemv_int8_group(
            x, tuple(ws), qtypes=qtypes, n_outs=sizes, configs=tuple(cfgs), interpret=INTERPRET
        )


def test_gemv_split_major_grid_gives_the_same_sums():
    """GemvConfig.split_major (grid (splits, row blocks)) only reorders the programs: the same
    bits as the row-major grid, for one weight and for a grouped launch."""
    k, nt = 1024, 1
    qtypes, sizes = (QType.Q4_K, QType.Q6_K), (200, 64)
    ws = [planes_for(q, n, k) for q, n in zip(qtypes, sizes)]
    x = jax.random.normal(jax.random.PRNGKey(2), (nt, k), jnp.float32)
    cfgs = tuple(
        dataclasses.replace(gemv.choose_config(q, n, k, nt), bk=256, splits=4)
        for q, n in zip(qtypes, sizes)
    )
    major = tuple(dataclasses.replace(c, split_major=True) for c in cfgs)
    assert not gemv.groupable((cfgs[0], major[1]))
    for c in (cfgs, major):
        got = gemv.gemv_int8_group(
            x, tuple(ws), qtypes=qtypes, n_outs=sizes, configs=c, interpret=INTERPRET
        )
        alone = gemv.gemv_int8(
            x, ws[0], qtype=qtypes[0], n_out=sizes[0], config=c[0], interpret=INTERPRET
        )
        if c is cfgs:
            want, want_alone = got, alone
        for y, y0 in zip(got, want):
            assert jnp.array_equal(y, y0)
        assert jnp.array_equal(alone, want_alone)
    check(
        want_alone, gemv.gemv_int8_reference(x, ws[0], qtype=qtypes[0], n_out=sizes[0]), qtypes[0]
    )


def test_gemv_split_major_grid_with_x_quantized_before(monkeypatch):
    """The split-major grid on the pre-quantized-x path (batched decode's down projections):
    the same bits as the row-major grid."""
    monkeypatch.setattr(gemv_tuning, "PREQUANT_MIN_WEIGHTS", 0)
    n, k, nt = 256, 2048, 4
    w = planes_for(QType.Q4_K, n, k)
    x = jax.random.normal(jax.random.PRNGKey(3), (nt, k), jnp.float32)
    cfg = dataclasses.replace(gemv.choose_config(QType.Q4_K, n, k, nt), bk=256, splits=8)
    assert cfg.prequant
    rows = gemv.gemv_int8(x, w, qtype=QType.Q4_K, n_out=n, config=cfg, interpret=INTERPRET)
    major = dataclasses.replace(cfg, split_major=True)
    got = gemv.gemv_int8(x, w, qtype=QType.Q4_K, n_out=n, config=major, interpret=INTERPRET)
    assert jnp.array_equal(got, rows)
    check(got, gemv.gemv_int8_reference(x, w, qtype=QType.Q4_K, n_out=n), QType.Q4_K)


def test_gemv_split_major_and_loop_k_rules(monkeypatch):
    """gemv_tuning.SPLIT_MAJOR_FROM_SPLITS (16) orders the programs of GEMVs with that many K
    splits split-major (0: none); LOOP_K_FROM_ROW_BLOCKS (0: off) gives weights with that many
    row blocks one program per row block over all of K (x quantized in the kernel only)."""
    down, gate = (QType.Q4_K, 3584, 18944, 1), (QType.Q4_K, 18944, 3584, 1)
    assert gemv.choose_config(*down).split_major  # 37 splits
    assert not gemv.choose_config(QType.Q4_K, 3584, 3584, 1).split_major  # 7
    assert gemv.choose_config(*gate).splits == 7
    monkeypatch.setattr(gemv_tuning, "SPLIT_MAJOR_FROM_SPLITS", 0)
    monkeypatch.setattr(gemv_tuning, "LOOP_K_FROM_ROW_BLOCKS", 512)
    assert not gemv.choose_config(*down).split_major
    assert gemv.choose_config(*gate).splits == 1  # 592 row blocks of 32
    assert gemv.choose_config(QType.Q4_K, 4608, 3584, 1).splits == 7  # 144
    big_8 = gemv.choose_config(QType.Q4_K, 18944, 3584, 8)  # x quantized before: its own steps
    assert big_8.prequant and big_8.splits > 1


def test_gemv_rejects_too_many_tokens():
    w = planes_for(QType.Q8_0, 200, 896)
    with pytest.raises(ValueError, match="1 .. 16 tokens"):
        gemv.gemv_int8(jnp.ones((17, 896)), w, qtype=QType.Q8_0, n_out=200, interpret=INTERPRET)


def test_kernel_is_traced_once_per_configuration():
    """A repeated call with the same shapes must not retrace (one executable per bucket)."""
    qtype, n, k = QType.Q4_K, 128, 512
    w = planes_for(qtype, n, k)
    traced = chex.assert_max_traces(n=1)(
        lambda x, w: gemv.gemv_int8(x, w, qtype=qtype, n_out=n, interpret=INTERPRET)
    )
    f = jax.jit(traced)
    for seed in range(3):
        f(jax.random.normal(jax.random.PRNGKey(seed), (1, k)), w).block_until_ready()


def test_reference_uses_compute_dtype():
    """The f16 reference rounds weights and x to f16 like the f16 kernels: equal to an explicit f16
    computation."""
    qtype, n, k = QType.Q8_0, 128, 256
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, k))
    w16 = decode(qtype, w, jnp.float16)[:n].astype(jnp.float32)
    want = np.asarray(x.astype(jnp.float16).astype(jnp.float32) @ w16.T)
    np.testing.assert_allclose(
        np.asarray(gemm.gemm_reference(x, w, qtype=qtype, n_out=n)), want, rtol=1e-5, atol=1e-5
    )


def test_dp4a_emulation_is_signed_bytewise_dot():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, 4096, dtype=np.uint32)
    b = rng.integers(-(2**31), 2**31, 4096, dtype=np.int64).astype(np.int32)
    b[:4] = (
        np.array([0x80808080, 0x7F7F7F7F, 0xFFFFFFFF, 0], np.int64).astype(np.uint32).view(np.int32)
    )  # byte extremes
    c = rng.integers(-(2**20), 2**20, 4096).astype(np.int32)
    want = c.astype(np.int64) + np.sum(
        a.view(np.int8).reshape(-1, 4).astype(np.int64)
        * b.view(np.int8).reshape(-1, 4).astype(np.int64),
        axis=1,
    )
    got = int8_words.dp4a_emulated(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(
    "qtype", sorted(int8_words.SPECS, key=lambda q: q.value), ids=lambda q: q.name
)
def test_int8_reference_within_quantization_error(qtype):
    """The integer formulation (a * (dx * S + offset) + b * sum x per group) is x . decode(planes)
    up to the int8 rounding of x: exactly so for x already on the int8 grid."""
    w = planes_for(qtype, 136, 4864)
    spec = int8_words.SPECS[qtype]
    # x already on an int8 grid of its groups: max |x| = 127 * step in every group
    steps = jax.random.uniform(
        jax.random.PRNGKey(4), (2, 4864 // spec.group, 1), minval=0.01, maxval=1.0
    )
    ints = jax.random.randint(jax.random.PRNGKey(5), (2, 4864 // spec.group, spec.group), -127, 128)
    ints = ints.at[..., 0].set(127)
    x_grid = (ints.astype(jnp.float32) * steps).reshape(2, 4864)
    want = x_grid @ decode(qtype, w, jnp.float32)[:136].T
    got = gemv.gemv_int8_reference(x_grid, w, qtype=qtype, n_out=136)
    chex.assert_trees_all_close(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.parametrize("path", ["fma", "dot"])
@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16], ids=lambda q: q.name)
def test_both_float_one_token_paths(qtype, path):
    """Float formats: the CUDA-core path the default picks for one token, and the dot path."""
    n, k = shapes_for(qtype)[0]
    w = planes_for(qtype, n, k)
    cfg = dataclasses.replace(gemv.choose_config(qtype, n, k), fma=path == "fma")
    x = jax.random.normal(jax.random.PRNGKey(6), (1, k))
    check(
        gemv.gemv_float(x, w, qtype=qtype, n_out=n, config=cfg, interpret=INTERPRET),
        gemv.gemv_float_reference(x, w, qtype=qtype, n_out=n),
        qtype,
    )


BLOCK_FORMATS = [q for q in FORMATS if q not in (QType.F32, QType.F16, QType.BF16)]
INT8_CASES = [
    (q, n, k, nt)
    for q in BLOCK_FORMATS
    for n, k in shapes_for(q)
    for nt in (9, 100)
    if q not in CODEBOOKS or nt == 100
]


@pytest.mark.parametrize("qtype,n,k,nt", INT8_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_gemm_int8_matches_reference(qtype, n, k, nt):
    """int8 GEMM == its reference (same activation quantization, exact integer sums) and stays
    within the activation-quantization error (~1/127 per value) of the f16 path."""
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt + 7), (nt, k), jnp.float32)
    got = gemm_int8.gemm_int8(x, w, qtype=qtype, n_out=n, interpret=INTERPRET)
    check(got, gemm_int8.gemm_int8_reference(x, w, qtype=qtype, n_out=n), qtype)
    f16 = gemm.gemm_reference(x, w, qtype=qtype, n_out=n)
    chex.assert_trees_all_close(got, f16, atol=2e-2 * float(jnp.max(jnp.abs(f16))), rtol=0)


def test_ops_routes_prefill_to_int8_only_when_asked():
    from minfer_jax import ops
    from minfer_jax.quant.matrix import QWeight

    qtype, n, k = QType.Q4_K, 136, 512
    w = QWeight(planes_for(qtype, n, k), qtype, (n, k))
    x = jax.random.normal(jax.random.PRNGKey(0), (12, k))
    y16 = ops.matmul(x, w, ops.Impl(kernels=KERNELS))
    y8 = ops.matmul(x, w, ops.Impl(kernels=KERNELS, gemm="int8"))
    np.testing.assert_allclose(
        np.asarray(y16),
        np.asarray(gemm.gemm_reference(x, w.planes, qtype=qtype, n_out=n)),
        rtol=1e-3,
        atol=1e-3 * float(jnp.max(jnp.abs(y16))),
    )
    np.testing.assert_allclose(
        np.asarray(y8),
        np.asarray(gemm_int8.gemm_int8_reference(x, w.planes, qtype=qtype, n_out=n)),
        rtol=1e-3,
        atol=1e-3 * float(jnp.max(jnp.abs(y8))),
    )
    with pytest.raises(ValueError, match="gemm"):
        ops.Impl(gemm="int4")


@pytest.mark.parametrize("qtype,n,k", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_dequantize_matches_decode(qtype, n, k):
    """The dequantization kernel writes exactly quant.planes.decode
    (same tile decode, no arithmetic of its own)."""
    w = planes_for(qtype, n, k)
    ref = dequant.dequantize_reference(w, qtype=qtype)
    for cfg in (None, dequant.DequantConfig(bn=16, bk=128 if k % 256 else 256)):
        got = dequant.dequantize(w, qtype=qtype, config=cfg, interpret=INTERPRET)
        chex.assert_trees_all_equal(got, ref)


def test_ops_prefill_variants():
    """auto picks dequant from DEQUANT_MIN_NT tokens; dequant and f16 compute the same decode + f32
    dot."""
    from minfer_jax import ops
    from minfer_jax.quant.matrix import QWeight

    assert ops.gemm_variant("auto", QType.Q4_K, ops.DEQUANT_MIN_NT) == "dequant"
    assert ops.gemm_variant("auto", QType.Q4_K, ops.DEQUANT_MIN_NT - 1) == "f16"
    assert (
        ops.gemm_variant("dequant", QType.F16, 512) == "f16"
    )  # float weights: nothing to dequantize
    assert ops.kernel_case(QType.Q6_K, 136, 512, ops.Impl("pallas"))[0].kind == "dq+gemm"
    assert (
        ops.kernel_case(QType.Q6_K, 136, 16, ops.Impl("pallas", gemm="int8"))[0].kind == "gemm-i8"
    )
    qtype, n, k = QType.Q6_K, 136, 512
    w = QWeight(planes_for(qtype, n, k), qtype, (n, k))
    x = jax.random.normal(jax.random.PRNGKey(0), (20, k))
    ref = gemm.gemm_reference(x, w.planes, qtype=qtype, n_out=n)
    for variant in ("dequant", "f16"):
        check(ops.matmul(x, w, ops.Impl(kernels=KERNELS, gemm=variant)), ref, qtype)


def test_bench_gemm_choices_are_ops_variants():
    from minfer_jax import ops

    from minfer_bench.bench import cli

    (gemm,) = [a for a in cli.build_parser()._actions if "--gemm" in a.option_strings]
    assert tuple(gemm.choices) == ops.GEMM_VARIANTS


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("nt", [1, 2, 3])
def test_gemv_x_first_either_order(qtype, nt):
    """x loaded before or after the weight tiles (gemv_tuning.TUNING picks per format): same sums,
    with a folded per-input scale too, on the in-kernel and the pre-quantized path."""
    n, k = 136, 2560
    w = planes_for(qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, k))
    scale = 1.0 + jax.random.uniform(jax.random.PRNGKey(7), (k,))
    ref = gemv.gemv_int8_reference(x, w, qtype=qtype, n_out=n, x_scale=scale)
    cfg = gemv.choose_config(qtype, n, k, nt)
    for x_first in (False, True):
        got = gemv.gemv_int8(
            x,
            w,
            qtype=qtype,
            n_out=n,
            x_scale=scale,
            interpret=INTERPRET,
            config=dataclasses.replace(cfg, x_first=x_first),
        )
        check(got, ref, qtype)


# ---------------------------------------------------------------------------------------- ops.route


def _qweight(qtype, n=128, k=256):
    from minfer_jax.quant.matrix import QWeight

    return QWeight(planes_for(qtype, n, k), qtype, (n, k))


@pytest.mark.parametrize(
    "qtype,nt,impl,want",
    [
        (QType.Q4_K, 1, dict(kernels="xla"), "xla"),
        (
            QType.Q4_K,
            512,
            dict(kernels="xla", gemm="int8"),
            "xla",
        ),  # the XLA path ignores the GEMM variant
        (QType.Q4_0, 1, {}, "gemv"),
        (QType.Q6_K, 8, {}, "gemv"),  # the last GEMV token count
        (QType.F16, 1, {}, "gemv-float"),
        (QType.BF16, 8, {}, "gemv-float"),
        (
            QType.Q4_K,
            9,
            {},
            "gemm",
        ),  # "auto": a decode batch past the GEMV, the split in-kernel GEMM
        (QType.Q4_K, 64, {}, "gemm"),  # ... up to DEQUANT_MIN_NT - 1 tokens
        (QType.Q4_K, 65, {}, "dq+gemm"),  # ... then dequantize first
        (
            QType.Q4_K,
            5,
            dict(gemv_max_nt=4),
            "gemm",
        ),  # past a lowered GEMV limit: "auto" below DEQUANT_MIN_NT
        (QType.Q4_K, 12, dict(gemv_max_nt=16), "gemv"),  # ... or a raised one: still the GEMV
        (QType.Q4_K, 16, dict(gemm="f16"), "gemm"),
        (QType.Q4_K, 16, dict(gemm="dequant"), "dq+gemm"),
        (QType.Q4_K, 16, dict(gemm="int8"), "gemm-i8"),
        (QType.F16, 512, dict(gemm="dequant"), "gemm"),  # float weights: nothing to dequantize
        (QType.F32, 16, dict(gemm="int8"), "gemm"),  # ... nor integers to multiply
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_route_every_branch(qtype, nt, impl, want):
    from minfer_jax import ops

    impl = ops.Impl(**{"kernels": "pallas", **impl})
    r = ops.route(_qweight(qtype), nt, impl)
    assert (r.kind, r.fold_norm, r.label) == (want, None, want)
    assert r.kind in ops.ROUTE_KINDS
    assert ops.kernel_case(qtype, 128, nt, impl)[0] == r  # the benchmark's route is the model's


def test_route_dense_and_norm_folding():
    from minfer_jax import ops
    from minfer_jax.quant.matrix import DenseWeight

    dense = DenseWeight(jnp.zeros((256, 128)), transposed=True)
    assert ops.route(dense, 1, ops.Impl("pallas"), after_norm=True) == ops.Route("dense")
    fold = ops.Impl("pallas")
    r = ops.route(_qweight(QType.Q5_0), 1, fold, after_norm=True)
    assert (r.kind, r.fold_norm, r.label) == ("gemv", "fold", "gemv+fold")
    assert not ops.route(_qweight(QType.Q5_0), 1, fold).fold_norm  # x not a norm's output
    few = gemv_tuning.FOLD_NORM_MAX_NT + 1  # more rows: XLA's sums of squares, the kernel's rsqrt
    r = ops.route(_qweight(QType.Q5_0), few, fold, after_norm=True)
    assert (r.fold_norm, r.label) == ("rsqrt", "gemv+rsqrt")
    assert not ops.route(
        _qweight(QType.Q5_0), 3, ops.Impl("pallas", fused_decode=False), after_norm=True
    ).fold_norm  # fused_decode off
    wide = gemv_tuning.FOLD_NORM_MAX_K * 2
    assert ops.route(_qweight(QType.Q5_0, 128, wide), 1, fold, after_norm=True).fold_norm == "rsqrt"
    big = gemv_tuning.PREQUANT_MIN_WEIGHTS // 896 + 128  # x quantized by XLA: it fuses the norm
    assert ops.route(_qweight(QType.Q5_0, big, 896), 3, fold, after_norm=True).fold_norm is None
    r = ops.route(_qweight(QType.Q5_0), 1, fold, after_norm=True, sumsq=True)
    assert r.fold_norm == "rsqrt"  # the sums of squares given: narrow x takes them too
    for nt in (1, 2, 8, 32):  # the deterministic mode: one-token numerics at every row count
        det = ops.Impl("pallas", deterministic=True)
        for w in (_qweight(QType.Q5_0), _qweight(QType.Q5_0, 128, wide)):  # no XLA reduce
            assert ops.route(w, nt, det, after_norm=True).fold_norm == "fold"
            assert ops.route(w, nt, det, after_norm=True, sumsq=True).fold_norm == "rsqrt"
    assert ops.route(_qweight(QType.F16), 1, fold, after_norm=True) == ops.Route(
        "gemv-float"
    )  # float: never
    assert ops.route(_qweight(QType.Q5_0), 9, fold, after_norm=True) == ops.Route(
        "gemm"
    )  # past the GEMV: never
    assert ops.route(_qweight(QType.Q5_0), 1, ops.Impl("xla"), after_norm=True) == ops.Route("xla")
    with pytest.raises(ValueError, match="dense"):
        ops.route_call(ops.Route("dense"), QType.F32, 128, fold)


@pytest.mark.parametrize(
    "qtype,nt,gemm_variant,want",
    [
        (QType.Q4_0, 2, "auto", "gemv"),
        (QType.F16, 1, "auto", "gemv-float"),
        (QType.Q4_K, 9, "auto", "gemm"),
        (QType.Q4_K, 9, "dequant", "dq+gemm"),
        (QType.Q6_K, 9, "int8", "gemm-i8"),
        (QType.Q8_0, 3, "xla", "xla"),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_kernel_case_call_matches_its_reference(qtype, nt, gemm_variant, want):
    """Every quantized route's kernel call against the reference kernel_case pairs it with, and
    ops.matmul on the same weight computes exactly the route's call."""
    from minfer_jax import ops

    kernels = "xla" if gemm_variant == "xla" else KERNELS
    impl = ops.Impl(kernels, gemm="auto" if gemm_variant == "xla" else gemm_variant)
    w = _qweight(qtype)
    r, call, reference = ops.kernel_case(qtype, 128, nt, impl)
    assert r.kind == want
    x = jax.random.normal(jax.random.PRNGKey(nt), (nt, 256), jnp.float32)
    got = call(x, w.planes)
    check(got, reference(x, w.planes), qtype)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, w, impl)), np.asarray(got))


def test_gemv_partials_add_up_to_its_output():
    """gemv_int8(partials=True) (what the fused decode epilogue reads) adds up to its output."""
    qtype, n, k = QType.Q5_0, 896, 896
    planes = random_planes(jax.random.PRNGKey(0), qtype, n, k)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, k))
    parts = gemv.gemv_int8(x, planes, qtype=qtype, n_out=n, partials=True, interpret=INTERPRET)
    assert parts.shape[0] > 1  # split K
    whole = gemv.gemv_int8(x, planes, qtype=qtype, n_out=n, interpret=INTERPRET)
    chex.assert_trees_all_close(parts.sum(axis=0)[:1, :n], whole, atol=1e-4, rtol=1e-5)
