"""The decode epilogues of split-K partials (pallas/split_sums.py) against their jnp references,
interpreted or compiled (tests/kernel_mode.py: MINFER_TEST_KERNELS=compiled)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_mode import INTERPRET
from minfer_jax import residual
from minfer_jax.pallas import split_sums


def _normal(seed: int, shape) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("batch,width,splits", [(1, 896, 7), (3, 3584, 37), (2, 1152, 1)])
def test_add_partials_matches_its_reference(batch, width, splits):
    """h = x + the partials' sum, bit for bit; the sums of squares per 128 columns (zeros in the
    pieces past the last block) to f32 rounding; their sum is h's sum of squares."""
    x = _normal(0, (batch, width)) * 30.0
    parts = _normal(1, (splits, 4, width + 128))  # padded rows and columns, as a GEMV leaves them
    h, sumsq = split_sums.add_partials(x, parts, interpret=INTERPRET)
    want_h, want_sumsq = split_sums.add_partials_reference(x, parts)
    chex.assert_trees_all_equal(h, want_h)
    blocks = width // 128
    assert sumsq.shape == (batch, 1 << (blocks - 1).bit_length())
    chex.assert_trees_all_close(sumsq, want_sumsq, rtol=1e-5)
    chex.assert_trees_all_equal(sumsq[:, blocks:], jnp.zeros_like(sumsq[:, blocks:]))
    np.testing.assert_allclose(np.asarray(sumsq.sum(1)), np.asarray((h * h).sum(1)), rtol=1e-5)


def test_add_partials_row_does_not_depend_on_the_batch():
    """A row's h and sums of squares are the same bits alone and among other rows."""
    x, parts = _normal(2, (5, 896)), _normal(3, (7, 8, 896))
    h, sumsq = split_sums.add_partials(x, parts, interpret=INTERPRET)
    h1, sumsq1 = split_sums.add_partials(x[3:4], parts[:, 3:4], interpret=INTERPRET)
    chex.assert_trees_all_equal((h[3:4], sumsq[3:4]), (h1, sumsq1))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    "widths,splits", [((2 * 384,), (7,)), ((384, 384), (3, 5)), ((1024,), (1,))]
)
def test_glu_partials_matches_the_model_activation(act, widths, splits):
    """act(gate) * up from one fused gate|up part or one part each (their own split counts) ==
    the reference and the layers' XLA activation (jax.nn.silu / gelu) to f32 rounding."""
    d_ff, batch = sum(widths) // 2, 2
    parts = tuple(
        _normal(10 + i, (s, 4, -(-w // 128) * 128)) * 3.0
        for i, (s, w) in enumerate(zip(splits, widths))
    )
    kw = dict(widths=widths, d_ff=d_ff, act=act, batch=batch)
    got = split_sums.glu_partials(parts, interpret=INTERPRET, **kw)
    chex.assert_shape(got, (batch, d_ff))
    chex.assert_trees_all_close(got, split_sums.glu_partials_reference(parts, **kw), atol=1e-5)
    both = jnp.concatenate(
        [p.sum(0)[:batch, :w] for p, w in zip(parts, widths)], axis=-1
    )  # order-free sums: the activations are compared, not the additions
    xla = residual.ACTIVATIONS[act](both[:, :d_ff]) * both[:, d_ff:]
    chex.assert_trees_all_close(got, xla, atol=1e-4, rtol=1e-5)


def test_glu_partials_refuses_a_region_across_parts():
    parts = (_normal(0, (1, 2, 256)), _normal(1, (1, 2, 384)))
    with pytest.raises(ValueError, match="cross a part boundary"):
        split_sums.glu_partials(
            parts, widths=(256, 256 + 128), d_ff=320, act="silu", batch=2, interpret=INTERPRET
        )
