"""The codebook formats (IQ4_NL, IQ4_XS, MXFP4): bit-exact with gguf-py at every nibble, every
E8M0 byte (the e < 2 subnormal edge included) and every 6-bit scale, through the byte decode
(quant/ggml.py) and the planes (repack + decode); the kernel-side lookups against the table.
Random blocks and hostile f16 scales: tests/test_quant_ggml.py; the GEMV / GEMM kernels:
tests/test_kernels.py (every format of FORMATS)."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from minfer_jax.pallas import int8_words
from minfer_jax.quant import codebooks
from minfer_jax.quant.planes import QType, decode, dequantize, repack


def same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(
        np.where(np.isnan(want), 0, got.view(np.uint32)),
        np.where(np.isnan(want), 0, want.view(np.uint32)),
    )


def every_nibble_pair(n_blocks: int, n_bytes: int) -> np.ndarray:
    """[n_blocks, n_bytes] quant bytes through all 256 values (both nibbles, every value)."""
    return (np.arange(n_blocks * n_bytes) % 256).astype(np.uint8).reshape(n_blocks, n_bytes)


def mxfp4_every_e() -> np.ndarray:
    """512 blocks: block 2e and 2e + 1 have E8M0 byte e (0 .. 255); quants cover every nibble."""
    blocks = np.zeros((512, 17), np.uint8)
    blocks[:, 0] = np.repeat(np.arange(256), 2)
    blocks[:, 1:] = every_nibble_pair(512, 16)
    return blocks


def iq4_xs_every_scale() -> np.ndarray:
    """64 blocks: block i's sub-block ib has the 6-bit scale (i + 8 ib) % 64, d = 1.5, and every
    nibble value."""
    blocks = np.zeros((64, 136), np.uint8)
    blocks[:, 0:2] = np.array([0x3E00], np.uint16).view(np.uint8)  # f16 1.5
    ls = (np.arange(64)[:, None] + 8 * np.arange(8)[None, :]) % 64  # [64, 8]
    scales_h = np.sum((ls >> 4) << (2 * np.arange(8)), axis=1).astype(np.uint16)
    blocks[:, 2:4] = scales_h.view(np.uint8).reshape(64, 2)
    lo = ls & 0x0F
    blocks[:, 4:8] = (lo[:, 0::2] | (lo[:, 1::2] << 4)).astype(np.uint8)
    blocks[:, 8:] = every_nibble_pair(64, 128)
    return blocks


def iq4_nl_every_nibble() -> np.ndarray:
    blocks = np.zeros((32, 18), np.uint8)
    blocks[:, 0:2] = np.array([0xB555], np.uint16).view(np.uint8)  # f16 -0.333
    blocks[:, 2:] = every_nibble_pair(32, 16)
    return blocks


CASES = {
    QType.MXFP4: mxfp4_every_e,
    QType.IQ4_XS: iq4_xs_every_scale,
    QType.IQ4_NL: iq4_nl_every_nibble,
}


@pytest.mark.parametrize("qtype", list(CASES), ids=lambda q: q.name)
@pytest.mark.parametrize("per_row", [1, 2])
def test_every_value_bit_exact(qtype, per_row):
    """Byte decode and decode(repack) equal gguf-py at every scale byte and nibble value, blocks
    alone and side by side in a row."""
    blocks = CASES[qtype]()
    raw = blocks.reshape(len(blocks) // per_row, -1)
    rows, block = raw.shape[0], {QType.IQ4_XS: 256}.get(qtype, 32)
    k = per_row * block
    want = gguf_dequantize(raw, qtype).reshape(rows, k)
    same_bits(dequantize(raw, qtype, (rows, k)), want)
    planes = {n: jnp.asarray(v) for n, v in repack(raw, qtype, (rows, k)).items()}
    same_bits(decode(qtype, planes, jnp.float32)[:rows], want)


def test_mxfp4_reaches_the_subnormal_and_inf_edges():
    """The every-e case is not vacuous: e < 2 gives f32 subnormals, e = 255 infinities."""
    want = gguf_dequantize(mxfp4_every_e(), QType.MXFP4).reshape(512, 32)
    tiny = np.min(np.where(want[:4] == 0, np.inf, np.abs(want[:4])), axis=1)
    assert np.all((tiny > 0) & (tiny < np.finfo(np.float32).tiny))
    assert np.isinf(want[-2:]).any()


@pytest.mark.parametrize("table", [codebooks.KVALUES_IQ4NL, codebooks.KVALUES_MXFP4])
def test_lookup_and_byte_permutes_give_the_table(table):
    """The kernels' two lookups: `lookup` (f16 / bf16 decode) and the GEMV's byte permutes (even
    weights in one int8x4 word, odd in the other) both give codebook[nibble]."""
    n = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(codebooks.lookup(n, table), np.array(table))
    rng = np.random.default_rng(5)
    nibbles = rng.integers(0, 16, (64, 8))  # 64 words of weights 0..7
    fields = codebooks.codebook_order(np.arange(8))
    words = np.zeros(64, np.uint32)
    for k in range(8):
        words |= nibbles[:, k].astype(np.uint32) << (4 * fields[k]).astype(np.uint32)
    even, odd = int8_words._codebook_words(
        jnp.asarray(words)[:, None], table, int8_words.prmt_emulated
    )
    got = np.stack([np.asarray(even)[:, 0], np.asarray(odd)[:, 0]], axis=1).view(np.int8)
    want = np.array(table, np.int8)[nibbles].reshape(64, 4, 2).transpose(0, 2, 1)
    np.testing.assert_array_equal(got.reshape(64, 2, 4), want)


def test_prmt_emulation_follows_ptx():
    """prmt.b32 d, a, b, c: byte i of d is byte c[4i+2 : 4i] of b:a (a's bytes first)."""
    a, b = jnp.uint32(0x33221100), jnp.uint32(0x77665544)
    assert int(int8_words.prmt_emulated(a, b, jnp.uint32(0x7531))) == 0x77553311
    assert int(int8_words.prmt_emulated(a, b, jnp.uint32(0x0004))) == 0x00000044
