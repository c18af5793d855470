"""tools/engine_check.py's op-level bisection (issue 26's diagnosis of batch invariance): it names
the first primitive whose lone row differs while its inputs agree, and nothing where none does."""

import jax.numpy as jnp

from tools.engine_check import op_differences


def _scaled(x, w):
    y = x * w  # elementwise: a CPU dot itself sums a row in an order that depends on the rows
    # a constant that depends on the row count: what a shape-dependent lowering does to a row
    return jnp.tanh(y + (1e-3 if x.shape[0] == 1 else 0.0)) * 2.0


def test_op_differences_names_the_first_primitive_that_parts():
    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(1, 12)
    w = jnp.linspace(0.5, -0.5, 12, dtype=jnp.float32)
    out = op_differences(_scaled, (x, w), (jnp.concatenate([x, x, x]), w))
    assert out["logits_differ_eagerly"]
    [first] = out["first_with_agreeing_inputs"]  # tanh and mul differ too, but from add's output
    assert first["primitive"] == "add" and first["lone_shapes"] == [[1, 12]]
    assert first["batch_shapes"] == [[3, 12]] and first["elements_that_differ"] == 12
    assert "_scaled" in first["where"]


def test_op_differences_finds_nothing_in_a_row_invariant_function():
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(1, 8)
    out = op_differences(lambda v: jnp.exp(v) * 3.0 + 1.0, (x,), (jnp.concatenate([x, x]),))
    assert out == {
        "primitives": out["primitives"],
        "primitives_that_differ": 0,
        "logits_differ_eagerly": False,
        "first_with_agreeing_inputs": [],
    }
