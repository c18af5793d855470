"""One record per weight format: every table keyed by formats agrees with quant/planes.FORMATS.

The GGUF reader lists its types (it sits below quant); the kernels keep their per-format tables
in pallas/ (word layouts, tuning rows, the measured field-major set). Adding a format to FORMATS
without its entries there, or an entry without a format, fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax.files.gguf import FLOAT_TYPES, SUPPORTED_TYPES
from minfer_jax.pallas import gemm, gemv_tuning, int8_words
from minfer_jax.quant.planes import FORMATS, SUPPORTED, QType, decode, decode_ints, repack

BLOCK_FORMATS = {q for q, f in FORMATS.items() if f.ints is not None}


def test_reader_lists_exactly_the_formats():
    assert SUPPORTED_TYPES == set(FORMATS) == SUPPORTED
    assert FLOAT_TYPES == set(FORMATS) - BLOCK_FORMATS


def test_every_block_format_has_its_word_layout():
    assert set(int8_words.SPECS) == BLOCK_FORMATS
    for qtype, spec in int8_words.SPECS.items():
        fmt = FORMATS[qtype]
        names = {p.name for p in fmt.planes}
        assert spec.group == fmt.group and fmt.block % spec.group == 0, qtype.name
        assert {n for n, _ in spec.views} | {n for n, _ in spec.coarse} <= names, qtype.name
        assert spec.group == spec.x_slots * spec.x_words * 4, qtype.name  # the x view covers it


def test_every_format_has_its_tuning_row():
    assert set(gemv_tuning.TUNING) == set(FORMATS)
    for qtype, row in gemv_tuning.TUNING.items():
        kind = gemv_tuning.Int8Row if qtype in BLOCK_FORMATS else gemv_tuning.FloatRow
        assert isinstance(row, kind), qtype.name


def test_field_major_formats_have_a_field_layout():
    assert gemm.FIELD_MAJOR <= {q for q, f in FORMATS.items() if f.field is not None}
    for fmt in FORMATS.values():
        if fmt.field is not None:
            assert fmt.field.plane in {p.name for p in fmt.planes} and 32 % fmt.field.bits == 0


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.IQ4_XS, QType.MXFP4], ids=lambda q: q.name)
def test_stacked_expert_planes_decode_per_expert(qtype):
    """Expert weights: each expert repacked, every plane stacked on a leading axis E; decode and
    decode_ints under jax.vmap give each expert's own decode (the contract of expert weights)."""
    rng = np.random.default_rng(3)
    fmt = FORMATS[qtype]
    n, k, experts = 8, 512, 3
    raws = [
        rng.integers(0, 256, (n, k // fmt.block * fmt.type_size), dtype=np.uint8)
        for _ in range(experts)
    ]
    per_expert = [repack(r, qtype, (n, k)) for r in raws]
    stacked = {name: jnp.asarray(np.stack([p[name] for p in per_expert])) for name in per_expert[0]}
    assert all(stacked[p.name].shape[0] == experts for p in fmt.planes)
    values = jax.vmap(lambda t: decode(qtype, t, jnp.float32))(stacked)
    q, a, _ = jax.vmap(lambda t: decode_ints(qtype, t, jnp.float32))(stacked)
    for e, planes in enumerate(per_expert):
        one = {name: jnp.asarray(v) for name, v in planes.items()}
        np.testing.assert_array_equal(values[e], decode(qtype, one, jnp.float32))
        q1, a1, _ = decode_ints(qtype, one, jnp.float32)
        np.testing.assert_array_equal(q[e], q1)
        np.testing.assert_array_equal(a[e], a1)
