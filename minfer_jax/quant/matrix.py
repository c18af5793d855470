"""One weight matrix as it sits on the device, the pytrees every matmul route reads (ops.py) and the
model holds (model/weights.py): `QWeight`, its GGUF format repacked into planes (quant/planes.py),
or `DenseWeight`, dequantized once. Below ops and the model, so neither has to import the other's
layer to name a weight."""

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


Weight = QWeight | DenseWeight


def expert_weight(w: Weight, e: int | jax.Array) -> Weight:
    """Expert e of an expert tensor as a plain [n, k] weight (e may be traced: a dynamic index)."""
    if isinstance(w, QWeight):
        return QWeight({n: p[e] for n, p in w.planes.items()}, w.qtype, w.shape)
    return DenseWeight(w.w[e], w.transposed)


def embed_rows(w: Weight, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table as f32: ids [...] -> [..., d]."""
    if isinstance(w, QWeight):
        return w.rows(ids)
    if w.transposed:
        raise ValueError("embedding tables are stored [vocab, d]")
    return w.w[ids].astype(jnp.float32)
