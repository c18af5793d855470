"""Expert tensors: loading (stacked planes / dense with a leading expert axis) and the grouped
matmuls ops.expert_matmul routes to, each against per-expert ops.matmul and gguf-py's values."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax import experts, ops
from minfer_jax.files.gguf import QType, RawTensor
from minfer_jax.model.weights import LoadOptions, _expert_matrix
from minfer_jax.quant.matrix import expert_weight
from minfer_jax.quant.planes import repack

E, N, K, TOP = 6, 40, 64, 2


def _tensor(qtype: QType, e=E, n=N, k=K, seed=0) -> tuple[RawTensor, np.ndarray]:
    """An [e, n, k] expert tensor in qtype and its exact values (gguf-py's dequantization)."""
    vals = np.random.default_rng(seed).standard_normal((e, n, k)).astype(np.float32)
    if qtype == QType.F32:
        return RawTensor("t", qtype, (e, n, k), vals), vals
    data = gguf.quants.quantize(vals, qtype)
    exact = gguf.quants.dequantize(data, qtype).astype(np.float32)
    return RawTensor("t", qtype, (e, n, k), data), exact


def _ids(t: int, seed=1) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([rng.choice(E, TOP, replace=False) for _ in range(t)]), jnp.int32)


DEVICE = jax.devices()[0]
QUANTIZED = LoadOptions(mode="quantized")
DENSE = LoadOptions(mode="dense")


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.Q8_0, QType.Q4_0])
def test_quantized_expert_tensor_stacks_each_experts_planes(qtype):
    k = K
    t, _ = _tensor(qtype, k=k)
    w = _expert_matrix(t, QUANTIZED, DEVICE)
    assert (w.experts, w.shape, w.qtype) == (E, (N, k), qtype)
    for e in (0, E - 1):
        alone = repack(np.asarray(t.data)[e], qtype, (N, k))
        assert set(alone) == set(w.planes)
        for name, plane in alone.items():
            assert w.planes[name].shape == (E, *plane.shape)
            np.testing.assert_array_equal(np.asarray(w.planes[name][e]), plane)


def test_dense_expert_tensor_is_exact():
    t, exact = _tensor(QType.Q8_0)
    w = _expert_matrix(t, DENSE, DEVICE)
    assert (w.experts, w.shape) == (E, (N, K))
    np.testing.assert_array_equal(np.asarray(w.w), exact)


@pytest.mark.parametrize(
    "qtype,opts",
    [(QType.F32, DENSE), (QType.Q8_0, DENSE), (QType.F16, QUANTIZED), (QType.Q8_0, QUANTIZED)],
)
@pytest.mark.parametrize("route", ["gather", "tiles"])
def test_every_route_matches_per_expert_matmul(qtype, opts, route):
    t, exact = _tensor(qtype)
    w = _expert_matrix(t, opts, DEVICE)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((19, K)), jnp.float32)
    ids = _ids(19)
    y = jax.jit(ops.EXPERT_CALLS[route])(x, w, ids)
    assert y.shape == (19, TOP, N) and y.dtype == jnp.float32
    for tok in (0, 7, 18):
        for j in range(TOP):
            alone = ops.matmul(x[tok : tok + 1], expert_weight(w, int(ids[tok, j])), ops.Impl())
            np.testing.assert_allclose(y[tok, j], alone[0], rtol=1e-5, atol=1e-4)
    want = np.einsum("tk,tjnk->tjn", np.asarray(x), exact[np.asarray(ids)])
    tol = 1e-4 if opts.mode == "dense" else 0.05  # the quantized path multiplies in f16
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol)


def test_per_choice_rows_and_the_fused_forms():
    """[T, k, K] input (down), expert_glu = silu(gate) * up, expert_down_sum's weighted slot sum,
    the same through every route (T = 3: gather; T = 40: tiles on the CPU)."""
    g, up, down = (_expert_matrix(_tensor(QType.F32, seed=s)[0], DENSE, DEVICE) for s in (3, 4, 5))
    down = _expert_matrix(_tensor(QType.F32, n=K, k=N, seed=5)[0], DENSE, DEVICE)
    impl = ops.Impl()
    for t in (3, 40):
        x = jnp.asarray(np.random.default_rng(t).standard_normal((t, K)), jnp.float32)
        ids = _ids(t, seed=t)
        rw = jax.nn.softmax(jnp.asarray(np.random.default_rng(9).standard_normal((t, TOP))))
        h = ops.expert_glu(x, g, up, ids, "silu", impl)
        ref_h = jax.nn.silu(experts.gather_matmul(x, g, ids)) * experts.gather_matmul(x, up, ids)
        np.testing.assert_allclose(h, ref_h, rtol=1e-5, atol=1e-5)
        out = ops.expert_down_sum(h, down, ids, rw, impl)
        per = experts.gather_matmul(h, down, ids)  # [T, k, K]
        np.testing.assert_allclose(out, jnp.einsum("tjn,tj->tn", per, rw), rtol=1e-5, atol=1e-3)


def test_routes_by_token_count_and_mode():
    w = _expert_matrix(_tensor(QType.Q8_0)[0], QUANTIZED, DEVICE)
    d = _expert_matrix(_tensor(QType.Q8_0)[0], DENSE, DEVICE)
    pallas = ops.Impl(kernels="pallas")
    assert ops.expert_route(w, 8, pallas) == "expert-gemv"  # the Pallas expert kernels
    assert ops.expert_route(w, 9, pallas) == "expert-gemm"
    assert ops.expert_route(w, 8, ops.Impl()) == "gather"
    assert ops.expert_route(w, 9, ops.Impl()) == "tiles"
    assert ops.expert_route(d, 512, pallas) == "tiles"
    assert ops.expert_route(d, 8, pallas) == "gather"
    deterministic = dataclasses.replace(pallas, deterministic=True)
    assert ops.expert_route(w, 64, deterministic) == "expert-gemv"
    with pytest.raises(ValueError, match="expert tensor"):
        one = expert_weight(w, 0)
        ops.expert_matmul(jnp.zeros((1, K)), one, jnp.zeros((1, 1), jnp.int32), pallas)


def test_tile_table_bounds_any_routing():
    """Every expert's rows start a tile; the static tile count holds the worst routing (every
    expert a single row)."""
    ids = jnp.asarray([[0, 1], [2, 3], [4, 5], [0, 5]], jnp.int32)
    order, dest, tile_expert, used = experts.tile_table(ids, E, tile=4)
    dest, tile_expert, used = np.asarray(dest), np.asarray(tile_expert), np.asarray(used)
    assert len(set(dest.tolist())) == ids.size
    sorted_experts = np.asarray(ids).reshape(-1)[np.asarray(order)]
    assert (tile_expert[dest // 4] == sorted_experts).all()
    assert used.sum() == E  # one tile per expert here
    assert len(used) == -(-(ids.size + E * 3) // 4)
