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
    """A [n, k] matrix in its quantized device layout: planes [Npad, k / wpc] (quant.planes)."""

    planes: dict[str, jax.Array]
    qtype: QType = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.planes.values()))

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized rows ids [...] -> [..., k] f32 (embedding lookup without a dense table)."""
        flat = ids.reshape(-1)
        vals = decode(self.qtype, {n: p[flat] for n, p in self.planes.items()}, jnp.float32)
        return vals.reshape(*ids.shape, self.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dequantized [n, k] matrix, stored as [n, k] (transposed=False) or [k, n]
    (transposed=True)."""

    w: jax.Array
    transposed: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.w.shape
        return (cols, rows) if self.transposed else (rows, cols)

    @property
    def nbytes(self) -> int:
        return int(self.w.size * self.w.dtype.itemsize)


Weight = QWeight | DenseWeight


def embed_rows(w: Weight, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table as f32: ids [...] -> [..., d]."""
    if isinstance(w, QWeight):
        return w.rows(ids)
    if w.transposed:
        raise ValueError("embedding tables are stored [vocab, d]")
    return w.w[ids].astype(jnp.float32)
