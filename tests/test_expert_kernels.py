"""The expert kernels (pallas/expert_gemv.py, expert_gemm.py) against their jnp references,
interpreted on the CPU or compiled on a GPU (tests/kernel_mode.py: MINFER_TEST_KERNELS=compiled),
as tests/test_kernels.py does for the dense ones.

Stacked expert weights are built as the loader builds them: each expert's planes, np.stack-ed
along a leading expert axis. Small shapes (4 experts, 64 x 512) keep the interpreter fast; one
case walks K in a loop (1024 inputs). The formats: Q4_K, Q8_0, Q6_K, F16 and whichever of
MXFP4 / IQ4_NL / IQ4_XS quant.planes knows (they plug in through their format record).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_mode import INTERPRET, KERNELS
from minfer_jax import ops
from minfer_jax.pallas import expert_gemm, expert_gemv, expert_tuning
from minfer_jax.quant.matrix import QWeight
from minfer_jax.quant.planes import FORMATS, QType
from test_attention import lower_for_gpu

from minfer_bench.bench.kernel_timing import random_planes

NEW_FORMATS = [q for q in FORMATS if q.name in ("MXFP4", "IQ4_NL", "IQ4_XS")]
EXPERT_FORMATS = [QType.Q4_K, QType.Q8_0, QType.Q6_K, QType.F16, *NEW_FORMATS]
E, N, K = 4, 64, 512


@functools.cache
def stacked_planes(qtype, n, k, seed=0):
    """E experts' planes [E, Npad, cols], each expert its own random weight."""
    per = [random_planes(jax.random.PRNGKey(seed * 100 + e), qtype, n, k) for e in range(E)]
    return {name: jnp.asarray(np.stack([np.asarray(p[name]) for p in per])) for name in per[0]}


def route(t, k, seed=0):
    """ids [t, k] (distinct experts per token, as top-k gives) and routing weights [t, k]."""
    keys = jax.random.split(jax.random.PRNGKey(seed), t)
    ids = jnp.stack([jax.random.permutation(kk, E)[:k] for kk in keys]).astype(jnp.int32)
    return ids, jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(seed + 1), (t, k)), axis=-1)


def check(got, ref):
    chex.assert_equal_shape([got, ref])
    chex.assert_tree_all_finite(got)
    scale = float(jnp.max(jnp.abs(ref)))
    chex.assert_trees_all_close(got, ref, atol=1e-3 * scale, rtol=0)  # summation order only


# the other formats run the same bodies in the fused launches' tests below
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.F16], ids=lambda q: q.name)
def test_expert_gemv_matches_reference(qtype):
    """Three tokens x two slots, each slot its own input row (as the down projection's)."""
    t, per_slot = 3, True
    w = stacked_planes(qtype, N, K)
    ids, _ = route(t, 2, seed=t)
    shape = (t, 2, K) if per_slot else (t, K)
    x = jax.random.normal(jax.random.PRNGKey(t), shape, jnp.float32)
    got = expert_gemv.expert_gemv(x, w, ids, qtype=qtype, n_out=N, interpret=INTERPRET)
    ref = expert_gemv.expert_gemv_reference(x, w, ids, qtype=qtype, n_out=N)
    check(got, ref)
    # each pair is its own expert's product: the dense product of the expert it names
    e = int(ids[0, 1])
    dense = expert_gemv.expert_rows_reference(
        x[0, 1] if per_slot else x[0], {n: p[e] for n, p in w.items()}, qtype=qtype, n_out=N
    )
    check(got[0, 1], dense)


def test_expert_gemv_k_loop_and_explicit_rows():
    """K walked in two steps (1024 inputs of Q4_K), 32 rows per program, one x row per token
    shared by its slots."""
    qtype = QType.Q4_K
    w = stacked_planes(qtype, N, 1024, seed=1)
    ids, _ = route(2, 3, seed=5)
    x = jax.random.normal(jax.random.PRNGKey(9), (2, 1024), jnp.float32)
    ref = expert_gemv.expert_gemv_reference(x, w, ids, qtype=qtype, n_out=N)
    for cfg in (expert_gemv.ExpertConfig(bn=32),):
        got = expert_gemv.expert_gemv(
            x, w, ids, qtype=qtype, n_out=N, config=cfg, interpret=INTERPRET
        )
        check(got, ref)


@pytest.mark.parametrize(
    "gate_q,up_q,act,biases",
    [
        (QType.Q4_K, QType.Q4_K, "silu", False),
        (QType.Q8_0, QType.Q6_K, "silu", False),  # formats of their own: two bodies, one program
        (QType.F16, QType.F16, "swiglu_oai", True),  # gpt-oss: clamped, per-expert biases
        *[(q, q, "swiglu_oai", True) for q in NEW_FORMATS if q.name == "MXFP4"],  # gpt-oss
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_expert_glu_matches_reference(gate_q, up_q, act, biases):
    wg, wu = stacked_planes(gate_q, N, K, seed=2), stacked_planes(up_q, N, K, seed=3)
    t = 2
    ids, _ = route(t, 2, seed=3)
    x = jax.random.normal(jax.random.PRNGKey(4), (t, K), jnp.float32)
    # products of O(1) so that the activations' clamps and curves are exercised, not saturated
    g0 = expert_gemv.expert_gemv_reference(x, wg, ids, qtype=gate_q, n_out=N)
    x = x * (4.0 / float(jnp.max(jnp.abs(g0))))
    kw = dict(gate_qtype=gate_q, up_qtype=up_q, n_out=N, act=act)
    if biases:
        kw["gate_bias"] = jax.random.normal(jax.random.PRNGKey(5), (E, N))
        kw["up_bias"] = jax.random.normal(jax.random.PRNGKey(6), (E, N))
    got = expert_gemv.expert_glu(x, wg, wu, ids, interpret=INTERPRET, **kw)
    ref = expert_gemv.expert_glu_reference(x, wg, wu, ids, **kw)
    check(got, ref)
    assert float(jnp.std(ref)) > 0.1  # not a saturated or vanishing activation


def test_glu_activations():
    """SwiGLU and gpt-oss's clamped form at points that pin their formulas."""
    from minfer_jax.pallas.expert_kernels import silu_glu, swiglu_oai

    g = jnp.array([0.0, 1.0, 10.0, -3.0])
    u = jnp.array([2.0, 2.0, 9.0, -9.0])
    chex.assert_trees_all_close(silu_glu(g, u), g * jax.nn.sigmoid(g) * u, rtol=1e-6)
    want = jnp.array(
        [
            0.0,
            1.0 * jax.nn.sigmoid(1.702) * 3.0,
            7.0 * jax.nn.sigmoid(1.702 * 7.0) * 8.0,  # gate capped at 7, up at 7
            -3.0 * jax.nn.sigmoid(-1.702 * 3.0) * -6.0,  # up clamped at -7
        ]
    )
    chex.assert_trees_all_close(swiglu_oai(g, u), want, rtol=1e-6)


def _named(*names):
    return [q for q in EXPERT_FORMATS if q.name in names]


# the down launch's variants are one kernel (expert_gemv._down_kernel, its slots per program a
# parameter) on the format's body: every format once, each variant on every family (int8 words:
# K-quant super-blocks or 32-weight blocks; a codebook; float), F16 with gpt-oss's down bias
DOWN_CASES = [
    *[(q, "fused") for q in _named("Q4_K", "MXFP4", "F16")],
    *[(q, "split") for q in _named("Q6_K", "IQ4_NL", "F16")],
    *[(q, "pairs") for q in _named("Q8_0", "IQ4_XS", "F16")],
]


@pytest.mark.parametrize("qtype,variant", DOWN_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_expert_down_sum_matches_reference(qtype, variant):
    """k = 4 slots: "fused" one program per token and row block, "split" two (their partials
    added by XLA), "pairs" four."""
    bias = qtype in (QType.F16, *NEW_FORMATS)  # gpt-oss's down bias
    w = stacked_planes(qtype, N, K, seed=4)
    t, k = 2, 4
    ids, weights = route(t, k, seed=7)
    h = jax.random.normal(jax.random.PRNGKey(8), (t, k, K), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(9), (E, N)) if bias else None
    kw = dict(qtype=qtype, n_out=N, bias=b)
    got = expert_gemv.expert_down_sum(
        h, w, ids, weights, variant=variant, interpret=INTERPRET, **kw
    )
    check(got, expert_gemv.expert_down_sum_reference(h, w, ids, weights, **kw))


@pytest.mark.parametrize("qtype", _named("Q4_K", "MXFP4"), ids=lambda q: q.name)
def test_new_variants_lower_to_triton(qtype):
    """The down launch's "split" / "pairs" and the "dequant" / "pallas" grouped GEMMs through the
    Pallas Triton lowering rules (which interpret mode skips) at Qwen3-30B-A3B's shapes."""
    e, d, ff, k = 128, 2048, 768, 8
    one = jax.eval_shape(lambda: random_planes(jax.random.PRNGKey(0), qtype, d, ff))
    w = {m: jax.ShapeDtypeStruct((e, *a.shape), a.dtype) for m, a in one.items()}
    f32, i32 = jnp.float32, jnp.int32
    ids, rw = jax.ShapeDtypeStruct((1, k), i32), jax.ShapeDtypeStruct((1, k), f32)
    for variant in ("split", "pairs"):
        text = lower_for_gpu(
            lambda h, w, ids, rw, v=variant: expert_gemv.expert_down_sum(
                h, w, ids, rw, qtype=qtype, n_out=d, variant=v
            ),
            jax.ShapeDtypeStruct((1, k, ff), f32), w, ids, rw,
        )  # fmt: skip
        assert f"expert_down_sum_{qtype.name.lower()}_{variant}" in text
    ids = jax.ShapeDtypeStruct((64, k), i32)
    for variant in ("pallas", "dequant"):
        text = lower_for_gpu(
            lambda x, w, ids, v=variant: expert_gemm.expert_matmul_sorted(
                x, w, ids, qtype=qtype, n_out=d, variant=v
            ),
            jax.ShapeDtypeStruct((64, ff), f32), w, ids,
        )  # fmt: skip
        assert "expert_gemm_" in text


def test_down_slots():
    assert [expert_gemv.down_slots(v, 8) for v in expert_gemv.DOWN_VARIANTS] == [8, 2, 1]
    assert expert_gemv.down_slots("split", 3) == 1  # SPLIT_SLOTS must divide k
    with pytest.raises(ValueError, match="not one of"):
        expert_gemv.down_slots("fast", 8)


# every format the experts use on "ragged" and "pallas"; "dequant" runs pallas/dequant.py's
# decode (tests/test_kernels.py, per format) then the float blocks of "pallas" (F16's case): the
# bf16 one (MXFP4)
@pytest.mark.parametrize(
    "qtype,variant",
    [(q, v) for q in EXPERT_FORMATS for v in ("pallas", "ragged")]
    + [(q, "dequant") for q in NEW_FORMATS if q.name == "MXFP4"],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_expert_matmul_sorted_matches_reference(qtype, variant):
    """Prefill: 12 tokens x 2 slots sorted by expert, one expert never chosen (its blocks empty,
    the blocked variants' trailing blocks skipped), each grouped-GEMM variant."""
    w = stacked_planes(qtype, N, K, seed=5)
    ids = jax.random.randint(jax.random.PRNGKey(11), (12, 2), 0, E - 1)
    x = jax.random.normal(jax.random.PRNGKey(12), (12, K), jnp.float32)
    got = expert_gemm.expert_matmul_sorted(
        x, w, ids, qtype=qtype, n_out=N, variant=variant, interpret=INTERPRET
    )
    check(got, expert_gemm.expert_matmul_sorted_reference(x, w, ids, qtype=qtype, n_out=N))


def test_block_layout():
    """Each expert's rows start a block of their own; blocks past the used ones are -1."""
    sizes = jnp.array([3, 0, 17, 1], jnp.int32)
    layout = jax.jit(expert_gemm.block_layout, static_argnums=(1, 2))
    dest, tile_expert, n_blocks = layout(sizes, 21, 16)
    assert n_blocks == 2 + 4  # ceil(21 / 16) + one partial block per expert at most
    assert list(np.asarray(dest)) == [0, 1, 2, *range(16, 33), 48]
    assert list(np.asarray(tile_expert)) == [0, 2, 2, 3, -1, -1]


# the grouped GEMV's route with another table than the default (ops reads
# expert_tuning.EXPERT_PATHS at trace time: the down launch's "split" variant; the default's
# fused launch runs in tests/test_moe_engine.py's and test_gptoss.py's kernel paths), then the
# sorted GEMM's by the default table
OTHER_PATHS = ((4, "gemv-split"), (None, "pallas"))


@pytest.mark.parametrize("t,table", [(2, OTHER_PATHS), (12, None)])
def test_ops_expert_routes_match_the_reference_route(t, table, monkeypatch):
    """ops.expert_glu / expert_down_sum on the kernels (fused launches up to
    ops.EXPERT_GEMV_MAX_NT tokens, the grouped GEMM beyond) give the XLA reference route's
    products within the int8 activations' rounding; biases as gpt-oss has them."""
    if table:
        monkeypatch.setattr(expert_tuning, "EXPERT_PATHS", table)
        assert expert_tuning.down_variant(t) == "split"
    qtype = QType.Q8_0
    gate, up = (QWeight(stacked_planes(qtype, N, K, s), qtype, (N, K), E) for s in (6, 7))
    down = QWeight(stacked_planes(qtype, K, N * 2, 8), qtype, (K, N * 2), E)
    gemv_path = ops.expert_kernel_path(t) in expert_tuning.GEMV_PATHS
    assert ops.expert_route(gate, t, ops.Impl(kernels=KERNELS)) == (
        "expert-gemv" if gemv_path else "expert-gemm"
    )
    ids, weights = route(t, 2, seed=t)
    x = jax.random.normal(jax.random.PRNGKey(13), (t, K), jnp.float32)
    gb, ub = jax.random.normal(jax.random.PRNGKey(14), (2, E, N))

    def ffn(impl, x, gate, up, down, ids, weights, gb, ub):
        h = ops.expert_glu(x, gate, up, ids, "silu", impl, gate_bias=gb, up_bias=ub)
        h = jnp.concatenate([h, h], axis=-1)  # down's input width N * 2
        return h, ops.expert_down_sum(h, down, ids, weights, impl)

    outs = [
        jax.jit(ffn, static_argnums=0)(impl, x, gate, up, down, ids, weights, gb, ub)
        for impl in (ops.Impl(kernels=KERNELS), ops.Impl())
    ]
    for got, want in zip(*outs):
        chex.assert_equal_shape([got, want])
        chex.assert_trees_all_close(got, want, atol=2e-2 * float(jnp.max(jnp.abs(want))), rtol=0)


def test_expert_path_table():
    """The table's lookup and its checks: each nt range's path, the deterministic mode's one
    down variant, and tables that ops could not follow refused."""
    table = ((1, "gemv-pairs"), (8, "gemv"), (64, "pallas"), (None, "dequant"))
    expert_tuning.check_table(table)
    got = [expert_tuning.path(nt, table) for nt in (1, 2, 8, 9, 64, 65, 4096)]
    assert got == ["gemv-pairs", "gemv", "gemv", "pallas", "pallas", "dequant", "dequant"]
    assert expert_tuning.gemv_max_nt(table) == 8
    assert expert_tuning.down_variant(8, table=table) == "fused"
    assert expert_tuning.down_variant(8, deterministic=True, table=table) == "pairs"
    assert expert_tuning.down_variant(40, deterministic=True, table=table) == "pairs"
    for bad in (
        ((8, "gemv"),),  # no None bound
        ((8, "gemv"), (4, "gemv-pairs"), (None, "ragged")),  # bounds decrease
        ((8, "gemv-fast"), (None, "ragged")),  # unknown path
        ((8, "ragged"), (None, "gemv")),  # a GEMM row before a GEMV row
    ):
        with pytest.raises(ValueError):
            expert_tuning.check_table(bad)
