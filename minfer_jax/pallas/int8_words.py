"""Block formats as int8x4 words: the integer GEMV's kernel-side layouts
(pallas/gemv.py; llama.cpp's MMVQ idea).

Every block format is, per output row and per scale group of `group` weights (quant.planes):

    sum_k w_k x_k = a * sum_k (q_k + off) x_k + b * sum_k x_k,   q_k >= 0 the raw packed integer

With x quantized per scale group (x ~ dx * xq, xq int8; llama.cpp's q8_1 uses blocks of 32):

    y += a * (dx * S + off * dx * sum(xq)) + b * sum(x),   S = sum_k q_k xq_k   (exact int32)

(Q5_0's words carry q_k + off itself as signed bytes, so its off is 0 and the offset term goes.)

S is computed four weights at a time with `dp4a` on 32-bit words: the raw quants are never
unpacked to one value per lane. Each format turns its loaded plane words into `x_slots` word
tensors [bn, G, x_words] whose byte b of word w in slot s is the weight at position
w * 4 * x_slots + b * x_slots + s of its group (a nibble word's even weights in slot 0, odd in
slot 1; a 2-bit word's four bit pairs in slots 0..3), with the high bits of Q5/Q6/Q3 already
or-ed in (the planes' field orders put them two ops away). x is laid out the same way once per
step (`quantize_slots`), so both dp4a operands hold the same four weights.

Views. A quant plane [Npad, K / wpc] of uint32 words is reshaped (free, outside the kernel) to
[Npad, K / group, words per group] (always the first view), a per-group field to [Npad, K / group]
(2-D tiles) or [Npad, K / group, 1] (3-D tiles: the value then meets its group's words by a size-1
broadcast rather than an expand_dims; which the GEMV uses is measured, pallas/gemv_tuning.py).
Fields coarser than a group (K-quant super-block d, dmin; Q3_K's high-bit word shared by two groups)
are gathered per group inside the kernel (`coarse`: plane -> groups per plane column), to the same
shape as the per-group fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from minfer_jax.quant import codebooks
from minfer_jax.quant.planes import QType, get_format

F32 = jnp.float32
M4 = 0x0F0F0F0F  # low nibble of every byte
M2 = 0x03030303  # low bit pair of every byte


@dataclasses.dataclass(frozen=True)
class WordSpec:
    group: int  # weights per scale group
    x_slots: int  # word tensors per group (byte permutations of the group's x)
    x_words: int  # words per group per slot
    offset: int  # added to the raw integers: value = a * (q + offset) + b
    views: tuple[
        tuple[str, tuple[int, ...]], ...
    ]  # plane -> words per group (first: the quants; then fields)
    coarse: tuple[tuple[str, int], ...]  # plane -> groups per plane column (gathered per group)
    # (tiles, parity int32 (group index % 2) of the per-group shape, perm: the byte permute,
    # prmt) -> (slot words: x_slots tensors [bn, G, x_words] of int8x4, a f32, b f32 or None),
    # per-group values (fields, parity, a, b) [bn, G] for 2-D tiles or [bn, G, 1] for 3-D ones
    fn: Callable = dataclasses.field(compare=False)

    def view_tails(
        self, dims3: bool, flat_words: bool = False
    ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(plane, trailing tile shape) for 2-D or 3-D per-group tiles; flat_words: one-word quant
        views (Q2_K, Q3_K) as [bn, G] too."""

        def words_tail(tail):
            return () if flat_words and tail == (1,) else tail

        return tuple(
            (name, words_tail(tail) if i == 0 else ((1,) if dims3 else ()))
            for i, (name, tail) in enumerate(self.views)
        )


# x rounding without conversion instructions (F2I / FRND run at a quarter of the FP32 rate on
# sm_90): for |v| < 2^22, v + 1.5 * 2^23 lands in [2^23, 2^24), where the f32 ulp is 1, so the add
# rounds v to the nearest integer (ties to even) and the low mantissa bits hold it. Bit-identical
# on every backend (an IEEE f32 add and an integer subtract). Which formats use it is a tuning
# choice (gemv_tuning.Int8Row.exact_round; measured: docs/BENCHMARKS.md, GEMV choices [G-round]).
MAGIC = 12582912.0  # 1.5 * 2^23
MAGIC_BITS = 0x4B400000


def round_to_int(v: jax.Array) -> jax.Array:
    """f32 |v| < 2^22 -> int32, rounded to nearest, ties to even."""
    return lax.bitcast_convert_type(v + F32(MAGIC), jnp.int32) - jnp.int32(MAGIC_BITS)


def _f(v):
    return v.astype(F32)


def _col(v):
    """A per-group value as a column beside its group's words: [bn, G] -> [bn, G, 1] (2-D tiles;
    3-D tiles already are)."""
    return v if v.ndim == 3 else v[..., None]


def _shift_iota(n, scale):
    return lax.iota(jnp.uint32, n) * jnp.uint32(scale)


def _nibbles(w):  # [bn, G, 4] nibble words -> (even weights, odd weights) as int8x4 words
    return w & M4, (w >> 4) & M4


def _q5_high(qh):
    """qh [bn, G(, 1)] (layout.q5h_order) -> 5th bits at bit 4 of each byte: (even, odd)
    [bn, G, 4]."""
    j = lax.iota(jnp.uint32, 4)
    h = _col(qh)
    return (h << (4 - j)) & 0x10101010, (h >> j) & 0x10101010


def _q8_0(t, parity, perm=None):
    return [t["q"]], _f(t["d"]), None


def _q4_0(t, parity, perm=None):
    return list(_nibbles(t["qs"])), _f(t["d"]), None


def _q4_1(t, parity, perm=None):
    return list(_nibbles(t["qs"])), _f(t["d"]), _f(t["m"])


def _q5(t):
    lo, hi = _nibbles(t["qs"])
    h_lo, h_hi = _q5_high(t["qh"])
    return [lo | h_lo, hi | h_hi]


def _q5_0(t, parity, perm=None):
    # Bytes q - 16 as signed int8 (offset 0, so no offset term): with the 5th bit set that is the
    # low nibble, with it clear 0xF0 | nibble (the inverted bit times 15 fills bits 4..7).
    # Measured faster than unsigned words: docs/BENCHMARKS.md, GEMV choices [G-q5_0-signed].
    lo, hi = _nibbles(t["qs"])
    h_lo, h_hi = _q5_high(t["qh"])
    return [lo | ((h_lo ^ 0x10101010) * 15), hi | ((h_hi ^ 0x10101010) * 15)], _f(t["d"]), None


def _q5_1(t, parity, perm=None):
    return _q5(t), _f(t["d"]), _f(t["m"])


def _kquant_ab(t):
    return _f(t["d"]) * _f(t["sc"]), -(_f(t["dmin"]) * _f(t["m"]))


def _q4_k(t, parity, perm=None):
    return list(_nibbles(t["qs"])), *_kquant_ab(t)


def _q5_k(t, parity, perm=None):
    return _q5(t), *_kquant_ab(t)


def _q6_k(t, parity, perm=None):
    # ql [bn, G, 2] nibble words; qh [bn, G(, 1)] (layout.q6h_order): nibble word j's high pairs
    # at bits 8b + 4j (even weights) and 8b + 4j + 2 (odd)
    lo, hi = _nibbles(t["ql"])
    h = _col(t["qh"]) >> _shift_iota(2, 4)  # [bn, G, 2]
    words = [lo | ((h << 4) & 0x30303030), hi | ((h << 2) & 0x30303030)]
    return words, _f(t["d"]) * _f(t["sc"]), None


def _crumbs(qs):  # [bn, G(, 1)] 2-bit words -> 4 slots [bn, G, 1]: bit pair s of every byte
    return [(_col(qs) >> (2 * s)) & M2 for s in range(4)]


def _q2_k(t, parity, perm=None):
    sc = t["sc"].astype(jnp.int32)
    return _crumbs(t["qs"]), _f(t["d"]) * _f(sc & 15), -(_f(t["dmin"]) * _f(sc >> 4))


def _q3_k(t, parity, perm=None):
    # qh [bn, G(, 1)] (gathered: one word per two groups, layout.q3h_order): group parity i's
    # high bit of slot s at bit 8b + 4i + s
    base = _col(t["qh"] >> (4 * parity).astype(jnp.uint32))  # [bn, G, 1]
    words = [w | (((base >> s) & 0x01010101) << 2) for s, w in enumerate(_crumbs(t["qs"]))]
    return words, _f(t["d"]) * _f(t["sc"]), None


def _codebook_words(qs, table, perm):
    """[bn, G, 4] nibble words in codebooks.codebook_order -> [even, odd] int8x4 words of the
    codebook's values (llama.cpp's get_int_from_table_16): per half word, two byte permutes pick
    each nibble's entry from the table's low and high eight bytes by its low three bits, a third
    picks between the two by its top bit. Selector nibbles stay in 0..7 (prmt's sign mode off)."""
    table = [jnp.full(qs.shape, w, jnp.uint32) for w in codebooks.table_words(table)]
    words = []
    for n in (qs, qs >> 16):
        low, high = perm(table[0], table[1], n & 0x7777), perm(table[2], table[3], n & 0x7777)
        words.append(perm(low, high, 0x3210 | ((n & 0x8888) >> 1)))
    return words


def _iq4_nl(t, parity, perm):
    return _codebook_words(t["qs"], codebooks.KVALUES_IQ4NL, perm), _f(t["d"]), None


def _iq4_xs(t, parity, perm):
    words = _codebook_words(t["qs"], codebooks.KVALUES_IQ4NL, perm)
    return words, _f(t["d"]) * _f(t["sc"]), None


def _mxfp4(t, parity, perm):
    return (
        _codebook_words(t["qs"], codebooks.KVALUES_MXFP4, perm),
        codebooks.e8m0_half(t["e"]),
        None,
    )


def _spec(qtype: QType, *fields) -> WordSpec:
    """A format's WordSpec, its group the format record's."""
    return WordSpec(get_format(qtype).group, *fields)


SPECS: dict[QType, WordSpec] = {
    QType.Q8_0: _spec(QType.Q8_0, 1, 8, 0, (("q", (8,)), ("d", ())), (), _q8_0),
    QType.Q4_0: _spec(QType.Q4_0, 2, 4, -8, (("qs", (4,)), ("d", ())), (), _q4_0),
    QType.Q4_1: _spec(QType.Q4_1, 2, 4, 0, (("qs", (4,)), ("d", ()), ("m", ())), (), _q4_1),
    QType.Q5_0: _spec(
        QType.Q5_0, 2, 4, 0, (("qs", (4,)), ("qh", ()), ("d", ())), (), _q5_0
    ),  # signed words
    QType.Q5_1: _spec(
        QType.Q5_1, 2, 4, 0, (("qs", (4,)), ("qh", ()), ("d", ()), ("m", ())), (), _q5_1
    ),
    QType.Q4_K: _spec(
        QType.Q4_K, 2, 4, 0, (("qs", (4,)), ("sc", ()), ("m", ())), (("d", 8), ("dmin", 8)), _q4_k
    ),
    QType.Q5_K: _spec(
        QType.Q5_K,
        2,
        4,
        0,
        (("qs", (4,)), ("qh", ()), ("sc", ()), ("m", ())),
        (("d", 8), ("dmin", 8)),
        _q5_k,
    ),
    QType.Q6_K: _spec(
        QType.Q6_K, 2, 2, -32, (("ql", (2,)), ("qh", ()), ("sc", ())), (("d", 16),), _q6_k
    ),
    QType.Q3_K: _spec(
        QType.Q3_K, 4, 1, -4, (("qs", (1,)), ("sc", ())), (("qh", 2), ("d", 16)), _q3_k
    ),
    QType.Q2_K: _spec(
        QType.Q2_K, 4, 1, 0, (("qs", (1,)), ("sc", ())), (("d", 16), ("dmin", 16)), _q2_k
    ),
    QType.IQ4_NL: _spec(QType.IQ4_NL, 2, 4, 0, (("qs", (4,)), ("d", ())), (), _iq4_nl),
    QType.MXFP4: _spec(QType.MXFP4, 2, 4, 0, (("qs", (4,)), ("e", ())), (), _mxfp4),
    QType.IQ4_XS: _spec(QType.IQ4_XS, 2, 4, 0, (("qs", (4,)), ("sc", ())), (("d", 8),), _iq4_xs),
}


def prmt_emulated(a: jax.Array, b: jax.Array, c) -> jax.Array:
    """PTX prmt.b32 (default mode) in plain jnp, for selectors whose nibbles are 0..7: byte i of
    the result is byte (c >> 4 i) & 7 of the pair (a's bytes 0..3, b's 4..7)."""
    a, b = a.astype(jnp.uint32), b.astype(jnp.uint32)
    c = jnp.asarray(c).astype(jnp.uint32)
    out = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape, c.shape), jnp.uint32)
    for i in range(4):
        sel = (c >> (4 * i)) & 7
        byte = (jnp.where(sel < 4, a, b) >> ((sel & 3) * 8)) & 0xFF
        out = out | (byte << (8 * i))
    return out


def dp4a_emulated(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """c + sum over the 4 bytes of a * b, bytes as signed int8 (PTX dp4a.s32.s32), in plain jnp."""
    a = lax.bitcast_convert_type(a, jnp.int32)
    b = lax.bitcast_convert_type(b, jnp.int32)
    for i in range(4):
        left = jnp.int32(24 - 8 * i)
        c = c + lax.shift_right_arithmetic(a << left, jnp.int32(24)) * lax.shift_right_arithmetic(
            b << left, jnp.int32(24)
        )
    return c


def prmt_ptx(a: jax.Array, b: jax.Array, c) -> jax.Array:
    """Byte permute of the pair (a, b) by selector c, per element (PTX prmt.b32; inside a Triton
    kernel on the GPU only)."""
    from jax.experimental.pallas import triton as pltriton

    # Triton's inline asm takes signless integers only: an unsigned operand or result failed to
    # parse ("tt.elementwise_inline_asm op result #0 must be ... integer", H100, 2026-12-07)
    def signless(x):
        x = jnp.asarray(x)
        return lax.bitcast_convert_type(x, jnp.int32) if x.dtype == jnp.uint32 else x

    c = jnp.broadcast_to(jnp.asarray(c, jnp.int32), a.shape)
    [r] = pltriton.elementwise_inline_asm(
        "prmt.b32 $0, $1, $2, $3;",
        args=[signless(a), signless(b), c],
        constraints="=r,r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return lax.bitcast_convert_type(r, jnp.uint32)  # as prmt_emulated's


def dp4a_ptx(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """c + dot of the four signed bytes of a and b, per element (PTX dp4a; inside a Triton
    kernel on the GPU only)."""
    from jax.experimental.pallas import triton as pltriton

    [r] = pltriton.elementwise_inline_asm(
        "dp4a.s32.s32 $0, $1, $2, $3;",
        args=[a, b, c],
        constraints="=r,r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return r


# ----------------------------------------------------------------------------- activation side
# For few tokens x is quantized inside the GEMV kernel, per program and step, from a free view of
# the f32 activations (one launch fewer per matmul; docs/BENCHMARKS.md, GEMV choices
# [G-prequant-nt]); from gemv_tuning.PREQUANT_MIN_NT tokens on by quantize_x before the kernel.


def x_view(qtype: QType, x: jax.Array) -> jax.Array:
    """x [nt, K] -> f32 [nt, G, x_words, 4, x_slots]: the group's position w * 4 * slots + b * slots
    + s at [g, w, b, s] (a reshape: free in XLA)."""
    spec = SPECS[qtype]
    nt, k = x.shape
    return x.astype(F32).reshape(nt, k // spec.group, spec.x_words, 4, spec.x_slots)


def quantize_slots(xs: list[jax.Array], offset: int, exact_round: bool = True):
    """One token's x of G groups, split by slot (each [G, x_words, 4] f32) -> int8 per group of the
    format (scale dx = max|x| / 127, like llama.cpp's q8_1 but per scale group; rounded to nearest,
    ties to even with exact_round, else half up):

    words  x_slots tensors [G, x_words] int32: int8x4 words, byte b = the value at [g, w, b]
    dx     [G] f32
    xo     [G] f32: offset * dx * sum(xq)
    xsum   [G] f32: sum of x (unquantized, for the b term)

    Runs inside the kernel (on loaded tiles) and in the reference (on whole arrays).
    """
    [(words, dx)], xo, xsum = quantize_slot_terms(xs, offset, exact_round, 1)
    return words, dx, xo, xsum


def quantize_slot_terms(xs: list[jax.Array], offset: int, exact_round: bool, terms: int):
    """quantize_slots in `terms` int8 terms, x ~ dx_1 * q_1 + dx_2 * q_2 + ..., each term
    quantizing what the ones before it left (one scale per group each, max / 127): two terms leave
    about 1 / 127^2 of a group's max where one leaves 1 / 127 -> ([(words, dx) per term], xo
    summed over the terms, xsum of x itself). quantize_slots is its one term."""
    out, rest = [], xs
    for term in range(terms):
        qs, words, sum_q, dx, sums = _quantize(rest, exact_round)
        term_xo = offset * dx * sum_q.astype(F32)
        if term == 0:
            xo, xsum = term_xo, sums
        else:
            xo = xo + term_xo
        out.append((words, dx))
        if term + 1 < terms:
            rest = [v - q.astype(F32) * dx[:, None, None] for v, q in zip(rest, qs)]
    return out, xo, xsum


def _quantize(xs: list[jax.Array], exact_round: bool):
    """Slots [G, W, 4] f32 -> (int32 q per slot, their int8x4 words [G, W] per slot, sum of q [G],
    dx [G] = max|x| / 127, x's sum [G]); |q| <= 127."""

    def rows(v, op):  # [G, W, 4] -> [G]
        return op(op(v, axis=-1), axis=-1)

    amax = rows(jnp.abs(xs[0]), jnp.max)
    xsum = rows(xs[0], jnp.sum)
    for v in xs[1:]:
        amax = jnp.maximum(amax, rows(jnp.abs(v), jnp.max))
        xsum = xsum + rows(v, jnp.sum)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)[
        :, None, None
    ]  # [G, 1, 1]
    shifts = (lax.iota(jnp.int32, 4) * 8)[None, None, :]
    qs, words, sum_q = [], [], 0
    for v in xs:
        # |q| <= 127: |v| * 127 / amax <= 127
        q = round_to_int(v * inv) if exact_round else jnp.floor(v * inv + 0.5).astype(jnp.int32)
        sum_q = sum_q + rows(q, jnp.sum)
        words.append(jnp.sum((q & 0xFF) << shifts, axis=-1))  # [G, W]; disjoint bytes, so sum == or
        qs.append(q)
    return qs, words, sum_q, amax / 127.0, xsum


def quantize_x(qtype: QType, x: jax.Array, exact_round: bool) -> tuple[jax.Array, jax.Array]:
    """x [nt, K] -> quantize_slots on whole arrays, laid out for the GEMV's pre-quantized path:
    words [nt, G, x_slots, x_words] int32 (a slot's words of a group contiguous: one vector load)
    and scales [nt, 4, G, 1] f32 (dx, xo, xsum, 0: each a contiguous run over the groups; the
    trailing 1 makes the kernel's loads [1, gt, 1], the shape of its per-group tiles)."""
    spec = SPECS[qtype]
    nt, k = x.shape
    g = k // spec.group
    xv = x_view(qtype, x).reshape(nt * g, spec.x_words, 4, spec.x_slots)
    words, dx, xo, xsum = quantize_slots(
        [xv[..., s] for s in range(spec.x_slots)], spec.offset, exact_round
    )
    xw = jnp.stack(words, axis=1).reshape(nt, g, spec.x_slots, spec.x_words)
    xsc = (
        jnp.stack([dx, xo, xsum, jnp.zeros_like(dx)], axis=0)
        .reshape(4, nt, g, 1)
        .transpose(1, 0, 2, 3)
    )
    return xw, xsc


def word_planes(
    qtype: QType, planes, dims3: bool = False, flat_words: bool = False
) -> dict[str, jax.Array]:
    """Planes reshaped to [Npad, K / group, *tail] (coarse planes unchanged)."""
    out = {}
    for name, tail in SPECS[qtype].view_tails(dims3, flat_words):
        p = planes[name]
        out[name] = p.reshape(p.shape[0], -1, *tail)
    for name, _ in SPECS[qtype].coarse:
        out[name] = planes[name]
    return out
