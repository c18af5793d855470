"""Every weight format's one record (`Format`, in FORMATS) and what reads it: GGUF bytes -> values
(dequantize), GGUF blocks -> planes (repack), planes -> values (decode).

GGUF blocks (17, 18, 22, 34, 136, 144, 210 bytes) interleave scales and quants at odd strides,
which no kernel can load in power-of-two tiles. At load time each matrix is repacked once into
*planes*: 2-D arrays [rows, K / weights_per_col] with the rows (output features) padded to
ROW_ALIGN, one plane per kind of field:

    packed b-bit quants  uint32 words of 32 / b weights, LSB first: the word's k-th weight in
                         field k (natural order), or in field order(k) for the high-bit planes
                         of Q5_*, Q6_K and Q3_K (chosen for the integer GEMV, see q5h_order) and
                         the codebook formats' nibbles (quant/codebooks.py)
    per-group scales     f16 (or small ints for K-quant sub-scales, MXFP4's E8M0 byte), group g
                         at column g

so that a kernel tile covering rows [r0, r0 + bn) and weights [k0, k0 + bk) is the rectangle
plane[r0 : r0 + bn, k0 / wpc : (k0 + bk) / wpc] of every plane (wpc = weights per column).
Layouts, bits per weight and why: docs/ARCHITECTURE.md. Sizes: quants and f16 scales keep their
GGUF size; K-quant 6-bit sub-scales/mins are unpacked to one byte each (Q3_K, Q4_K, Q5_K, IQ4_XS:
+2 .. 4 bytes per 256 weights, +1.5 .. 3.6 %), so weights stay well inside 1.1x the file.

Words, not bytes: the decode GEMV multiplies four int8 weights per dp4a instruction on 32-bit
registers, and a uint8 plane cannot be reinterpreted as words inside a Triton kernel (outside
it, XLA's bitcast_convert would copy the whole matrix every call).

A record holds everything the layers above read about its format: block and group sizes, the
planes, the compute dtype, the bit-exact byte decode (quant/ggml.py), the repack and the integer
form (quant/layout.py, quant/codebooks.py), and the field-major layout of the few-token GEMM.
The GGUF reader lists the same types (files/gguf.SUPPORTED_TYPES); the kernels' per-format
tables (pallas/int8_words.SPECS, gemv_tuning.TUNING, gemm.FIELD_MAJOR) are keyed by these
records, and tests/test_formats.py checks that every format has its entries.

`decode` (values) and `decode_ints` (integers, scale, offset) are the single definition of each
format's arithmetic on planes. The f16 GEMM and the float GEMV call them on loaded tiles, the
references on whole arrays (f32, bit-exact with gguf-py); the integer GEMV's word tricks
(pallas/int8_words.py) are tested against references built on decode_ints. Every function here
takes planes of one matrix [rows, cols]; expert weights stacked on a leading axis go through
jax.vmap (decode, decode_ints) or one repack per expert.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from jax import lax

from minfer_jax.errors import UnsupportedError
from minfer_jax.quant import codebooks as C
from minfer_jax.quant import ggml as G
from minfer_jax.quant import layout as L
from minfer_jax.quant.layout import affine, int_to_half, per_word
from minfer_jax.sizes import round_up

QType = GGMLQuantizationType

__all__ = ["FORMATS", "Format", "Plane", "QType", "affine", "decode", "int_to_half", "repack"]

ROW_ALIGN = 128  # rows padded to this so any power-of-two row block <= 128 tiles them exactly


@dataclasses.dataclass(frozen=True)
class Plane:
    name: str
    dtype: np.dtype
    wpc: int  # weights per column: plane columns = K // wpc
    # small-int planes: the half-open range valid values lie in (random test and bench planes)
    sample: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class FieldLayout:
    """The few-token GEMM's field-major decode (pallas/gemm.py): the low-bit plane holds
    32 / bits fields per word in natural order (8 nibbles; Q8_0: 4 bytes); for one field index i,
    the weights per * j + i of a tile come out as [bn, W] over the tile's W words, with scales and
    offsets per word, and no reshape of the tile."""

    plane: str
    bits: int
    scales: Callable = dataclasses.field(compare=False)  # (tiles, dtype) -> (a, b or None)
    offset: int = 0  # subtracted from the assembled integer
    high: tuple[int, Callable] | None = None  # qh plane: (bits per weight, the order pack wrote)
    signed: bool = False  # the fields are int8 bytes


@dataclasses.dataclass(frozen=True)
class Format:
    """One weight format: everything the reader, the repacker, the kernels and the tuning read."""

    qtype: QType
    planes: tuple[Plane, ...]
    block: int  # weights per GGUF block: K must be a multiple of it
    compute_dtype: np.dtype  # dtype the kernels decode into and feed the dot with
    repack: Callable[[np.ndarray, int], dict[str, np.ndarray]] = dataclasses.field(compare=False)
    # block formats: (tiles, dtype) -> (q int32 [r, K], a [r, K / group], b or None)
    ints: Callable | None = dataclasses.field(compare=False)
    dequant: Callable = dataclasses.field(compare=False)  # GGUF uint8 blocks -> f32, bit-exact
    group: int = 1  # weights per scale group of `ints` (a, b)
    field: FieldLayout | None = None
    native: np.dtype | None = None  # float formats: the element dtype gguf-py hands out
    # (tiles) -> f32 values, where `ints`' q * a is not exact in f32 (MXFP4's 2^-128 scales)
    exact_f32: Callable | None = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def type_size(self) -> int:
        """Bytes per GGUF block."""
        return GGML_QUANT_SIZES[self.qtype][1]


_U8, _I8, _U32, _F16 = (
    np.dtype(np.uint8),
    np.dtype(np.int8),
    np.dtype(np.uint32),
    np.dtype(np.float16),
)
_SC6 = (0, 64)  # 6-bit sub-scales and mins
_SC6_SIGNED = (-32, 32)  # 6-bit scales stored as ls - 32
_E8M0 = (118, 125)  # MXFP4 scale bytes: 2^-10 .. 2^-4 (weights of a trained model's size)


def _planes(*spec) -> tuple[Plane, ...]:
    return tuple(Plane(n, np.dtype(d), w, *rest) for n, d, w, *rest in spec)


def _float(qtype, dtype, dequant, compute=None) -> Format:
    return Format(
        qtype,
        _planes(("w", dtype, 1)),
        1,
        np.dtype(compute or _F16),
        L.repack_float(dtype),
        None,
        dequant,
        native=np.dtype(dtype),
    )


def _d_m(t, dtype):
    """d (and m) per 32-weight block: the field-major scales of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1."""
    return t["d"].astype(dtype), t["m"].astype(dtype) if "m" in t else None


def _q6_k_scales(t, dtype):
    return L.superblock_scale(t["sc"], t["d"], dtype), None


_Q5H = (1, L.q5h_order)

FORMATS: dict[QType, Format] = {
    f.qtype: f
    for f in [
        _float(QType.F32, np.float32, G.dequant_f32, np.float32),
        _float(QType.F16, np.float16, G.dequant_f16),
        _float(QType.BF16, jnp.bfloat16, G.dequant_bf16, jnp.bfloat16),
        Format(
            QType.Q8_0,
            _planes(("q", _U32, 4), ("d", _F16, 32)),
            32,
            _F16,
            L.repack_q8_0,
            L.ints_q8_0,
            G.dequant_q8_0,
            32,
            FieldLayout("q", 8, _d_m, signed=True),
        ),
        Format(
            QType.Q4_0,
            _planes(("qs", _U32, 8), ("d", _F16, 32)),
            32,
            _F16,
            L.repack_q4_0,
            L.ints_q4_0,
            G.dequant_q4_0,
            32,
            FieldLayout("qs", 4, _d_m, 8),
        ),
        Format(
            QType.Q4_1,
            _planes(("qs", _U32, 8), ("d", _F16, 32), ("m", _F16, 32)),
            32,
            _F16,
            L.repack_q4_1,
            L.ints_q4_1,
            G.dequant_q4_1,
            32,
            FieldLayout("qs", 4, _d_m),
        ),
        Format(
            QType.Q5_0,
            _planes(("qs", _U32, 8), ("qh", _U32, 32), ("d", _F16, 32)),
            32,
            _F16,
            L.repack_q5_0,
            L.ints_q5_0,
            G.dequant_q5_0,
            32,
            FieldLayout("qs", 4, _d_m, 16, _Q5H),
        ),
        Format(
            QType.Q5_1,
            _planes(("qs", _U32, 8), ("qh", _U32, 32), ("d", _F16, 32), ("m", _F16, 32)),
            32,
            _F16,
            L.repack_q5_1,
            L.ints_q5_1,
            G.dequant_q5_1,
            32,
            FieldLayout("qs", 4, _d_m, 0, _Q5H),
        ),
        Format(
            QType.Q2_K,
            _planes(("qs", _U32, 16), ("sc", _U8, 16), ("d", _F16, 256), ("dmin", _F16, 256)),
            256,
            _F16,
            L.repack_q2_k,
            L.ints_q2_k,
            G.dequant_q2_k,
            16,
        ),
        Format(
            QType.Q3_K,
            _planes(
                ("qs", _U32, 16), ("qh", _U32, 32), ("sc", _I8, 16, _SC6_SIGNED), ("d", _F16, 256)
            ),
            256,
            _F16,
            L.repack_q3_k,
            L.ints_q3_k,
            G.dequant_q3_k,
            16,
        ),
        Format(
            QType.Q4_K,
            _planes(
                ("qs", _U32, 8),
                ("sc", _U8, 32, _SC6),
                ("m", _U8, 32, _SC6),
                ("d", _F16, 256),
                ("dmin", _F16, 256),
            ),
            256,
            _F16,
            L.repack_q4_k,
            L.ints_q4_k,
            G.dequant_q4_k,
            32,
            FieldLayout("qs", 4, L.scales_q4_k),
        ),
        Format(
            QType.Q5_K,
            _planes(
                ("qs", _U32, 8),
                ("qh", _U32, 32),
                ("sc", _U8, 32, _SC6),
                ("m", _U8, 32, _SC6),
                ("d", _F16, 256),
                ("dmin", _F16, 256),
            ),
            256,
            _F16,
            L.repack_q5_k,
            L.ints_q5_k,
            G.dequant_q5_k,
            32,
            FieldLayout("qs", 4, L.scales_q4_k, 0, _Q5H),
        ),
        Format(
            QType.Q6_K,
            _planes(("ql", _U32, 8), ("qh", _U32, 16), ("sc", _I8, 16), ("d", _F16, 256)),
            256,
            _F16,
            L.repack_q6_k,
            L.ints_q6_k,
            G.dequant_q6_k,
            16,
            FieldLayout("ql", 4, _q6_k_scales, 32, (2, L.q6h_order)),
        ),
        Format(
            QType.IQ4_NL,
            _planes(("qs", _U32, 8), ("d", _F16, 32)),
            32,
            _F16,
            C.repack_iq4_nl,
            C.ints_iq4_nl,
            G.dequant_iq4_nl,
            32,
        ),
        Format(
            QType.IQ4_XS,
            _planes(("qs", _U32, 8), ("sc", _I8, 32, _SC6_SIGNED), ("d", _F16, 256)),
            256,
            _F16,
            C.repack_iq4_xs,
            C.ints_iq4_xs,
            G.dequant_iq4_xs,
            32,
        ),
        # bf16: 2^(e - 128) * kv is exact in bf16 at any e, where f16's range ends at 2^-24
        Format(
            QType.MXFP4,
            _planes(("qs", _U32, 8), ("e", _U8, 32, _E8M0)),
            32,
            np.dtype(jnp.bfloat16),
            C.repack_mxfp4,
            C.ints_mxfp4,
            G.dequant_mxfp4,
            32,
            exact_f32=C.values_mxfp4,
        ),
    ]
}
SUPPORTED = frozenset(FORMATS)


def get_format(qtype: QType) -> Format:
    try:
        return FORMATS[QType(qtype)]
    except (KeyError, ValueError):
        raise UnsupportedError(
            f"weight type {getattr(qtype, 'name', qtype)} has no device layout; "
            f"supported: {', '.join(q.name for q in FORMATS)}"
        ) from None


# ----------------------------------------------------------------------------- GGUF bytes -> planes


def _pad_rows(planes: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    padded = round_up(rows, ROW_ALIGN)
    if padded == rows:
        return planes
    return {
        k: np.concatenate([v, np.zeros((padded - rows,) + v.shape[1:], v.dtype)])
        for k, v in planes.items()
    }


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


# ----------------------------------------------------------------------------- planes -> values


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
    if fmt.exact_f32 is not None and jnp.dtype(dtype) == jnp.float32:
        return fmt.exact_f32(tiles)
    q, a, b = fmt.ints(tiles, dtype)
    q = int_to_half(q) if magic_half and jnp.dtype(dtype) == jnp.float16 else q.astype(dtype)
    return L.group_scale(q, a) if b is None else L.group_affine(q, a, b)


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


# ----------------------------------------------------------------------------- field-major decode
# For the few-token GEMM (pallas/gemm.py): that kernel's dot takes x with its K-columns permuted
# to match the fields (FieldLayout).


def fields_per_word(qtype: QType) -> int:
    return 32 // _field(qtype).bits


def _field(qtype: QType) -> FieldLayout:
    field = get_format(qtype).field
    if field is None:
        raise UnsupportedError(f"{QType(qtype).name} has no field-major layout")
    return field


def field_scales(qtype: QType, tiles: Mapping[str, jax.Array], dtype):
    """(a, b or None) [bn, W] per word of the tile's field plane, in gguf-py's product order."""
    field = _field(qtype)
    words = tiles[field.plane].shape[1]
    a, b = field.scales(tiles, dtype)
    return per_word(a, words), None if b is None else per_word(b, words)


def field_ints(qtype: QType, tiles: Mapping[str, jax.Array], i: int) -> jax.Array:
    """int32 q [bn, W] of weights per * j + i (high bits and the format's offset applied)."""
    field = _field(qtype)
    bits = field.bits
    words = tiles[field.plane]
    n_words = words.shape[1]
    q = ((words >> jnp.uint32(bits * i)) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
    if field.signed:
        return (q ^ 0x80) - 0x80  # bytes -> signed
    if field.high is not None:  # nibble word j's weight i is weight 8 (j % nibble words) + i
        high_bits, order = field.high  # of qh word j // nibble words
        nibble_words = 32 // high_bits // 8
        j = jax.lax.iota(jnp.int32, n_words)
        shift = high_bits * order(8 * (j % nibble_words) + i)
        qh = per_word(tiles["qh"], n_words)
        high = (qh >> shift.astype(jnp.uint32)[None, :]) & jnp.uint32((1 << high_bits) - 1)
        q = q | (high.astype(jnp.int32) << 4)
    return q - field.offset


# ----------------------------------------------------------------------------- GGUF bytes -> values


def _check_qtype(qtype) -> QType:
    try:
        qt = QType(int(qtype))
    except ValueError:
        raise UnsupportedError(f"dequantize: unknown ggml type id {qtype!r}") from None
    if qt not in FORMATS:
        raise UnsupportedError(
            f"dequantize: ggml type {qt.name} is not supported "
            f"(supported: {', '.join(q.name for q in FORMATS)})"
        )
    return qt


def _as_blocks(data: jax.Array, qtype: QType, rows: int, cols: int) -> jax.Array:
    """data (uint8 bytes, or the float format's own dtype) -> uint8 blocks [rows, cols/bs, ts]."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if cols % bs:
        raise ValueError(
            f"dequantize {qtype.name}: row length {cols} is not a multiple of the block size {bs}"
        )
    nb = cols // bs
    native = FORMATS[qtype].native
    if data.dtype == np.uint8:
        if data.size != rows * nb * ts:
            raise ValueError(
                f"dequantize {qtype.name}: {data.size} bytes for {rows}x{cols} weights, "
                f"expected {rows * nb * ts}"
            )
        return data.reshape(rows, nb, ts)  # [rows, nb, ts]
    if native is not None and data.dtype == native:
        if data.size != rows * cols:
            raise ValueError(
                f"dequantize {qtype.name}: {data.size} elements, expected {rows}x{cols}"
            )
        return lax.bitcast_convert_type(data.reshape(rows, cols), jnp.uint8)  # [rows, cols, ts]
    raise ValueError(
        f"dequantize {qtype.name}: data of dtype {data.dtype} is neither uint8 bytes"
        + (f" nor {native}" if native is not None else "")
    )


@functools.partial(jax.jit, static_argnames=("qtype", "shape"))
def _dequantize(data: jax.Array, qtype: QType, shape: tuple[int, ...]) -> jax.Array:
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    blocks = _as_blocks(data, qtype, rows, cols)  # [rows, nb, ts]
    out = FORMATS[qtype].dequant(blocks)  # [rows, nb, bs]
    return out.reshape(shape)  # shape


def dequantize(data, qtype: QType, shape: Sequence[int]) -> jax.Array:
    """Dequantize one GGUF tensor to float32, bit-exact with `gguf.quants.dequantize`.

    data: numpy or jax array as gguf-py hands it out: uint8 [rows, bytes_per_row] (any shape with
      that many bytes) for block formats and BF16; float32/float16 (or their raw uint8 bytes) for
      F32/F16. qtype: a GGMLQuantizationType in `SUPPORTED` (static under jit). shape: logical
      numpy-order shape, (rows, cols), (n,) or (E, rows, cols) (static under jit).
    Returns float32 of `shape`. Raises UnsupportedError naming the type for any other type and
    ValueError if data does not match shape.
    """
    qt = _check_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("dequantize: shape must have at least one dimension")
    if not isinstance(data, jax.Array):
        data = np.asarray(data)
    return _dequantize(data, qt, shape)
