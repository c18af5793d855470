"""The 4-bit codebook formats: IQ4_NL, IQ4_XS and MXFP4 (a nibble indexes 16 int8 values).

GGUF blocks (ggml-common.h): IQ4_NL 32 weights in 18 bytes (f16 d, qs[16]); IQ4_XS 256 weights in
136 bytes (f16 d, u16 scales_h, scales_l[4], qs[128]: eight 32-weight sub-blocks with 6-bit
scales ls, dl = d * (ls - 32)); MXFP4 32 weights in 17 bytes (E8M0 e, qs[16]). In every one,
byte j of a 32-weight run holds weight j in its low nibble and j + 16 in its high one; the value
is codebook[nibble] * scale. MXFP4's codebook is E2M1 doubled, its scale 2^(e - 128) half of
E8M0's (ggml's E8M0_TO_FP32_HALF).

Planes: `qs` uint32 words of 8 nibbles whose field order (`codebook_order`) puts a word's even
weights in its low 16 bits and its odd ones in the high 16, so that the integer GEMV's byte
permutes (pallas/int8_words.py, llama.cpp's get_int_from_table_16) turn each half into one int8x4
word of the slot layout the other 4-bit formats use; per-group scales as the GGUF stores them
(d f16, IQ4_XS's sc as int8 ls - 32 with d per 256, MXFP4's e as its byte).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from minfer_jax.quant.layout import (
    QType,
    f16_field,
    gguf_blocks,
    nibbles_32,
    pack,
    superblock_scale,
    unpack,
)

# ggml-common.h kvalues_iq4nl and kvalues_mxfp4 (E2M1 doubled: {0, .5, 1, 1.5, 2, 3, 4, 6} * 2)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def table_words(table) -> tuple[int, ...]:
    """A 16-entry int8 codebook as four little-endian uint32 words (entry 4w + b at byte b of w)."""
    return tuple(np.array(table, np.int8).view("<u4").astype(np.int64).tolist())


def codebook_order(k):
    """Nibble field of weight k = 8j + 2b + h in its word: 4h + b (even weights low, odd high)."""
    return 4 * (k & 1) + ((k >> 1) & 3)


def repack_iq4_nl(raw, k):
    b = gguf_blocks(raw, QType.IQ4_NL)
    return {"qs": pack(nibbles_32(b[:, :, 2:]), 4, codebook_order), "d": f16_field(b, 0)}


def repack_mxfp4(raw, k):
    b = gguf_blocks(raw, QType.MXFP4)
    return {
        "qs": pack(nibbles_32(b[:, :, 1:]), 4, codebook_order),
        "e": np.ascontiguousarray(b[:, :, 0]),
    }


def iq4_xs_scales(scales_h: np.ndarray, scales_l: np.ndarray) -> np.ndarray:
    """uint16 scales_h [...] and scales_l [..., 4] -> the eight 6-bit sub-block scales ls - 32
    as int8 [..., 8]: ls = (scales_l[ib / 2] >> 4 (ib % 2)) & 15 | ((scales_h >> 2 ib) & 3) << 4."""
    lo = (scales_l[..., :, None] >> np.array([0, 4], np.uint8)) & 0x0F  # [..., 4, 2]
    lo = lo.reshape(*scales_l.shape[:-1], 8)
    hi = (scales_h[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [..., 8]
    return (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


def repack_iq4_xs(raw, k):
    b = gguf_blocks(raw, QType.IQ4_XS)
    rows, nb = b.shape[:2]
    scales_h = np.ascontiguousarray(b[:, :, 2:4]).view("<u2")[..., 0]  # [rows, nb]
    qs = b[:, :, 8:136].reshape(rows, nb * 8, 16)  # 16 bytes per 32-weight sub-block
    return {
        "qs": pack(nibbles_32(qs), 4, codebook_order),
        "sc": iq4_xs_scales(scales_h, b[:, :, 4:8]).reshape(rows, nb * 8),
        "d": f16_field(b, 0),
    }


# ----------------------------------------------------------------------------- jnp decode
# Kernel-safe (elementwise ops, broadcasts, iota): the lookup picks the codebook word holding the
# entry with three selects on Python constants, then its byte with a shift and a sign extension.


def lookup(n: jax.Array, table) -> jax.Array:
    """int32 nibbles n (0..15) -> int32 codebook[n]."""
    w0, w1, w2, w3 = (int(np.uint32(w).view(np.int32)) for w in table_words(table))
    word = jnp.where(n >= 8, jnp.where(n >= 12, w3, w2), jnp.where(n >= 4, w1, w0))
    return lax.shift_right_arithmetic(word << (24 - 8 * (n & 3)), jnp.int32(24))


def e8m0_half(e: jax.Array) -> jax.Array:
    """E8M0 bytes -> f32 2^(e - 128): bits (e - 1) << 23 for e >= 2, 0x00200000 << e below
    (subnormal; a backend flushing f32 subnormals reads them as 0)."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def ints_iq4_nl(t, dtype):
    return lookup(unpack(t["qs"], 4, codebook_order), KVALUES_IQ4NL), t["d"].astype(dtype), None


def ints_iq4_xs(t, dtype):
    q = lookup(unpack(t["qs"], 4, codebook_order), KVALUES_IQ4NL)
    return q, superblock_scale(t["sc"], t["d"], dtype), None


def ints_mxfp4(t, dtype):
    q = lookup(unpack(t["qs"], 4, codebook_order), KVALUES_MXFP4)
    return q, e8m0_half(t["e"]).astype(dtype), None


def pow2_product(q: jax.Array, e: jax.Array) -> jax.Array:
    """Exactly q * 2^(e - 128) in f32 for int32 |q| <= 12 and bytes e (broadcast), built from the
    bits: XLA:CPU flushes f32 subnormals (e < 2 and small e times small q), numpy does not."""
    bits = lax.bitcast_convert_type(q.astype(jnp.float32), jnp.int32)
    sign, mag = bits & jnp.int32(-(1 << 31)), bits & 0x7FFFFFFF
    shift = e.astype(jnp.int32) - 128
    exponent = (mag >> 23) + shift  # the product's biased exponent where it is normal
    normal = mag + (shift << 23)
    mantissa = (mag & 0x7FFFFF) | 0x800000
    sub = mantissa >> jnp.clip(1 - exponent, 0, 31)  # exact: q has at most 2 significant bits
    out = jnp.where(exponent >= 255, 0x7F800000, jnp.where(exponent >= 1, normal, sub))
    return lax.bitcast_convert_type(sign | jnp.where(mag == 0, 0, out), jnp.float32)


def values_mxfp4(t) -> jax.Array:
    """MXFP4 planes -> f32 values bit-exact with gguf-py at every e (the f32 decode)."""
    q = lookup(unpack(t["qs"], 4, codebook_order), KVALUES_MXFP4)  # [r, K]
    r, k = q.shape
    e = t["e"]
    return pow2_product(q.reshape(r, e.shape[1], -1), e[:, :, None]).reshape(r, k)
