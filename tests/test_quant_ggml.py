"""minfer_jax.quant.planes.dequantize (quant/ggml.py's block functions) is bit-exact with
gguf.quants.dequantize.

Random blocks, hostile scales (NaN/inf/subnormal/zero/negative/max), sub-scale extremes, every
float bit pattern, every tensor of the real model, jit/vector/error behaviour.
"""

import itertools

import chex
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from minfer_jax.errors import UnsupportedError
from minfer_jax.quant.planes import SUPPORTED, dequantize

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
CODEBOOK_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]  # more in tests/test_codebooks.py
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES + CODEBOOK_TYPES

# Byte offsets of the f16 scale fields inside one block.
F16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}

# f16 bit patterns that break naive implementations.
HOSTILE_F16 = np.array(
    [
        0x0000,
        0x8000,  # +-0
        0x3C00,
        0xBC00,  # +-1
        0x0001,
        0x8001,
        0x03FF,
        0x83FF,  # smallest / largest subnormals, both signs
        0x0400,  # smallest normal
        0x3BFF,
        0x07FF,  # all mantissa bits set (widest possible products)
        0x7BFF,
        0xFBFF,  # +-65504
        0x7C00,
        0xFC00,  # +-inf
        0x7E00,
        0xFE00,
        0x7C01,  # quiet NaNs, signalling NaN
    ],
    dtype=np.uint16,
)


def assert_same_f32(actual, expected, *, exact_nan=False):
    """Equal f32 bit patterns (so -0 != +0); NaN matches any NaN unless exact_nan."""
    actual = np.asarray(actual)
    chex.assert_type(actual, np.float32)
    chex.assert_shape(actual, expected.shape)
    assert expected.dtype == np.float32
    a, e = actual.view(np.uint32), expected.view(np.uint32)
    if not exact_nan:
        nan_a, nan_e = np.isnan(actual), np.isnan(expected)
        np.testing.assert_array_equal(nan_a, nan_e, err_msg="NaN positions differ")
        a, e = np.where(nan_e, 0, a), np.where(nan_e, 0, e)
    if not np.array_equal(a, e):
        bad = np.argwhere(a != e)
        idx = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {a.size} values differ; first at {idx}: "
            f"got {actual[idx]!r} ({a[idx]:#010x}), want {expected[idx]!r} ({e[idx]:#010x})"
        )


def reference(data: np.ndarray, qtype) -> np.ndarray:
    """gguf-py's dequantization, the ground truth."""
    with np.errstate(all="ignore"):  # gguf-py warns on NaN/inf scales; that is the point here
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def check(data: np.ndarray, qtype, shape, **kw):
    want = reference(data, qtype).reshape(shape)
    got = dequantize(data, qtype, shape)
    assert_same_f32(got, want, **kw)
    return want


def random_tensor(rng, qtype, rows, n_blocks):
    """Uniformly random bytes, in the form gguf-py hands them out. Returns (data, shape)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, n_blocks * ts), dtype=np.uint8)
    if qtype == Q.F32:
        raw = raw.view(np.float32)
    elif qtype == Q.F16:
        raw = raw.view(np.float16)
    return raw, (rows, n_blocks * bs)


def put_f16(blocks: np.ndarray, offset: int, bits) -> None:
    """Write f16 bit patterns [N] at `offset` of uint8 blocks [N, ts]."""
    blocks[:, offset : offset + 2] = np.asarray(bits, dtype=np.uint16).reshape(-1, 1).view(np.uint8)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,n_blocks", [(1, 1), (3, 2), (17, 5)])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_random_blocks(qtype, rows, n_blocks):
    rng = np.random.default_rng([int(qtype), rows, n_blocks])
    data, shape = random_tensor(rng, qtype, rows, n_blocks)
    want = check(data, qtype, shape)
    if rows * n_blocks >= 6:  # random scale bytes are NaN/inf 1/32 of the time: not vacuous
        assert np.isfinite(want).mean() > 0.5


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_hostile_f16_scales(qtype):
    """Every combination of hostile d (and m/dmin) with random, all-0x00 and all-0xFF quants."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    fields = F16_FIELDS[qtype]
    combos = np.array(
        list(itertools.product(HOSTILE_F16, repeat=len(fields))), dtype=np.uint16
    )  # [C, F]
    rng = np.random.default_rng(int(qtype))
    parts = []
    for fill in ("random", 0x00, 0xFF):
        if fill == "random":
            blocks = rng.integers(0, 256, (len(combos), ts), dtype=np.uint8)
        else:
            blocks = np.full((len(combos), ts), fill, dtype=np.uint8)
        for j, off in enumerate(fields):
            put_f16(blocks, off, combos[:, j])
        parts.append(blocks)
    data = np.concatenate(parts)  # [3C, ts], one block per row
    check(data, qtype, (len(data), bs))
    # Three blocks per row as well, so hostile blocks sit next to others.
    data = data[: len(data) // 3 * 3].reshape(-1, 3 * ts)
    check(data, qtype, (len(data), 3 * bs))


def _scale_patterns(rng, n_sub, lo, hi, n_random=8):
    """[P, n_sub] sub-block scale patterns: all-lo, all-hi, alternating, halves, random."""
    alt = np.where(np.arange(n_sub) % 2, hi, lo)
    half = np.where(np.arange(n_sub) < n_sub // 2, lo, hi)
    fixed = np.stack([np.full(n_sub, lo), np.full(n_sub, hi), alt, hi + lo - alt, half])
    return np.concatenate([fixed, rng.integers(lo, hi + 1, (n_random, n_sub))]).astype(np.int64)


def _with_scales_and_quants(rng, qtype, n, write_subscales):
    """Blocks [n * D * 3, ts]: subscale patterns x a few d/dmin values x (random, 0x00, 0xFF)
    quants."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    d_values = np.array([0x3C00, 0xBC00, 0x7BFF, 0x0001, 0x3BFF, 0x2E66], dtype=np.uint16)
    out = []
    for fill in ("random", 0x00, 0xFF):
        for i in range(len(d_values)):
            if fill == "random":
                blocks = rng.integers(0, 256, (n, ts), dtype=np.uint8)
            else:
                blocks = np.full((n, ts), fill, dtype=np.uint8)
            for j, off in enumerate(F16_FIELDS[qtype]):  # d = d_values[i], dmin = d_values[-1 - i]
                put_f16(blocks, off, np.full(n, d_values[i] if j == 0 else d_values[-1 - i]))
            write_subscales(blocks)
            out.append(blocks)
    return np.concatenate(out)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of gguf-py's Q4_K.get_scale_min: 6-bit sc, m [N, 8] -> 12 bytes [N, 12]."""
    s = np.zeros((len(sc), 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return s


@pytest.mark.parametrize("qtype,offset", [(Q.Q4_K, 4), (Q.Q5_K, 4)], ids=["Q4_K", "Q5_K"])
def test_k_quant_6bit_scales_and_mins_at_limits(qtype, offset):
    rng = np.random.default_rng(int(qtype) + 100)
    pats = _scale_patterns(rng, 8, 0, 63)  # [P, 8]
    sc = np.repeat(pats, len(pats), axis=0)  # every sc pattern with every m pattern
    m = np.tile(pats, (len(pats), 1))
    packed = pack_k_scales(sc, m)  # [P*P, 12]
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(packed)  # the packer really hits the limits
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_m, m)

    def write(blocks):
        blocks[:, offset : offset + 12] = packed

    data = _with_scales_and_quants(rng, qtype, len(packed), write)
    check(data, qtype, (len(data), GGML_QUANT_SIZES[qtype][0]))


def pack_q3_k_scales(sc6: np.ndarray) -> np.ndarray:
    """16 unsigned 6-bit Q3_K scales [N, 16] (value = sc6 - 32) -> 12 bytes [N, 12]."""
    s = np.zeros((len(sc6), 12), dtype=np.uint8)
    for i in range(16):
        s[:, i % 8] |= ((sc6[:, i] & 0x0F) << (4 * (i // 8))).astype(np.uint8)
        s[:, 8 + i % 4] |= ((sc6[:, i] >> 4) << (2 * (i // 4))).astype(np.uint8)
    return s


def test_q3_k_signed_scale_extremes():
    rng = np.random.default_rng(3)
    sc6 = np.concatenate(
        [_scale_patterns(rng, 16, 0, 63), _scale_patterns(rng, 16, 31, 32, 0)]
    )  # -32..31, -1/0
    packed = pack_q3_k_scales(sc6)
    # The packer is right: with d = 1, every quant = 3 (ql = 3, hmask bit set), y = 3 * (sc6 - 32).
    probe = np.full((len(sc6), 110), 0xFF, dtype=np.uint8)
    probe[:, 96:108] = packed
    put_f16(probe, 108, np.full(len(sc6), 0x3C00))
    y = gguf.quants.dequantize(probe, Q.Q3_K).reshape(-1, 16, 16)
    np.testing.assert_array_equal(y[:, :, 0], 3.0 * (sc6 - 32))

    def write(blocks):
        blocks[:, 96:108] = packed

    data = _with_scales_and_quants(rng, Q.Q3_K, len(packed), write)
    check(data, Q.Q3_K, (len(data), 256))


def test_q6_k_signed_scale_extremes():
    rng = np.random.default_rng(6)
    pats = np.concatenate(
        [
            _scale_patterns(rng, 16, -128, 127),
            _scale_patterns(rng, 16, -1, 0, 0),
            _scale_patterns(rng, 16, -128, -127, 0),
        ]
    )

    def write(blocks):
        blocks[:, 192:208] = pats.astype(np.int8).view(np.uint8)

    data = _with_scales_and_quants(rng, Q.Q6_K, len(pats), write)
    check(data, Q.Q6_K, (len(data), 256))


def test_q2_k_scale_and_min_nibble_extremes():
    rng = np.random.default_rng(2)
    pats = np.concatenate(
        [
            _scale_patterns(rng, 16, 0x00, 0xFF, 0),
            _scale_patterns(rng, 16, 0x0F, 0xF0, 0),
            rng.integers(0, 256, (8, 16)),
        ]
    )

    def write(blocks):
        blocks[:, 0:16] = pats.astype(np.uint8)

    data = _with_scales_and_quants(rng, Q.Q2_K, len(pats), write)
    check(data, Q.Q2_K, (len(data), 256))


def test_f16_and_bf16_every_bit_pattern_exact():
    """No arithmetic: every bit pattern, NaN payloads (incl. signalling NaNs) and -0 included."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    check(bits.view(np.float16), Q.F16, (256, 256), exact_nan=True)
    check(bits.view(np.uint8), Q.F16, (256, 256), exact_nan=True)  # raw bytes work too
    check(bits.view(np.uint8), Q.BF16, (256, 256), exact_nan=True)


def test_f32_special_values_exact():
    rng = np.random.default_rng(32)
    bits = np.concatenate(
        [
            np.array(
                [
                    0,
                    0x80000000,
                    1,
                    0x807FFFFF,
                    0x00800000,
                    0x7F7FFFFF,
                    0x7F800000,
                    0xFF800000,
                    0x7FC00000,
                    0x7F800001,
                    0xFFFFFFFF,
                    0x7FBFFFFF,
                ],
                dtype=np.uint32,
            ),
            rng.integers(0, 1 << 32, 500, dtype=np.uint32),
        ]
    )[:512].reshape(4, 128)
    check(bits.view(np.float32), Q.F32, (4, 128), exact_nan=True)
    check(bits.view(np.uint8), Q.F32, (4, 128), exact_nan=True)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_vector_shape(qtype):
    rng = np.random.default_rng(7)
    bs, ts = GGML_QUANT_SIZES[qtype]
    data, _ = random_tensor(rng, qtype, 1, 4)
    data = data.reshape(-1)
    got = dequantize(data, qtype, (4 * bs,))
    chex.assert_shape(got, (4 * bs,))
    assert_same_f32(got, reference(data, qtype).reshape(-1))


def test_jit_with_static_type_and_shape_and_jax_input():
    rng = np.random.default_rng(8)
    data, shape = random_tensor(rng, Q.Q5_K, 4, 3)
    f = jax.jit(dequantize, static_argnames=("qtype", "shape"))
    got = f(jnp.asarray(data), qtype=Q.Q5_K, shape=shape)
    assert_same_f32(got, reference(data, Q.Q5_K))
    # Fused into a larger traced computation (the way model code uses it); *2 is exact.
    g = jax.jit(lambda x: dequantize(x, Q.Q5_K, shape).T * 2)
    assert_same_f32(g(data), np.asarray(got).T * np.float32(2))


@pytest.mark.parametrize(
    "qtype", [Q.IQ2_XXS, Q.IQ3_S, Q.Q8_1, Q.Q8_K, Q.TQ2_0, Q.I8], ids=lambda q: q.name
)
def test_unsupported_type_raises(qtype):
    with pytest.raises(UnsupportedError, match=qtype.name):
        dequantize(
            np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8),
            qtype,
            (1, GGML_QUANT_SIZES[qtype][0]),
        )
    with pytest.raises(UnsupportedError, match=qtype.name):  # a bare type id as well
        dequantize(
            np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8),
            int(qtype),
            (1, GGML_QUANT_SIZES[qtype][0]),
        )
    assert qtype not in SUPPORTED


def test_unknown_type_id_raises():
    with pytest.raises(UnsupportedError, match="9999"):
        dequantize(np.zeros((1, 4), np.uint8), 9999, (1, 1))


def test_mismatched_data_raises():
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros((2, 34), np.uint8), Q.Q8_0, (2, 64))
    with pytest.raises(ValueError, match="multiple of the block size"):
        dequantize(np.zeros((1, 34), np.uint8), Q.Q8_0, (1, 31))
    with pytest.raises(ValueError, match="dtype"):
        dequantize(np.zeros((1, 32), np.float32), Q.Q8_0, (1, 32))


def test_supported_set():
    assert SUPPORTED == frozenset(ALL_TYPES)


# ------------------------------------------------------------------------------------------------

ROW_CHUNK = 16384  # bounds the two 151936x896 tensors to ~60 MB of f32 per side at a time


@pytest.mark.real_model
@pytest.mark.slow
def test_every_real_model_tensor(real_model):
    seen = set()
    for name, t in real_model.tensors.items():
        seen.add(t.qtype)
        step = ROW_CHUNK if len(t.shape) == 2 else t.shape[0]
        for r0 in range(0, t.shape[0], step):
            part = t.data[r0 : r0 + step]
            shape = (part.shape[0], *t.shape[1:])
            want = reference(part, t.qtype).reshape(shape)
            try:
                assert_same_f32(dequantize(part, t.qtype, shape), want)
            except AssertionError as e:
                raise AssertionError(f"{name} ({t.qtype.name}) rows {r0}..: {e}") from None
    assert seen >= {Q.F32, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}, seen
