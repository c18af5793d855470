"""The CPU's int8 weight form (quant/int8_form.py, quant/matrix.Int8Weight, quant/int8_dot.py):
bit-exact values for every format it holds (also stored in K slices, and stacked across formats),
the one-row dot through the slices against the dense values, the CPU default's int8 matrices
(layers with their dense copy, the vocabulary without) and the same tokens as the dense f32
reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

import minfer_jax
from minfer_jax import ops
from minfer_jax.quant import int8_dot, int8_form
from minfer_jax.quant.matrix import DenseWeight, Int8Weight
from minfer_jax.quant.planes import FORMATS, QType, dequantize
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

INT8_TYPES = [q for q in FORMATS if int8_form.holds_int8(q)]


def test_int8_covers_the_block_formats_and_not_the_floats_or_mxfp4():
    assert {QType.Q8_0, QType.Q5_0, QType.Q4_K, QType.Q6_K, QType.Q2_K} <= set(INT8_TYPES)
    assert not {QType.F32, QType.F16, QType.BF16, QType.MXFP4} & set(INT8_TYPES)
    assert int8_form.takes_int8("output.weight", QType.Q8_0)
    assert int8_form.takes_int8("blk.0.ffn_up.weight", QType.Q8_0)
    assert not int8_form.takes_int8("blk.0.ffn_up.weight", QType.F16)
    assert not int8_form.takes_int8("token_embd.weight", QType.F16)
    assert not int8_form.takes_int8("per_layer_token_embd.weight", QType.Q8_0)
    assert int8_form.keeps_dense("blk.0.ffn_up.weight")
    assert not int8_form.keeps_dense("output.weight")


def test_k_slices_keep_each_x_slice_under_the_fusion_limit():
    """chunks_for: the fewest K slices of whole groups whose f32 x slice is under 16 KiB."""
    assert int8_dot.chunks_for(896, 32) == 1
    assert int8_dot.chunks_for(4864, 16) == 2  # the 0.5B's ffn_down: 2 x 2432
    assert int8_dot.chunks_for(18944, 32) == 8  # a 7B's ffn_down: 8 x 2368
    assert int8_dot.chunks_for(4096, 32) == 2  # 16 KiB itself is not under the limit


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda q: q.name)
def test_values_are_bit_exact_with_dequantize(qtype):
    """Random bytes (random f16 scales, inf and nan among them) decode through the int8 form to
    exactly dequantize's f32 bits, as whole rows and as looked-up rows."""
    rng = np.random.default_rng(int(qtype))
    bs, ts = GGML_QUANT_SIZES[qtype]
    rows, blocks = 5, 3
    raw = rng.integers(0, 256, (rows, blocks * ts), dtype=np.uint8)
    shape = (rows, blocks * bs)
    q, a, b = int8_form.int8_parts(raw, qtype, shape)
    assert q.dtype == np.int8 and q.shape == shape
    want = np.asarray(dequantize(raw, qtype, shape))
    ids = np.array([[4, 0], [2, 2]])
    for chunks in (1, 3):  # 3 slices of one block each
        w = Int8Weight.from_parts(q, a, b, chunks)
        assert w.shape == shape and w.chunks == chunks
        np.testing.assert_array_equal(np.asarray(w.values()).view(np.uint32), want.view(np.uint32))
        rows_got = np.asarray(w.rows(ids))
        np.testing.assert_array_equal(rows_got.view(np.uint32), want[ids].view(np.uint32))


def test_stacked_formats_keep_every_members_values():
    """q / k / v of different formats (Q5_0, Q8_0, Q4_K with an offset, Q6_K in groups of 16)
    stacked as one Int8Weight: each member's rows decode to its own dequantized values (equal as
    numbers: where an offset of 0 is added, a -0.0 reads +0.0)."""
    rng = np.random.default_rng(0)
    parts, want = [], []
    for qtype in (QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K):
        bs, ts = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (3, 512 // bs, ts), dtype=np.uint8)
        raw = blocks.reshape(3, -1)
        parts.append(int8_form.int8_parts(raw, qtype, (3, 512)))
        want.append(np.asarray(dequantize(raw, qtype, (3, 512))))
    got = np.asarray(Int8Weight.from_parts(*int8_form.stacked_parts(parts), 2).values())
    np.testing.assert_array_equal(got, np.concatenate(want))


def test_one_row_dot_through_k_slices_matches_the_dense_values():
    """int8_matmul: one row through the slices' fused dots, more rows through the dense copy
    (route "dense"), both the dense product's values; a bias added after it (q/k/v) too."""
    rng = np.random.default_rng(1)
    n, k = 24, 4864
    q = rng.integers(-32, 32, (n, k), dtype=np.int8)
    a = rng.random((n, k // 16), dtype=np.float32)
    b = rng.random((n, k // 16), dtype=np.float32)
    w = Int8Weight.from_parts(q, a, b, int8_dot.chunks_for(k, 16))
    dense = DenseWeight(w.values().T, transposed=True)
    both = Int8Weight(w.q, w.a, w.b, dense)
    x = rng.standard_normal((3, k), dtype=np.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w.values(), np.float64).T
    impl = ops.Impl()
    assert w.chunks == 2 and ops.route(both, 1, impl).kind == "int8"
    assert ops.route(both, 3, impl).kind == "dense" and ops.route(w, 3, impl).kind == "int8"
    one = jax.jit(lambda x, w: ops.matmul(x, w, impl) + 1.0)(x[:1], both)
    np.testing.assert_allclose(np.asarray(one), want[:1] + 1.0, rtol=1e-5, atol=1e-3)
    for weight in (both, w):  # the dense copy; without one, one fused dot per row
        many = np.asarray(jax.jit(lambda x, w: ops.matmul(x, w, impl))(x, weight))
        np.testing.assert_allclose(many, want, rtol=1e-5, atol=1e-3)
    many = np.tile(x, (int8_dot.ONE_ROW_MAX_NT, 1))  # past it: the decoded matrix's dot
    got = np.asarray(jax.jit(lambda x, w: ops.matmul(x, w, impl))(many, w))
    np.testing.assert_allclose(
        got, np.tile(want, (int8_dot.ONE_ROW_MAX_NT, 1)), rtol=1e-5, atol=1e-3
    )


@pytest.fixture(scope="module")
def q8_model():
    return synthetic_model_from_config(tiny_config(n_layers=2, context_length=256), "q8_0", seed=3)


def test_cpu_default_holds_int8_matrices_and_matches_dense(q8_model):
    m = minfer_jax.load(gguf_model=q8_model, ctx_size=128)
    assert m.weight_mode == "int8"
    head = m.params.head
    assert isinstance(head, Int8Weight) and isinstance(m.params.embed, Int8Weight)
    assert head.dense is None
    n, k = head.shape
    assert head.nbytes / (n * k) <= 1.25  # int8 + one f32 scale per 32 weights (f32: 4 bytes)
    down = m.params.layers[0].w_down
    n, k = down.shape
    assert isinstance(down, Int8Weight) and isinstance(down.dense, DenseWeight)
    assert (down.nbytes - down.dense.nbytes) / (n * k) <= 1.25  # the int8 form beside the copy
    dense = minfer_jax.load(gguf_model=q8_model, ctx_size=128, weights="dense")
    ids = [5, 17, 3, 99, 42, 7]
    np.testing.assert_allclose(m.logits(ids), dense.logits(ids), atol=1e-4, rtol=0)
    a = minfer_jax.generate(m, ids, max_new_tokens=8, ignore_eos=True)
    b = minfer_jax.generate(dense, ids, max_new_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens
