"""Per-format arithmetic of the device layout (quant/planes.py holds each format's one record).

numpy side: GGUF blocks -> planes (`repack_*`: packed quant words, per-group scales), with the
field orders of the high-bit planes. jnp side: planes -> (integers, per-group scale, per-group
offset) (`ints_*`), which runs both inside Pallas kernels (on loaded tiles) and on whole arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType

# ----------------------------------------------------------------------------- numpy repack helpers

# Field orders of the high-bit planes. The int8 GEMV (pallas/gemv.py) builds int8x4 words whose
# byte b holds weight 8j + 2b + h (nibble word j, half h); these orders put the high bits of
# exactly those weights where two ops (shift, mask) move them next to their nibbles.


def q5h_order(k):
    """1-bit, 32 weights per word: weight k = 8j + 2b + h at bit 8b + 4h + j."""
    return 8 * ((k >> 1) & 3) + 4 * (k & 1) + (k >> 3)


def q6h_order(k):
    """2-bit, 16 weights per word: weight k = 8j + 2b + h at field 4b + 2j + h
    (bits 8b + 4j + 2h)."""
    return 4 * ((k >> 1) & 3) + 2 * (k >> 3) + (k & 1)


def q3h_order(k):
    """1-bit, 32 weights (two 16-groups) per word: weight k = 16i + 4b + s at bit 8b + 4i + s."""
    return 8 * ((k >> 2) & 3) + 4 * (k >> 4) + (k & 3)


def gguf_blocks(raw: np.ndarray, qtype: QType) -> np.ndarray:
    """uint8 [rows, bytes_per_row] -> [rows, n_blocks, block_bytes]."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(rows, -1, type_size)


def f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """The f16 field at byte `off` of every block: [rows, nb] float16."""
    return np.ascontiguousarray(blocks[:, :, off : off + 2]).view(np.float16)[..., 0]


def pack(values: np.ndarray, bits: int, order: Callable | None = None) -> np.ndarray:
    """[rows, K] small unsigned ints -> uint32 words [rows, K * bits / 32], LSB first: the word's
    k-th weight in field order(k) (bits [bits * order(k), bits * (order(k) + 1)))."""
    rows = values.shape[0]
    per = 32 // bits
    v = values.astype(np.uint8).reshape(rows, -1, per)  # [rows, words, per]
    if order is not None:
        permuted = np.empty_like(v)
        permuted[..., order(np.arange(per))] = v
        v = permuted
    v = v.reshape(rows, -1, 8 // bits)  # [rows, bytes, fields per byte]
    packed = v[..., 0].copy()  # [rows, bytes], little-endian words
    for i in range(
        1, 8 // bits
    ):  # one pass per field: numpy's reduce over a tiny axis is ~10x slower
        packed |= v[..., i] << np.uint8(i * bits)
    return packed.view("<u4").astype(np.uint32)


def nibbles_32(qs: np.ndarray) -> np.ndarray:
    """GGUF 32-weight nibble layout (byte j: weight j low, weight j+16 high) -> [rows, nb*32]
    values."""
    lo, hi = qs & 0x0F, qs >> 4  # [rows, nb, 16]
    return np.concatenate([lo, hi], axis=-1).reshape(qs.shape[0], -1)


def bits_32(qh: np.ndarray) -> np.ndarray:
    """GGUF Q5 high-bit field (uint32 LE per block, bit j = weight j) -> [rows, nb*32] 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little").reshape(qh.shape[0], -1)


def kquant_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [rows, ns, 128]: chunk c of 32 bytes holds weights 64c+l (low) and 64c+32+l
    (high)."""
    rows, ns = qs.shape[:2]
    q = qs.reshape(rows, ns, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (q & 0x0F).reshape(rows, ns * 256)


def kquant_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales [rows, ns, 12] -> (sc, m) uint8 [rows, ns*8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    rows = scales.shape[0]
    return sc.reshape(rows, -1), mn.reshape(rows, -1)


def repack_float(dtype):
    def repack(raw: np.ndarray, k: int) -> dict[str, np.ndarray]:
        if raw.dtype == np.uint8:  # BF16 arrives as bytes
            raw = np.ascontiguousarray(raw).view(np.uint16).view(jnp.bfloat16)
        return {"w": np.asarray(raw).astype(dtype).reshape(raw.shape[0], k)}

    return repack


def repack_q8_0(raw, k):
    b = gguf_blocks(raw, QType.Q8_0)
    return {
        "q": np.ascontiguousarray(b[:, :, 2:]).reshape(b.shape[0], k).view("<u4").astype(np.uint32),
        "d": f16_field(b, 0),
    }


def repack_q4_0(raw, k):
    b = gguf_blocks(raw, QType.Q4_0)
    return {"qs": pack(nibbles_32(b[:, :, 2:]), 4), "d": f16_field(b, 0)}


def repack_q4_1(raw, k):
    b = gguf_blocks(raw, QType.Q4_1)
    return {"qs": pack(nibbles_32(b[:, :, 4:]), 4), "d": f16_field(b, 0), "m": f16_field(b, 2)}


def repack_q5_0(raw, k):
    b = gguf_blocks(raw, QType.Q5_0)
    return {
        "qs": pack(nibbles_32(b[:, :, 6:]), 4),
        "qh": pack(bits_32(b[:, :, 2:6]), 1, q5h_order),
        "d": f16_field(b, 0),
    }


def repack_q5_1(raw, k):
    b = gguf_blocks(raw, QType.Q5_1)
    return {
        "qs": pack(nibbles_32(b[:, :, 8:]), 4),
        "qh": pack(bits_32(b[:, :, 4:8]), 1, q5h_order),
        "d": f16_field(b, 0),
        "m": f16_field(b, 2),
    }


def repack_q2_k(raw, k):
    # block: scales[16] (lo nibble scale, hi nibble min) | qs[64] | d | dmin
    b = gguf_blocks(raw, QType.Q2_K)
    rows, ns = b.shape[:2]
    qs = b[:, :, 16:80].reshape(rows, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    q = (qs & 3).reshape(rows, ns * 256)  # chunk c of 32 bytes, shift s -> weights 128c + 32s + l
    return {
        "qs": pack(q, 2),
        "sc": np.ascontiguousarray(b[:, :, 0:16]).reshape(rows, -1),
        "d": f16_field(b, 80),
        "dmin": f16_field(b, 82),
    }


def repack_q3_k(raw, k):
    # block: hmask[32] | qs[64] | scales[12] (16 x 6-bit, offset 32) | d
    b = gguf_blocks(raw, QType.Q3_K)
    rows, ns = b.shape[:2]
    ql = b[:, :, 32:96].reshape(rows, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    ql = (ql & 3).reshape(rows, ns * 256)
    qh = b[:, :, 0:32].reshape(rows, ns, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = (qh & 1).reshape(rows, ns * 256)  # bit i of byte l -> weight 32i + l
    s = b[:, :, 96:108]
    lo = (
        s[..., 0:8].reshape(rows, ns, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ).reshape(rows, ns, 16)
    hi = (
        s[..., 8:12].reshape(rows, ns, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    ).reshape(rows, ns, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    return {
        "qs": pack(ql, 2),
        "qh": pack(qh, 1, q3h_order),
        "sc": sc.reshape(rows, -1),
        "d": f16_field(b, 108),
    }


def repack_q4_k(raw, k):
    # block: d | dmin | scales[12] | qs[128]
    b = gguf_blocks(raw, QType.Q4_K)
    sc, mn = kquant_scale_min(b[:, :, 4:16])
    return {
        "qs": pack(kquant_nibbles(b[:, :, 16:144]), 4),
        "sc": sc,
        "m": mn,
        "d": f16_field(b, 0),
        "dmin": f16_field(b, 2),
    }


def repack_q5_k(raw, k):
    # block: d | dmin | scales[12] | qh[32] | qs[128]; high bit of weight 32i + l is bit i of qh[l]
    b = gguf_blocks(raw, QType.Q5_K)
    rows, ns = b.shape[:2]
    sc, mn = kquant_scale_min(b[:, :, 4:16])
    qh = b[:, :, 16:48].reshape(rows, ns, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = (qh & 1).reshape(rows, ns * 256)
    return {
        "qs": pack(kquant_nibbles(b[:, :, 48:176]), 4),
        "qh": pack(qh, 1, q5h_order),
        "sc": sc,
        "m": mn,
        "d": f16_field(b, 0),
        "dmin": f16_field(b, 2),
    }


def repack_q6_k(raw, k):
    # block: ql[128] | qh[64] | scales[16] (int8) | d
    b = gguf_blocks(raw, QType.Q6_K)
    rows, ns = b.shape[:2]
    ql = b[:, :, 0:128].reshape(rows, ns, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
        1, 1, 1, 2, 1
    )
    ql = (ql & 0x0F).reshape(rows, ns * 256)  # byte 64h + j, shift 4s -> weight 128h + 64s + j
    qh = b[:, :, 128:192].reshape(rows, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    qh = (qh & 3).reshape(rows, ns * 256)  # byte 32h + l, shift 2s -> weight 128h + 32s + l
    return {
        "ql": pack(ql, 4),
        "qh": pack(qh, 2, q6h_order),
        "sc": np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).reshape(rows, -1),
        "d": f16_field(b, 208),
    }


# ----------------------------------------------------------------------------- jnp decode helpers
# Everything below runs both inside Pallas kernels (on loaded tiles) and on whole arrays, so it
# sticks to ops the Triton lowering supports: elementwise ops, broadcasts, iota and reshapes.


def unpack(w: jax.Array, bits: int, order: Callable | None = None) -> jax.Array:
    """uint32 words [r, c] -> int32 [r, c * 32 / bits] in natural k order (inverse of _pack)."""
    per = 32 // bits
    r, c = w.shape
    k = jax.lax.iota(jnp.int32, per)
    shifts = ((order(k) if order is not None else k) * bits).astype(jnp.uint32)  # [per]
    v = (w[:, :, None] >> shifts[None, None, :]) & jnp.uint32((1 << bits) - 1)  # [r, c, per]
    return v.reshape(r, c * per).astype(jnp.int32)


def group_scale(v: jax.Array, s: jax.Array) -> jax.Array:
    """v [r, K] * s [r, K / g] with s broadcast over groups of g = K / s.shape[1] consecutive
    weights."""
    r, k = v.shape
    g = k // s.shape[1]
    return (v.reshape(r, k // g, g) * s[:, :, None]).reshape(r, k)


def affine(v: jax.Array, s: jax.Array, b: jax.Array) -> jax.Array:
    """v * s + b elementwise (broadcasting), in gguf-py's order ((v * s) then + b)."""
    dtype = v.dtype
    if dtype == jnp.float16 and jax.default_backend() != "gpu":
        # XLA:CPU contracts v * s + b into an FMA in some fusions and not in others (the reference
        # and interpret-mode kernels differed by an f16 ulp); in f32 v * s is exact, so the sum is
        # rounded once either way, then to f16
        v, s, b = v.astype(jnp.float32), s.astype(jnp.float32), b.astype(jnp.float32)
    return (v * s + b).astype(dtype)


def group_affine(v: jax.Array, s: jax.Array, b: jax.Array) -> jax.Array:
    """v * s + b per group (`affine`)."""
    r, k = v.shape
    g = k // s.shape[1]
    return affine(v.reshape(r, k // g, g), s[:, :, None], b[:, :, None]).reshape(r, k)


def superblock_scale(sub: jax.Array, d: jax.Array, dtype) -> jax.Array:
    """K-quant sub-scales [r, n_sub] (ints) times their superblock's d [r, n_super] -> [r, n_sub]
    dtype."""
    r, n = sub.shape
    per = n // d.shape[1]
    return (d.astype(dtype)[:, :, None] * sub.astype(dtype).reshape(r, n // per, per)).reshape(r, n)


# Each block format is "integers times a per-group scale plus a per-group offset":
#     value[k] = q[k] * a[g] (+ b[g]),  g = group of k (32, or 16 for Q2_K/Q3_K/Q6_K)
# `_ints_*` return (q int32 [r, K] with the format's offset applied, a [r, G], b [r, G] or None).
# `decode` turns them into values (what the f16 kernels and the reference use); the int8 GEMM
# feeds q to integer dots and applies a, b per group. The products are computed in gguf-py's
# order (d * sc first, then * q, then + b) so f32 decoding is bit-exact.


def ints_q8_0(t, dtype):
    return (unpack(t["q"], 8) ^ 0x80) - 0x80, t["d"].astype(dtype), None  # bytes -> signed


def ints_q4_0(t, dtype):
    return unpack(t["qs"], 4) - 8, t["d"].astype(dtype), None


def ints_q4_1(t, dtype):
    return unpack(t["qs"], 4), t["d"].astype(dtype), t["m"].astype(dtype)


def ints_q5_0(t, dtype):
    return (
        (unpack(t["qs"], 4) | (unpack(t["qh"], 1, q5h_order) << 4)) - 16,
        t["d"].astype(dtype),
        None,
    )


def ints_q5_1(t, dtype):
    return (
        unpack(t["qs"], 4) | (unpack(t["qh"], 1, q5h_order) << 4),
        t["d"].astype(dtype),
        t["m"].astype(dtype),
    )


def ints_q2_k(t, dtype):
    sc = t["sc"].astype(jnp.int32)
    return (
        unpack(t["qs"], 2),
        superblock_scale(sc & 0x0F, t["d"], dtype),
        -superblock_scale(sc >> 4, t["dmin"], dtype),
    )


def ints_q3_k(t, dtype):
    return (
        (unpack(t["qs"], 2) | (unpack(t["qh"], 1, q3h_order) << 2)) - 4,
        superblock_scale(t["sc"], t["d"], dtype),
        None,
    )


def scales_q4_k(t, dtype):
    return superblock_scale(t["sc"], t["d"], dtype), -superblock_scale(t["m"], t["dmin"], dtype)


def ints_q4_k(t, dtype):
    return (unpack(t["qs"], 4), *scales_q4_k(t, dtype))


def ints_q5_k(t, dtype):
    return (
        unpack(t["qs"], 4) | (unpack(t["qh"], 1, q5h_order) << 4),
        superblock_scale(t["sc"], t["d"], dtype),
        -superblock_scale(t["m"], t["dmin"], dtype),
    )


def ints_q6_k(t, dtype):
    return (
        (unpack(t["ql"], 4) | (unpack(t["qh"], 2, q6h_order) << 4)) - 32,
        superblock_scale(t["sc"], t["d"], dtype),
        None,
    )


def per_word(v: jax.Array, words: int) -> jax.Array:
    """[r, G] per-group values -> [r, words], each repeated over its group's words."""
    r, g = v.shape
    return jnp.broadcast_to(v[:, :, None], (r, g, words // g)).reshape(r, words)


_HALF_MAGIC = 0x6600  # f16 bits of 1536.0: 1536 + v for integers 0 <= v < 512 (one ulp = 1 there)


def int_to_half(q: jax.Array) -> jax.Array:
    """int32 q in [-512, 512) -> exactly q as f16, by integer adds and a bitcast: the f16 whose bits
    are 0x6600 + q is 1536 + q, so subtracting 1536 is exact. Integer-to-float conversions run at a
    sixteenth of the FMA rate on the H100/H200; this takes an add, a truncation and an f16 add."""
    bits = (q + _HALF_MAGIC).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1536.0)
