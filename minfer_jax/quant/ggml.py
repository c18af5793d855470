"""Reference dequantization of GGUF blocks in pure jax.numpy, bit-exact with gguf-py.

One function per format, `dequant_<type>`, maps the uint8 blocks [..., type_size] of a tensor,
exactly as gguf-py hands them out, to float32 [..., block_size]; the float formats are the
degenerate case block_size=1, type_size=itemsize. Each is its format's `dequant` in the format's
record (quant/planes.py), whose `dequantize(data, qtype, shape)` applies it to a whole tensor.
The results are bit-identical to `gguf.quants.dequantize` for every input, including
NaN/inf/subnormal scales, and are the ground truth every kernel is checked against
(tests/test_quant_ggml.py). All multi-byte fields are little-endian (ggml memcpy's them on
little-endian hosts).

Exactness and FMA contraction. XLA CPU (and ptxas on GPU) contracts `a*b + c` into a fused
multiply-add, which skips the rounding of `a*b`; `lax.reduce_precision`, `lax.optimization_barrier`
and bitcast round-trips do not stop it (all are removed or no-ops before LLVM contracts). It is
harmless here, and no barrier is needed, because every product these formats compute is exact in
float32: a scale is an f16 value (at most 11 significant bits, an integer multiple of 2^-24, at
most 65504 in magnitude), a sub-block scale/min at most 8 bits (Q6_K's int8, K-quants' 6 bits),
and a quant at most 8 bits (Q8_0) or 6 bits, so d*sc*q needs at most 11+7+5 = 23 <= 24 bits
(Q6_K, the widest) and never under- or overflows. With exact products the association of the
multiplies and an FMA vs. a separate add all give the same single rounding of the final add/sub,
i.e. gguf-py's `(d*q) + m` and `d*q - dm`. We still follow gguf-py's order (d*sc first, then *q)
so the argument is easy to check. Results are multiples of 2^-24 (or 0/inf/NaN), so
flush-to-zero of f32 subnormals cannot matter either; F32/F16/BF16 data is only bit-manipulated.
The codebook formats fit the same argument (IQ4_XS: d * (ls - 32) * kv needs 11 + 6 + 7 = 24
bits), except MXFP4, whose power-of-two scale reaches 2^-128: its values are built from bits.

NaN payloads: XLA's f16->f32 convert quiets signalling NaNs, numpy keeps the bits; `_f16_to_f32`
rebuilds NaNs bitwise so F16 tensors round-trip exactly. After a multiply both sides quiet the
NaN the same way; which payload survives NaN (op) NaN may differ, so tests compare NaN as NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from minfer_jax.quant import codebooks

QK_K = 256  # super-block size of the K-quants

# ------------------------------------------------------------------------------------------------
# Shared helpers: byte fields -> numbers, bit unpacking.


def _split_last(x: jax.Array, *dims: int) -> jax.Array:
    """[..., prod(dims)] -> [..., *dims]."""
    return x.reshape(*x.shape[:-1], *dims)


def _merge_last(x: jax.Array, n: int) -> jax.Array:
    """[..., a1, ..., an] -> [..., a1*...*an]."""
    return x.reshape(*x.shape[:-n], math.prod(x.shape[-n:]))


def _f16_to_f32(h: jax.Array) -> jax.Array:
    """uint16 IEEE half bit patterns [...] -> float32 [...], exactly as numpy's astype.

    The hardware/XLA convert sets the quiet bit of signalling NaNs; numpy keeps sign and payload
    (mantissa << 13) unchanged, so NaNs are rebuilt bitwise. Everything else converts exactly.
    """
    f = lax.bitcast_convert_type(
        lax.bitcast_convert_type(h, jnp.float16).astype(jnp.float32), jnp.uint32
    )  # [...]
    h32 = h.astype(jnp.uint32)  # [...]
    is_nan = ((h32 & 0x7C00) == 0x7C00) & ((h32 & 0x03FF) != 0)  # [...]
    nan = ((h32 & 0x8000) << 16) | 0x7F800000 | ((h32 & 0x03FF) << 13)  # [...]
    return lax.bitcast_convert_type(jnp.where(is_nan, nan, f), jnp.float32)  # [...]


def _f16_at(b: jax.Array, offset: int) -> jax.Array:
    """The little-endian f16 at byte `offset` of each block: uint8 [..., T] -> f32 [..., 1]."""
    h = lax.bitcast_convert_type(b[..., offset : offset + 2], jnp.uint16)  # [...]
    return _f16_to_f32(h)[..., None]  # [..., 1]


def _unpack(x: jax.Array, bits: int) -> jax.Array:
    """Split each byte into 8//bits fields, lowest bits first.

    uint8 [..., n] -> uint8 [..., 8//bits, n] with out[..., j, i] = (x[..., i] >> (bits*j)) & mask,
    i.e. gguf-py's `x.reshape(..., 1, n) >> shifts.reshape(k, 1) & mask`.
    """
    shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)[:, None]  # [k, 1]
    return (x[..., None, :] >> shifts) & jnp.uint8((1 << bits) - 1)  # [..., k, n]


def _qh32(b4: jax.Array) -> jax.Array:
    """Q5_0/Q5_1 high bits: uint8 [..., 4] (a little-endian u32) -> uint8 [..., 32], bit i of it."""
    qh = lax.bitcast_convert_type(b4, jnp.uint32)[..., None]  # [..., 1]
    return ((qh >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)  # [..., 32]


def _k_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K 6-bit sub-block scales and mins: uint8 [..., 12] -> (sc, m) uint8 [..., 8] each.

    Bytes 0-3 hold sc[0..3] in bits 0-5, bytes 4-7 m[0..3] in bits 0-5; bytes 8-11 hold sc[4..7]
    in bits 0-3 and m[4..7] in bits 4-7, whose top two bits are bits 6-7 of bytes 0-3 / 4-7:
        0 EEAAAAAA   4 eeaaaaaa   8 eeeeEEEE      (A..H = sc[0..7], a..h = m[0..7])
    """
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # [..., 4] each
    sc = jnp.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [..., 8]
    m = jnp.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)  # [..., 8]
    return sc, m


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# One function per format: uint8 blocks [..., type_size] -> float32 [..., block_size].


def dequant_f32(b: jax.Array) -> jax.Array:
    """F32: 4 bytes, a little-endian IEEE float. [..., 4] -> [..., 1]"""
    return lax.bitcast_convert_type(b, jnp.float32)[..., None]


def dequant_f16(b: jax.Array) -> jax.Array:
    """F16: 2 bytes, a little-endian IEEE half. [..., 2] -> [..., 1]"""
    return _f16_at(b, 0)


def dequant_bf16(b: jax.Array) -> jax.Array:
    """BF16: 2 bytes, the top half of an f32 (gguf-py: int16 -> int32 << 16). [..., 2] ->
    [..., 1]"""
    h = lax.bitcast_convert_type(b, jnp.uint16).astype(jnp.uint32)  # [...]
    return lax.bitcast_convert_type(h << 16, jnp.float32)[..., None]  # [..., 1]


def dequant_q8_0(b: jax.Array) -> jax.Array:
    """Q8_0, 32 weights in 34 bytes: [0:2] f16 d, [2:34] int8 q. y = q * d."""
    d = _f16_at(b, 0)  # [..., 1]
    q = _f32(lax.bitcast_convert_type(b[..., 2:34], jnp.int8))  # [..., 32]
    return q * d  # [..., 32]


def dequant_q4_0(b: jax.Array) -> jax.Array:
    """Q4_0, 32 weights in 18 bytes: [0:2] f16 d, [2:18] nibbles: weight i < 16 is the low nibble
    of qs[i], weight 16+i its high nibble. y = d * (q - 8)."""
    d = _f16_at(b, 0)  # [..., 1]
    q = _merge_last(_unpack(b[..., 2:18], 4), 2)  # [..., 32]
    return d * _f32(q.astype(jnp.int32) - 8)  # [..., 32]


def dequant_q4_1(b: jax.Array) -> jax.Array:
    """Q4_1, 32 weights in 20 bytes: [0:2] f16 d, [2:4] f16 m, [4:20] nibbles as Q4_0.
    y = (d * q) + m."""
    d, m = _f16_at(b, 0), _f16_at(b, 2)  # [..., 1]
    q = _merge_last(_unpack(b[..., 4:20], 4), 2)  # [..., 32]
    return (d * _f32(q)) + m  # [..., 32]


def dequant_q5_0(b: jax.Array) -> jax.Array:
    """Q5_0, 32 weights in 22 bytes: [0:2] f16 d, [2:6] u32 qh (bit i = 5th bit of weight i),
    [6:22] low nibbles as Q4_0. y = d * ((ql | qh << 4) - 16)."""
    d = _f16_at(b, 0)  # [..., 1]
    qh = _qh32(b[..., 2:6])  # [..., 32]
    ql = _merge_last(_unpack(b[..., 6:22], 4), 2)  # [..., 32]
    return d * _f32((ql | (qh << 4)).astype(jnp.int32) - 16)  # [..., 32]


def dequant_q5_1(b: jax.Array) -> jax.Array:
    """Q5_1, 32 weights in 24 bytes: [0:2] f16 d, [2:4] f16 m, [4:8] u32 qh, [8:24] low nibbles
    (as Q5_0). y = (d * (ql | qh << 4)) + m."""
    d, m = _f16_at(b, 0), _f16_at(b, 2)  # [..., 1]
    qh = _qh32(b[..., 4:8])  # [..., 32]
    ql = _merge_last(_unpack(b[..., 8:24], 4), 2)  # [..., 32]
    return (d * _f32(ql | (qh << 4))) + m  # [..., 32]


def dequant_q2_k(b: jax.Array) -> jax.Array:
    """Q2_K, 256 weights in 84 bytes: [0:16] 16 sub-block bytes (bits 0-3 scale, 4-7 min),
    [16:80] 2-bit quants, [80:82] f16 d, [82:84] f16 dmin. Weights 128h + 32j + 16k + l
    (half h, shift j, l < 16) are bits 2j..2j+1 of qs[32h + 16k + l], sub-block 8h + 2j + k.
    y = (d * sc) * q - (dmin * m)."""
    sc = b[..., 0:16]  # [..., 16]
    d, dmin = _f16_at(b, 80), _f16_at(b, 82)  # [..., 1]
    dl = (d * _f32(sc & 0xF))[..., None]  # [..., 16, 1]
    ml = (dmin * _f32(sc >> 4))[..., None]  # [..., 16, 1]
    q = _unpack(_split_last(b[..., 16:80], 2, 32), 2)  # [..., 2, 4, 32]
    q = _f32(_split_last(_merge_last(q, 3), 16, 16))  # [..., 16, 16]
    return _merge_last(dl * q - ml, 2)  # [..., 256]


def dequant_q3_k(b: jax.Array) -> jax.Array:
    """Q3_K, 256 weights in 110 bytes: [0:32] hmask, [32:96] 2-bit low quants (laid out as Q2_K),
    [96:108] sixteen 6-bit scales, [108:110] f16 d. Weight 32j + l's high bit is bit j of
    hmask[l]; a set bit means +0, a clear bit -4: q = ql - 4 * (1 - hbit).
    Scale i (biased by 32) has its low nibble in byte i % 8 (bits 4*(i//8)..) and its top two
    bits in byte 8 + i % 4 (bits 2*(i//4)..). y = (d * (sc - 32)) * q."""
    d = _f16_at(b, 108)  # [..., 1]
    s = b[..., 96:108]  # [..., 12]
    lo = _merge_last(_unpack(s[..., 0:8], 4), 2)  # [..., 16]
    hi = _merge_last(_unpack(s[..., 8:12], 2), 2)  # [..., 16]
    sc = _f32((lo | (hi << 4)).astype(jnp.int32) - 32)  # [..., 16]
    dl = (d * sc)[..., None]  # [..., 16, 1]
    ql = _split_last(
        _merge_last(_unpack(_split_last(b[..., 32:96], 2, 32), 2), 3), 16, 16
    )  # [..., 16, 16]
    qh = _split_last(_merge_last(_unpack(b[..., 0:32], 1), 2), 16, 16)  # [..., 16, 16]
    q = _f32(ql.astype(jnp.int32) - ((qh ^ 1) << 2).astype(jnp.int32))  # [..., 16, 16]
    return _merge_last(dl * q, 2)  # [..., 256]


def dequant_q4_k(b: jax.Array) -> jax.Array:
    """Q4_K, 256 weights in 144 bytes: [0:2] f16 d, [2:4] f16 dmin, [4:16] 6-bit scales/mins
    (`_k_scale_min`), [16:144] nibbles: 64-weight chunk c is qs[32c:32c+32], low nibbles are
    sub-block 2c, high nibbles sub-block 2c+1. y = (d * sc) * q - (dmin * m)."""
    d, dmin = _f16_at(b, 0), _f16_at(b, 2)  # [..., 1]
    sc, m = _k_scale_min(b[..., 4:16])  # [..., 8]
    dl = (d * _f32(sc))[..., None]  # [..., 8, 1]
    dm = (dmin * _f32(m))[..., None]  # [..., 8, 1]
    q = _f32(
        _split_last(_merge_last(_unpack(_split_last(b[..., 16:144], 4, 32), 4), 3), 8, 32)
    )  # [..., 8, 32]
    return _merge_last(dl * q - dm, 2)  # [..., 256]


def dequant_q5_k(b: jax.Array) -> jax.Array:
    """Q5_K, 256 weights in 176 bytes: [0:2] f16 d, [2:4] f16 dmin, [4:16] scales/mins as Q4_K,
    [16:48] qh: bit j of qh[l] is the 5th bit of weight 32j + l, [48:176] low nibbles as Q4_K.
    y = (d * sc) * (ql | qh << 4) - (dmin * m)."""
    d, dmin = _f16_at(b, 0), _f16_at(b, 2)  # [..., 1]
    sc, m = _k_scale_min(b[..., 4:16])  # [..., 8]
    dl = (d * _f32(sc))[..., None]  # [..., 8, 1]
    dm = (dmin * _f32(m))[..., None]  # [..., 8, 1]
    ql = _split_last(
        _merge_last(_unpack(_split_last(b[..., 48:176], 4, 32), 4), 3), 8, 32
    )  # [..., 8, 32]
    qh = _unpack(b[..., 16:48], 1)  # [..., 8, 32]
    return _merge_last(dl * _f32(ql | (qh << 4)) - dm, 2)  # [..., 256]


def dequant_q6_k(b: jax.Array) -> jax.Array:
    """Q6_K, 256 weights in 210 bytes: [0:128] low nibbles, [128:192] 2-bit high parts,
    [192:208] sixteen int8 scales, [208:210] f16 d. Half h (128 weights) uses ql[64h:64h+64] and
    qh[32h:32h+32]; its weight 32j + l (j < 4, l < 32) has low nibble (j//2 ? high : low) of
    ql[64h + 32(j%2) + l] and high bits (qh[32h + l] >> 2j) & 3. y = (d * sc) * (q - 32)."""
    d = _f16_at(b, 208)  # [..., 1]
    sc = _f32(lax.bitcast_convert_type(b[..., 192:208], jnp.int8))  # [..., 16]
    dl = (d * sc)[..., None]  # [..., 16, 1]
    ql = _unpack(_split_last(b[..., 0:128], 2, 64), 4)  # [..., 2, 2, 64]
    ql = _split_last(_merge_last(ql, 3), 8, 32)  # [..., 8, 32]
    qh = _unpack(_split_last(b[..., 128:192], 2, 32), 2)  # [..., 2, 4, 32]
    qh = _split_last(_merge_last(qh, 3), 8, 32)  # [..., 8, 32]
    q = (ql | (qh << 4)).astype(jnp.int32) - 32  # [..., 8, 32]
    q = _f32(_split_last(_merge_last(q, 2), 16, 16))  # [..., 16, 16]
    return _merge_last(dl * q, 2)  # [..., 256]


def _codebook(q: jax.Array, table) -> jax.Array:
    """uint8 nibbles -> f32 codebook[q] (a gather: outside kernels only)."""
    return jnp.asarray(table, jnp.float32)[q.astype(jnp.int32)]


def dequant_iq4_nl(b: jax.Array) -> jax.Array:
    """IQ4_NL, 32 weights in 18 bytes: [0:2] f16 d, [2:18] nibbles as Q4_0. y = d * kv[q]."""
    d = _f16_at(b, 0)  # [..., 1]
    q = _merge_last(_unpack(b[..., 2:18], 4), 2)  # [..., 32]
    return d * _codebook(q, codebooks.KVALUES_IQ4NL)  # [..., 32]


def dequant_iq4_xs(b: jax.Array) -> jax.Array:
    """IQ4_XS, 256 weights in 136 bytes: [0:2] f16 d, [2:4] u16 scales_h, [4:8] scales_l,
    [8:136] eight 32-weight runs of nibbles as IQ4_NL. Sub-block ib's 6-bit scale ls has its low
    nibble at (scales_l[ib / 2] >> 4 (ib % 2)) and its top bits at (scales_h >> 2 ib) & 3.
    y = (d * (ls - 32)) * kv[q]."""
    d = _f16_at(b, 0)  # [..., 1]
    h = lax.bitcast_convert_type(b[..., 2:4], jnp.uint16)[..., None]  # [..., 1]
    hi = ((h >> (2 * jnp.arange(8, dtype=jnp.uint16))) & 3).astype(jnp.uint8)  # [..., 8]
    lo = _merge_last(jnp.swapaxes(_unpack(b[..., 4:8], 4), -1, -2), 2)  # [..., 8]
    dl = (d * _f32((lo | (hi << 4)).astype(jnp.int32) - 32))[..., None]  # [..., 8, 1]
    q = _merge_last(_unpack(_split_last(b[..., 8:136], 8, 16), 4), 2)  # [..., 8, 32]
    return _merge_last(dl * _codebook(q, codebooks.KVALUES_IQ4NL), 2)  # [..., 256]


def dequant_mxfp4(b: jax.Array) -> jax.Array:
    """MXFP4, 32 weights in 17 bytes: [0] E8M0 e, [1:17] nibbles as Q4_0.
    y = 2^(e - 128) * kv[q], built from the bits (codebooks.pow2_product: exact at every e)."""
    q = _merge_last(_unpack(b[..., 1:17], 4), 2)  # [..., 32]
    kv = jnp.asarray(codebooks.KVALUES_MXFP4, jnp.int32)[q.astype(jnp.int32)]  # [..., 32]
    return codebooks.pow2_product(kv, b[..., 0:1])  # [..., 32]
