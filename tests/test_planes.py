"""Device layouts: decode(repack(raw)) must equal gguf-py's dequantization bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from minfer_jax.errors import UnsupportedError
from minfer_jax.quant import planes as P
from minfer_jax.quant.planes import QType

FORMATS = list(P.FORMATS)


def random_raw(qtype, rows, k, rng):
    """Random GGUF rows; every f16 field finite so the comparison is not all-NaN."""
    if qtype == QType.F32:
        return rng.standard_normal((rows, k)).astype(np.float32)
    if qtype == QType.F16:
        return rng.standard_normal((rows, k)).astype(np.float16)
    block, size = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (rows, k // block * size), dtype=np.uint8)


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,k", [(1, 256), (100, 512), (130, 1024)])
def test_decode_of_repack_is_bit_exact(qtype, rows, k):
    rng = np.random.default_rng(rows * 7 + k)
    raw = random_raw(qtype, rows, k, rng)
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw, qtype).reshape(rows, k)
    planes = P.repack(raw, qtype, (rows, k))
    got = np.asarray(P.decode(qtype, {n: jnp.asarray(v) for n, v in planes.items()}, jnp.float32))
    assert got.shape[0] % P.ROW_ALIGN == 0 and np.all(
        got[rows:] == 0
    )  # padding rows decode to zero
    assert same_bits(got[:rows], ref)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_tile_decode_matches_whole_decode(qtype):
    """Decoding any aligned tile (even narrower than a scale group, at least one 32-weight word of
    every quant plane) equals the slice of the whole decode."""
    rng = np.random.default_rng(1)
    rows, k = 128, 512
    planes = {
        n: jnp.asarray(v)
        for n, v in P.repack(random_raw(qtype, rows, k, rng), qtype, (rows, k)).items()
    }
    whole = np.asarray(P.decode(qtype, planes, jnp.float32))
    fmt = P.get_format(qtype)
    for bk in (32, 64, 256):
        for k0 in (0, bk, k - bk):
            tiles = {
                p.name: planes[p.name][32:64, k0 // p.wpc : k0 // p.wpc + P.tile_cols(bk, p.wpc)]
                for p in fmt.planes
            }
            got = np.asarray(P.decode(qtype, tiles, jnp.float32))
            assert same_bits(got, whole[32:64, k0 : k0 + bk]), (bk, k0)


def test_layout_sizes_stay_close_to_gguf():
    """Bits per weight after repacking (unpadded rows) vs the GGUF block size: within 4 %."""
    for qtype, fmt in P.FORMATS.items():
        block, size = GGML_QUANT_SIZES[qtype]
        gguf_bits = 8 * size / block
        ours = sum(8 * np.dtype(p.dtype).itemsize / p.wpc for p in fmt.planes)
        assert ours <= gguf_bits * 1.04, (qtype.name, ours, gguf_bits)


def test_unsupported_type_and_bad_width():
    with pytest.raises(UnsupportedError, match="IQ3_S"):
        P.get_format(QType.IQ3_S)
    with pytest.raises(UnsupportedError, match="multiple"):
        P.repack(np.zeros((4, 3 * 144), np.uint8), QType.Q4_K, (4, 3 * 128))


@pytest.mark.real_model
def test_every_real_model_matrix_repacks_exactly(real_model):
    for t in real_model.tensors.values():
        if len(t.shape) != 2:
            continue
        planes = P.repack(t.data, t.qtype, t.shape)
        rows = t.shape[0]
        for r0 in range(0, rows, 32768):  # bounded memory for the 151936-row tensors
            r1 = min(rows, r0 + 32768)
            got = np.asarray(
                P.decode(
                    t.qtype, {n: jnp.asarray(v[r0:r1]) for n, v in planes.items()}, jnp.float32
                )
            )
            ref = gguf_dequantize(np.asarray(t.data[r0:r1]), t.qtype).reshape(r1 - r0, t.shape[1])
            assert same_bits(got, ref), t.name
