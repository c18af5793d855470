"""One weight matrix as it sits on the device, the pytrees every matmul route reads (ops.py) and the
model holds (model/weights.py): `QWeight`, its GGUF format repacked into planes (quant/planes.py),
`Int8Weight`, a block format as int8 integers with a scale (and offset) per group (the CPU's
form, quant/int8_form.py), or `DenseWeight`, dequantized once. Below ops and the model, so
neither has to import the other's layer to name a weight."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax.quant.planes import QType, decode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    """A [n, k] matrix in its quantized device layout: planes [Npad, k / wpc] (quant.planes).

    An expert tensor (GGUF [E, n, k]) is one QWeight with experts = E: every plane stacked along a
    leading expert axis, [E, Npad, k / wpc] (each expert repacked alone); shape stays (n, k)."""

    planes: dict[str, jax.Array]
    qtype: QType = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    experts: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: a plain matrix

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.planes.values()))

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized rows ids [...] -> [..., k] f32 (embedding lookup without a dense table)."""
        if self.experts:
            raise ValueError("rows() reads a plain matrix, not an expert tensor")
        flat = ids.reshape(-1)
        vals = decode(self.qtype, {n: p[flat] for n, p in self.planes.items()}, jnp.float32)
        return vals.reshape(*ids.shape, self.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dequantized [n, k] matrix, stored as [n, k] (transposed=False) or [k, n]
    (transposed=True); an expert tensor with experts = E has a leading expert axis ([E, n, k] or
    [E, k, n]) and the shape (n, k) of one expert."""

    w: jax.Array
    transposed: bool = dataclasses.field(metadata=dict(static=True))
    experts: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: a plain matrix

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.w.shape[-2:]
        return (cols, rows) if self.transposed else (rows, cols)

    @property
    def nbytes(self) -> int:
        return int(self.w.size * self.w.dtype.itemsize)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A block-format [n, k] matrix as value = q * a (+ b), bit-exact with the GGUF's
    dequantization (the format's integer form, planes.Format.ints), stored in `chunks` slices
    along k, each contiguous: q int8 [chunks, n, k / chunks], a (and b) f32 [chunks, n,
    k / chunks / group] per group of consecutive weights along k. XLA's CPU fuses the decode
    into a one-row dot only while that row's slice of x stays under 16 KiB (quant/int8_dot.py),
    hence the chunks. dense: the same values as a DenseWeight for matmuls of many rows (prefill),
    where XLA decodes int8 far slower than it reads f32; None where only one row at a time reads
    the matrix (the vocabulary). (docs/ARCHITECTURE.md, "CPU: int8 weights")"""

    q: jax.Array
    a: jax.Array
    b: jax.Array | None
    dense: DenseWeight | None = None

    @classmethod
    def from_parts(cls, q, a, b, chunks: int = 1, dense: DenseWeight | None = None):
        """From q [n, k], a / b [n, k / group] (numpy or jax), cut into `chunks` slices along k."""

        def cut(v):
            n, k = v.shape
            return v.reshape(n, chunks, k // chunks).transpose(1, 0, 2)

        return cls(cut(q), cut(a), None if b is None else cut(b), dense)

    @property
    def experts(self) -> int:
        return 0  # expert tensors stay dense (model/weights.py)

    @property
    def chunks(self) -> int:
        return int(self.q.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        c, n, kc = self.q.shape
        return (int(n), int(c * kc))

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.a, self.b)
        own = int(sum(x.size * x.dtype.itemsize for x in parts if x is not None))
        return own + (0 if self.dense is None else self.dense.nbytes)

    def chunk_values(self, c: int) -> jax.Array:
        """The f32 values [n, k / chunks] of slice c."""
        return _int8_values(self.q[c], self.a[c], None if self.b is None else self.b[c])

    def values(self) -> jax.Array:
        """The f32 values [n, k]."""
        return jnp.concatenate([self.chunk_values(c) for c in range(self.chunks)], axis=-1)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Values of rows ids [...] -> [..., k] f32 (an embedding lookup)."""
        flat = ids.reshape(-1)
        b = None if self.b is None else self.b[:, flat]
        picked = Int8Weight(self.q[:, flat], self.a[:, flat], b)
        return picked.values().reshape(*ids.shape, -1)


def _int8_values(q: jax.Array, a: jax.Array, b: jax.Array | None) -> jax.Array:
    """q int8 [n, k], a / b [n, k / g] -> f32 [n, k] = q * a (+ b) per group of g."""
    n, k = q.shape
    g = k // a.shape[1]
    v = q.reshape(n, k // g, g).astype(jnp.float32) * a[:, :, None]
    v = v if b is None else v + b[:, :, None]
    return v.reshape(n, k)


Weight = QWeight | DenseWeight | Int8Weight


def expert_weight(w: Weight, e: int | jax.Array) -> Weight:
    """Expert e of an expert tensor as a plain [n, k] weight (e may be traced: a dynamic index)."""
    if isinstance(w, QWeight):
        return QWeight({n: p[e] for n, p in w.planes.items()}, w.qtype, w.shape)
    if isinstance(w, Int8Weight):
        raise ValueError("expert tensors are not held as Int8Weight")
    return DenseWeight(w.w[e], w.transposed)


def embed_rows(w: Weight, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table as f32: ids [...] -> [..., d]."""
    if isinstance(w, (QWeight, Int8Weight)):
        return w.rows(ids)
    if w.transposed:
        raise ValueError("embedding tables are stored [vocab, d]")
    return w.w[ids].astype(jnp.float32)
