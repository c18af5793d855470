"""The CPU's int8 weight form (quant/int8_form.py, quant/matrix.Int8Weight): bit-exact values for
every format it holds, the vocabulary matrices held compact by default on the CPU, and the
same tokens as the dense f32 reference."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

import minfer_jax
from minfer_jax.quant import int8_form
from minfer_jax.quant.matrix import DenseWeight, Int8Weight
from minfer_jax.quant.planes import FORMATS, QType, dequantize
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

INT8_TYPES = [q for q in FORMATS if int8_form.holds_int8(q)]


def test_int8_covers_the_block_formats_and_not_the_floats_or_mxfp4():
    assert {QType.Q8_0, QType.Q5_0, QType.Q4_K, QType.Q6_K, QType.Q2_K} <= set(INT8_TYPES)
    assert not {QType.F32, QType.F16, QType.BF16, QType.MXFP4} & set(INT8_TYPES)
    assert int8_form.takes_int8("output.weight", QType.Q8_0)
    assert not int8_form.takes_int8("blk.0.ffn_up.weight", QType.Q8_0)
    assert not int8_form.takes_int8("token_embd.weight", QType.F16)


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
    got = np.asarray(Int8Weight(q, a, b).values())
    want = np.asarray(dequantize(raw, qtype, shape))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    ids = np.array([[4, 0], [2, 2]])
    rows_got = np.asarray(Int8Weight(q, a, b).rows(ids))
    np.testing.assert_array_equal(rows_got.view(np.uint32), want[ids].view(np.uint32))


@pytest.fixture(scope="module")
def q8_model():
    return synthetic_model_from_config(tiny_config(n_layers=2, context_length=256), "q8_0", seed=3)


def test_cpu_default_holds_the_vocabulary_in_int8_and_matches_dense(q8_model):
    m = minfer_jax.load(gguf_model=q8_model, ctx_size=128)
    assert m.weight_mode == "int8"
    head = m.params.head
    assert isinstance(head, Int8Weight) and isinstance(m.params.embed, Int8Weight)
    n, k = head.shape
    assert head.nbytes / (n * k) <= 1.25  # int8 + one f32 scale per 32 weights (f32: 4 bytes)
    assert isinstance(m.params.layers[0].w_down, DenseWeight)
    dense = minfer_jax.load(gguf_model=q8_model, ctx_size=128, weights="dense")
    assert m.weight_nbytes < dense.weight_nbytes
    ids = [5, 17, 3, 99, 42, 7]
    np.testing.assert_allclose(m.logits(ids), dense.logits(ids), atol=1e-4, rtol=0)
    a = minfer_jax.generate(m, ids, max_new_tokens=8, ignore_eos=True)
    b = minfer_jax.generate(dense, ids, max_new_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens
