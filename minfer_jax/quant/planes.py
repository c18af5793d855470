"""Device layout of every weight format: GGUF blocks -> planes (repack), planes -> values (decode).

GGUF blocks (18, 22, 34, 144, 210 bytes) interleave scales and quants at odd strides, which no
kernel can load in power-of-two tiles. At load time each matrix is repacked once into *planes*:
2-D arrays [rows, K / weights_per_col] with the rows (output features) padded to ROW_ALIGN, one
plane per kind of field:

    packed b-bit quants  uint32 words of 32 / b weights, LSB first: the word's k-th weight in
                         field k (natural order), or in field order(k) for the high-bit planes
                         of Q5_*, Q6_K and Q3_K (chosen for the integer GEMV, see _q5h_order)
    per-group scales     f16 (or small ints for K-quant sub-scales), group g at column g

so that a kernel tile covering rows [r0, r0 + bn) and weights [k0, k0 + bk) is the rectangle
plane[r0 : r0 + bn, k0 / wpc : (k0 + bk) / wpc] of every plane (wpc = weights per column).
Layouts, bits per weight and why: docs/ARCHITECTURE.md. Sizes: quants and f16 scales keep their
GGUF size; K-quant 6-bit sub-scales/mins are unpacked to one byte each (Q3_K, Q4_K, Q5_K: +4
bytes per 256 weights, +2.3 .. 3.6 %), so weights stay well inside 1.1x the file.

Words, not bytes: the decode GEMV multiplies four int8 weights per dp4a instruction on 32-bit
registers, and a uint8 plane cannot be reinterpreted as words inside a Triton kernel (outside
it, XLA's bitcast_convert would copy the whole matrix every call).

`decode` (values) and `decode_ints` (integers, scale, offset) are the single definition of each
format's arithmetic on planes. The f16 GEMM and the float GEMV call them on loaded tiles, the
references on whole arrays (f32, bit-exact with gguf-py); the integer GEMV's word tricks
(pallas/int8_words.py) are tested against references built on decode_ints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minfer_jax.errors import UnsupportedError
from minfer_jax.sizes import round_up

QType = GGMLQuantizationType

ROW_ALIGN = 128  # rows padded to this so any power-of-two row block <= 128 tiles them exactly


@dataclasses.dataclass(frozen=True)
class Plane:
    name: str
    dtype: np.dtype
    wpc: int  # weights per column: plane columns = K // wpc


@dataclasses.dataclass(frozen=True)
class Format:
    """Static description of one weight format's device layout."""

    qtype: QType
    planes: tuple[Plane, ...]
    block: int  # weights per GGUF block: K must be a multiple of it
    compute_dtype: np.dtype  # dtype the kernels decode into and feed the dot with
    repack: Callable[[np.ndarray, int], dict[str, np.ndarray]] = dataclasses.field(compare=False)
    ints: Callable | None = dataclasses.field(
        compare=False
    )  # block formats: (tiles, dtype) -> (q, a, b)

    @property
    def name(self) -> str:
        return self.qtype.name


# ----------------------------------------------------------------------------- numpy repack helpers

# Field orders of the high-bit planes. The int8 GEMV (pallas/gemv.py) builds int8x4 words whose
# byte b holds weight 8j + 2b + h (nibble word j, half h); these orders put the high bits of
# exactly those weights where two ops (shift, mask) move them next to their nibbles.


def _q5h_order(k):
    """1-bit, 32 weights per word: weight k = 8j + 2b + h at bit 8b + 4h + j."""
    return 8 * ((k >> 1) & 3) + 4 * (k & 1) + (k >> 3)


def _q6h_order(k):
    """2-bit, 16 weights per word: weight k = 8j + 2b + h at field 4b + 2j + h
    (bits 8b + 4j + 2h)."""
    return 4 * ((k >> 1) & 3) + 2 * (k >> 3) + (k & 1)


def _q3h_order(k):
    """1-bit, 32 weights (two 16-groups) per word: weight k = 16i + 4b + s at bit 8b + 4i + s."""
    return 8 * ((k >> 2) & 3) + 4 * (k >> 4) + (k & 3)


def _blocks(raw: np.ndarray, qtype: QType) -> np.ndarray:
    """uint8 [rows, bytes_per_row] -> [rows, n_blocks, block_bytes]."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(rows, -1, type_size)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The f16 field at byte `off` of every block: [rows, nb] float16."""
    return np.ascontiguousarray(blocks[:, :, off : off + 2]).view(np.float16)[..., 0]


def _pack(values: np.ndarray, bits: int, order: Callable | None = None) -> np.ndarray:
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


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """GGUF 32-weight nibble layout (byte j: weight j low, weight j+16 high) -> [rows, nb*32]
    values."""
    lo, hi = qs & 0x0F, qs >> 4  # [rows, nb, 16]
    return np.concatenate([lo, hi], axis=-1).reshape(qs.shape[0], -1)


def _bits_32(qh: np.ndarray) -> np.ndarray:
    """GGUF Q5 high-bit field (uint32 LE per block, bit j = weight j) -> [rows, nb*32] 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little").reshape(qh.shape[0], -1)


def _kquant_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [rows, ns, 128]: chunk c of 32 bytes holds weights 64c+l (low) and 64c+32+l
    (high)."""
    rows, ns = qs.shape[:2]
    q = qs.reshape(rows, ns, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (q & 0x0F).reshape(rows, ns * 256)


def _kquant_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales [rows, ns, 12] -> (sc, m) uint8 [rows, ns*8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    rows = scales.shape[0]
    return sc.reshape(rows, -1), mn.reshape(rows, -1)


def _pad_rows(planes: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    padded = round_up(rows, ROW_ALIGN)
    if padded == rows:
        return planes
    return {
        k: np.concatenate([v, np.zeros((padded - rows,) + v.shape[1:], v.dtype)])
        for k, v in planes.items()
    }


def _repack_float(dtype):
    def repack(raw: np.ndarray, k: int) -> dict[str, np.ndarray]:
        if raw.dtype == np.uint8:  # BF16 arrives as bytes
            raw = np.ascontiguousarray(raw).view(np.uint16).view(jnp.bfloat16)
        return {"w": np.asarray(raw).astype(dtype).reshape(raw.shape[0], k)}

    return repack


def _repack_q8_0(raw, k):
    b = _blocks(raw, QType.Q8_0)
    return {
        "q": np.ascontiguousarray(b[:, :, 2:]).reshape(b.shape[0], k).view("<u4").astype(np.uint32),
        "d": _f16(b, 0),
    }


def _repack_q4_0(raw, k):
    b = _blocks(raw, QType.Q4_0)
    return {"qs": _pack(_nibbles_32(b[:, :, 2:]), 4), "d": _f16(b, 0)}


def _repack_q4_1(raw, k):
    b = _blocks(raw, QType.Q4_1)
    return {"qs": _pack(_nibbles_32(b[:, :, 4:]), 4), "d": _f16(b, 0), "m": _f16(b, 2)}


def _repack_q5_0(raw, k):
    b = _blocks(raw, QType.Q5_0)
    return {
        "qs": _pack(_nibbles_32(b[:, :, 6:]), 4),
        "qh": _pack(_bits_32(b[:, :, 2:6]), 1, _q5h_order),
        "d": _f16(b, 0),
    }


def _repack_q5_1(raw, k):
    b = _blocks(raw, QType.Q5_1)
    return {
        "qs": _pack(_nibbles_32(b[:, :, 8:]), 4),
        "qh": _pack(_bits_32(b[:, :, 4:8]), 1, _q5h_order),
        "d": _f16(b, 0),
        "m": _f16(b, 2),
    }


def _repack_q2_k(raw, k):
    # block: scales[16] (lo nibble scale, hi nibble min) | qs[64] | d | dmin
    b = _blocks(raw, QType.Q2_K)
    rows, ns = b.shape[:2]
    qs = b[:, :, 16:80].reshape(rows, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    q = (qs & 3).reshape(rows, ns * 256)  # chunk c of 32 bytes, shift s -> weights 128c + 32s + l
    return {
        "qs": _pack(q, 2),
        "sc": np.ascontiguousarray(b[:, :, 0:16]).reshape(rows, -1),
        "d": _f16(b, 80),
        "dmin": _f16(b, 82),
    }


def _repack_q3_k(raw, k):
    # block: hmask[32] | qs[64] | scales[12] (16 x 6-bit, offset 32) | d
    b = _blocks(raw, QType.Q3_K)
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
        "qs": _pack(ql, 2),
        "qh": _pack(qh, 1, _q3h_order),
        "sc": sc.reshape(rows, -1),
        "d": _f16(b, 108),
    }


def _repack_q4_k(raw, k):
    # block: d | dmin | scales[12] | qs[128]
    b = _blocks(raw, QType.Q4_K)
    sc, mn = _kquant_scale_min(b[:, :, 4:16])
    return {
        "qs": _pack(_kquant_nibbles(b[:, :, 16:144]), 4),
        "sc": sc,
        "m": mn,
        "d": _f16(b, 0),
        "dmin": _f16(b, 2),
    }


def _repack_q5_k(raw, k):
    # block: d | dmin | scales[12] | qh[32] | qs[128]; high bit of weight 32i + l is bit i of qh[l]
    b = _blocks(raw, QType.Q5_K)
    rows, ns = b.shape[:2]
    sc, mn = _kquant_scale_min(b[:, :, 4:16])
    qh = b[:, :, 16:48].reshape(rows, ns, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = (qh & 1).reshape(rows, ns * 256)
    return {
        "qs": _pack(_kquant_nibbles(b[:, :, 48:176]), 4),
        "qh": _pack(qh, 1, _q5h_order),
        "sc": sc,
        "m": mn,
        "d": _f16(b, 0),
        "dmin": _f16(b, 2),
    }


def _repack_q6_k(raw, k):
    # block: ql[128] | qh[64] | scales[16] (int8) | d
    b = _blocks(raw, QType.Q6_K)
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
        "ql": _pack(ql, 4),
        "qh": _pack(qh, 2, _q6h_order),
        "sc": np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).reshape(rows, -1),
        "d": _f16(b, 208),
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


def _ints_q8_0(t, dtype):
    return (unpack(t["q"], 8) ^ 0x80) - 0x80, t["d"].astype(dtype), None  # bytes -> signed


def _ints_q4_0(t, dtype):
    return unpack(t["qs"], 4) - 8, t["d"].astype(dtype), None


def _ints_q4_1(t, dtype):
    return unpack(t["qs"], 4), t["d"].astype(dtype), t["m"].astype(dtype)


def _ints_q5_0(t, dtype):
    return (
        (unpack(t["qs"], 4) | (unpack(t["qh"], 1, _q5h_order) << 4)) - 16,
        t["d"].astype(dtype),
        None,
    )


def _ints_q5_1(t, dtype):
    return (
        unpack(t["qs"], 4) | (unpack(t["qh"], 1, _q5h_order) << 4),
        t["d"].astype(dtype),
        t["m"].astype(dtype),
    )


def _ints_q2_k(t, dtype):
    sc = t["sc"].astype(jnp.int32)
    return (
        unpack(t["qs"], 2),
        superblock_scale(sc & 0x0F, t["d"], dtype),
        -superblock_scale(sc >> 4, t["dmin"], dtype),
    )


def _ints_q3_k(t, dtype):
    return (
        (unpack(t["qs"], 2) | (unpack(t["qh"], 1, _q3h_order) << 2)) - 4,
        superblock_scale(t["sc"], t["d"], dtype),
        None,
    )


def _scales_q4_k(t, dtype):
    return superblock_scale(t["sc"], t["d"], dtype), -superblock_scale(t["m"], t["dmin"], dtype)


def _ints_q4_k(t, dtype):
    return (unpack(t["qs"], 4), *_scales_q4_k(t, dtype))


def _ints_q5_k(t, dtype):
    return (
        unpack(t["qs"], 4) | (unpack(t["qh"], 1, _q5h_order) << 4),
        superblock_scale(t["sc"], t["d"], dtype),
        -superblock_scale(t["m"], t["dmin"], dtype),
    )


def _ints_q6_k(t, dtype):
    return (
        (unpack(t["ql"], 4) | (unpack(t["qh"], 2, _q6h_order) << 4)) - 32,
        superblock_scale(t["sc"], t["d"], dtype),
        None,
    )


# Field-major decode (the few-token GEMM, pallas/gemm.py): a format's low-bit plane holds `per`
# fields per word in natural order (8 nibbles; Q8_0: 4 bytes). For one field index i, the weights
# per * j + i of a tile come out as [bn, W] over the tile's W words, with scales and offsets per
# word, and no reshape of the tile: that kernel's dot takes x with its K-columns permuted to match.
# FIELD_PLANES: qtype -> (that plane, bits per field).


def _per_word(v: jax.Array, words: int) -> jax.Array:
    """[r, G] per-group values -> [r, words], each repeated over its group's words."""
    r, g = v.shape
    return jnp.broadcast_to(v[:, :, None], (r, g, words // g)).reshape(r, words)


FIELD_PLANES = {
    q: ("qs", 4) for q in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K)
}
FIELD_PLANES.update({QType.Q6_K: ("ql", 4), QType.Q8_0: ("q", 8)})
_FIELD_OFFSET = {
    QType.Q4_0: 8,
    QType.Q5_0: 16,
    QType.Q6_K: 32,
}  # subtracted from the assembled integer


def fields_per_word(qtype: QType) -> int:
    return 32 // FIELD_PLANES[qtype][1]


def field_scales(qtype: QType, tiles: Mapping[str, jax.Array], dtype):
    """(a, b or None) [bn, W] per word of the tile's field plane, in gguf-py's product order."""
    words = tiles[FIELD_PLANES[qtype][0]].shape[1]
    if qtype in (QType.Q4_K, QType.Q5_K):
        a, b = _scales_q4_k(tiles, dtype)
    elif qtype == QType.Q6_K:
        a, b = superblock_scale(tiles["sc"], tiles["d"], dtype), None
    else:  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: d (and m) per 32-weight block
        a, b = tiles["d"].astype(dtype), tiles["m"].astype(dtype) if "m" in tiles else None
    return _per_word(a, words), None if b is None else _per_word(b, words)


# high-bit planes of the field-major formats: (bits per weight, the field order _pack wrote)
_FIELD_HIGH_BITS = {QType.Q6_K: (2, _q6h_order)} | {
    q: (1, _q5h_order) for q in (QType.Q5_0, QType.Q5_1, QType.Q5_K)
}


def field_ints(qtype: QType, tiles: Mapping[str, jax.Array], i: int) -> jax.Array:
    """int32 q [bn, W] of weights per * j + i (high bits and the format's offset applied)."""
    plane, bits = FIELD_PLANES[qtype]
    words = tiles[plane]
    n_words = words.shape[1]
    q = ((words >> jnp.uint32(bits * i)) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
    if qtype == QType.Q8_0:
        return (q ^ 0x80) - 0x80  # bytes -> signed
    if qtype in _FIELD_HIGH_BITS:  # nibble word j's weight i is weight 8 (j % nibble words) + i
        high_bits, order = _FIELD_HIGH_BITS[qtype]  # of qh word j // nibble words
        nibble_words = 32 // high_bits // 8
        j = jax.lax.iota(jnp.int32, n_words)
        shift = high_bits * order(8 * (j % nibble_words) + i)
        qh = _per_word(tiles["qh"], n_words)
        high = (qh >> shift.astype(jnp.uint32)[None, :]) & jnp.uint32((1 << high_bits) - 1)
        q = q | (high.astype(jnp.int32) << 4)
    return q - _FIELD_OFFSET.get(qtype, 0)


_U8, _I8, _U32, _F16 = (
    np.dtype(np.uint8),
    np.dtype(np.int8),
    np.dtype(np.uint32),
    np.dtype(np.float16),
)


def _fmt(qtype, planes, block, repack, ints, compute=_F16):
    return Format(
        qtype,
        tuple(Plane(n, np.dtype(d), w) for n, d, w in planes),
        block,
        np.dtype(compute),
        repack,
        ints,
    )


FORMATS: dict[QType, Format] = {
    f.qtype: f
    for f in [
        _fmt(QType.F32, [("w", np.float32, 1)], 1, _repack_float(np.float32), None, np.float32),
        _fmt(QType.F16, [("w", np.float16, 1)], 1, _repack_float(np.float16), None),
        _fmt(
            QType.BF16, [("w", jnp.bfloat16, 1)], 1, _repack_float(jnp.bfloat16), None, jnp.bfloat16
        ),
        _fmt(QType.Q8_0, [("q", _U32, 4), ("d", _F16, 32)], 32, _repack_q8_0, _ints_q8_0),
        _fmt(QType.Q4_0, [("qs", _U32, 8), ("d", _F16, 32)], 32, _repack_q4_0, _ints_q4_0),
        _fmt(
            QType.Q4_1,
            [("qs", _U32, 8), ("d", _F16, 32), ("m", _F16, 32)],
            32,
            _repack_q4_1,
            _ints_q4_1,
        ),
        _fmt(
            QType.Q5_0,
            [("qs", _U32, 8), ("qh", _U32, 32), ("d", _F16, 32)],
            32,
            _repack_q5_0,
            _ints_q5_0,
        ),
        _fmt(
            QType.Q5_1,
            [("qs", _U32, 8), ("qh", _U32, 32), ("d", _F16, 32), ("m", _F16, 32)],
            32,
            _repack_q5_1,
            _ints_q5_1,
        ),
        _fmt(
            QType.Q2_K,
            [("qs", _U32, 16), ("sc", _U8, 16), ("d", _F16, 256), ("dmin", _F16, 256)],
            256,
            _repack_q2_k,
            _ints_q2_k,
        ),
        _fmt(
            QType.Q3_K,
            [("qs", _U32, 16), ("qh", _U32, 32), ("sc", _I8, 16), ("d", _F16, 256)],
            256,
            _repack_q3_k,
            _ints_q3_k,
        ),
        _fmt(
            QType.Q4_K,
            [
                ("qs", _U32, 8),
                ("sc", _U8, 32),
                ("m", _U8, 32),
                ("d", _F16, 256),
                ("dmin", _F16, 256),
            ],
            256,
            _repack_q4_k,
            _ints_q4_k,
        ),
        _fmt(
            QType.Q5_K,
            [
                ("qs", _U32, 8),
                ("qh", _U32, 32),
                ("sc", _U8, 32),
                ("m", _U8, 32),
                ("d", _F16, 256),
                ("dmin", _F16, 256),
            ],
            256,
            _repack_q5_k,
            _ints_q5_k,
        ),
        _fmt(
            QType.Q6_K,
            [("ql", _U32, 8), ("qh", _U32, 16), ("sc", _I8, 16), ("d", _F16, 256)],
            256,
            _repack_q6_k,
            _ints_q6_k,
        ),
    ]
}


def get_format(qtype: QType) -> Format:
    try:
        return FORMATS[QType(qtype)]
    except (KeyError, ValueError):
        raise UnsupportedError(
            f"weight type {getattr(qtype, 'name', qtype)} has no device layout; "
            f"supported: {', '.join(q.name for q in FORMATS)}"
        ) from None


def repack(raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """GGUF rows (as gguf-py hands them out) -> planes with rows padded to ROW_ALIGN."""
    rows, k = shape
    fmt = get_format(qtype)
    if k % fmt.block:
        raise UnsupportedError(
            f"{fmt.name} matrix with {k} columns: not a multiple of its block of {fmt.block}"
        )
    planes = fmt.repack(np.asarray(raw), k)
    for p in fmt.planes:
        arr = planes[p.name]
        assert arr.shape == (rows, k // p.wpc) and arr.dtype == p.dtype, (
            fmt.name,
            p,
            arr.shape,
            arr.dtype,
        )
    return _pad_rows(planes, rows)


def decode(
    qtype: QType, tiles: Mapping[str, jax.Array], dtype=jnp.float32, *, magic_half: bool = False
) -> jax.Array:
    """Plane tiles of rows [r0, r0+bn) x weights [k0, k0+bk) -> values [bn, bk] in dtype.

    A plane whose group is wider than the tile (wpc > bk) contributes its one covering column
    (tile_cols(bk, wpc) == 1); the helpers derive group sizes from the tile shapes, so any
    power-of-two bk >= 8 decodes correctly. magic_half (dtype f16): integers to f16 by
    int_to_half's bit trick instead of a conversion instruction (same values).
    """
    fmt = get_format(qtype)
    if fmt.ints is None:
        return tiles["w"].astype(dtype)
    q, a, b = fmt.ints(tiles, dtype)
    q = int_to_half(q) if magic_half and jnp.dtype(dtype) == jnp.float16 else q.astype(dtype)
    return group_scale(q, a) if b is None else group_affine(q, a, b)


_HALF_MAGIC = 0x6600  # f16 bits of 1536.0: 1536 + v for integers 0 <= v < 512 (one ulp = 1 there)


def int_to_half(q: jax.Array) -> jax.Array:
    """int32 q in [-512, 512) -> exactly q as f16, by integer adds and a bitcast: the f16 whose bits
    are 0x6600 + q is 1536 + q, so subtracting 1536 is exact. Integer-to-float conversions run at a
    sixteenth of the FMA rate on the H100/H200; this takes an add, a truncation and an f16 add."""
    bits = (q + _HALF_MAGIC).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16) - jnp.float16(1536.0)


def decode_ints(qtype: QType, tiles: Mapping[str, jax.Array], dtype=jnp.float32):
    """Block formats: plane tiles -> (q int32 [bn, bk], per-group scale a, per-group offset b or
    None)."""
    fmt = get_format(qtype)
    if fmt.ints is None:
        raise UnsupportedError(f"{fmt.name} is a float format: it has no integer form")
    return fmt.ints(tiles, dtype)


def tile_cols(bk: int, wpc: int) -> int:
    """Columns of a plane covered by a tile of bk weights (at least the one covering column)."""
    return max(1, bk // wpc)
