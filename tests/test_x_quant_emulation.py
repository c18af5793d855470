"""tools/x_quant_emulation.py's int8 schemes: what each leaves of x, where a second term goes."""

from __future__ import annotations

import numpy as np
import pytest

from tools import x_quant_emulation as emulation


@pytest.fixture
def x_with_an_outlier():
    x = np.random.default_rng(0).standard_normal((2, 896))
    x[:, 40] = 60.0  # group 1 (of 28), step 0 (of 4)
    return x


def test_one_term_is_off_by_up_to_half_a_step(x_with_an_outlier):
    x = x_with_an_outlier
    got = emulation.int8_groups(x)
    steps = np.abs(x.reshape(2, -1, 32)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(got - x).reshape(2, -1, 32) <= steps / 2 + 1e-12)
    assert np.abs(got - x)[:, 32:64].max() > 0.1  # the outlier's group loses its small values


def test_second_term_only_in_the_outlier_step(x_with_an_outlier):
    x = x_with_an_outlier
    share: list = []
    got = emulation.int8_groups(x, **emulation.SCHEMES["t6"], share=share)
    one, two = emulation.int8_groups(x), emulation.int8_groups(x, terms=2)
    np.testing.assert_array_equal(got[:, 256:], one[:, 256:])  # steps 1..3: one term
    np.testing.assert_array_equal(got[:, :256], two[:, :256])  # step 0: two terms
    assert share == [8 / 28]
    outlier_group = slice(32, 64)
    assert np.abs(got - x)[:, outlier_group].max() < np.abs(one - x)[:, outlier_group].max() / 20


def test_second_term_in_the_largest_groups(x_with_an_outlier):
    share: list = []
    got = emulation.int8_groups(x_with_an_outlier, **emulation.SCHEMES["o4"], share=share)
    two = emulation.int8_groups(x_with_an_outlier, terms=2)
    np.testing.assert_array_equal(got[:, 32:64], two[:, 32:64])
    assert share == [4 / 28]


def test_variants_parse_and_reject():
    assert emulation.parse_variant("a=qkvt6,o,head2") == ("a", {"qkvt6", "o", "head2"})
    for bad in ("=qkv", "a=qkvx", "a=ffn"):
        with pytest.raises(Exception, match="expected NAME=SITE"):
            emulation.parse_variant(bad)
