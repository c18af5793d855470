"""The CPU's weight form, decided here: which GGUF formats become an `Int8Weight`, stored in which
orientation, and the conversion from GGUF bytes (through the format's integer form, so the values
are bit-exact with `planes.dequantize`).

Every block format whose integer form fits int8 qualifies (Q4_0 ... Q8_0, the K-quants, IQ4_NL,
IQ4_XS); MXFP4 (its scales leave f32's exact range) and the float formats stay dense f32. On the
2-core CPU XLA fuses q * a (+ b) into its matrix-vector dot, which then streams a quarter of the
f32 bytes; its speed depends on the orientation (docs/ARCHITECTURE.md, "CPU: int8 weights"), so
matrices with more inputs than outputs (ffn_down) are stored [k, n], the others [n, k].
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.quant.matrix import Int8Weight
from minfer_jax.quant.planes import FORMATS, QType, get_format, repack

ROW_CHUNK = 16384  # rows decoded per jitted call: bounds the int32 transient of a vocab matrix


def holds_int8(qtype) -> bool:
    """Whether a weight of this format is held as an Int8Weight on the CPU."""
    fmt = FORMATS.get(QType(qtype))
    return fmt is not None and fmt.ints is not None and fmt.exact_f32 is None


def stored_transposed(n: int, k: int) -> bool:
    """[k, n] for narrowing matrices: XLA CPU's fused dot ran 896 x 4864 in 0.29 ms stored [k, n]
    vs 2.6 ms [n, k]; square and widening ones the other way (9728 x 896: 0.24 vs 1.4 ms)."""
    return k > n


@functools.partial(jax.jit, static_argnames=("qtype",))
def _ints(tiles, qtype: QType):
    q, a, b = get_format(qtype).ints(tiles, jnp.float32)
    return q.astype(jnp.int8), a, b


def int8_parts(raw, qtype, shape: Sequence[int]):
    """One GGUF tensor [n, k] -> numpy (q int8 [n, k], a f32 [n, k / g], b f32 or None)."""
    qtype = QType(qtype)
    n, k = int(shape[0]), int(shape[1])
    planes = repack(np.asarray(raw), qtype, (n, k))  # rows padded past n
    parts = []
    for r0 in range(0, n, ROW_CHUNK):
        tiles = {name: p[r0 : min(r0 + ROW_CHUNK, n)] for name, p in planes.items()}
        parts.append(jax.device_get(_ints(tiles, qtype)))
    q = np.concatenate([p[0] for p in parts])
    a = np.concatenate([p[1] for p in parts])
    b = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])
    return q, a, b


def _at_group(a: np.ndarray, g: int, to: int) -> np.ndarray:
    """Per-group values of groups of g weights as groups of `to` (g a multiple of to): each
    repeated, so the decoded values do not change."""
    return np.repeat(a, g // to, axis=1)


def int8_weight(members: Sequence[tuple], device) -> Int8Weight:
    """Tensors (raw bytes, qtype, (n_i, k)) stacked along the rows as one Int8Weight: formats may
    differ (q / k in Q5_0 beside v in Q8_0): groups meet at the smallest group size and a missing
    offset is +0 (q * a + 0 is q * a exactly)."""
    parts = [int8_parts(raw, qtype, shape) for raw, qtype, shape in members]
    k = parts[0][0].shape[1]
    groups = [k // a.shape[1] for _, a, _ in parts]
    g = min(groups)
    offsets = any(b is not None for _, _, b in parts)
    q = np.concatenate([p[0] for p in parts])
    a = np.concatenate([_at_group(p[1], gi, g) for p, gi in zip(parts, groups)])
    b = None
    if offsets:
        b = np.concatenate(
            [
                _at_group(p[2], gi, g) if p[2] is not None else np.zeros((p[0].shape[0], k // g))
                for p, gi in zip(parts, groups)
            ]
        ).astype(np.float32)
    n = q.shape[0]
    if stored_transposed(n, k):
        q, a = np.ascontiguousarray(q.T), np.ascontiguousarray(a.T)
        b = None if b is None else np.ascontiguousarray(b.T)
        transposed = True
    else:
        transposed = False
    put = functools.partial(jax.device_put, device=device)
    return Int8Weight(put(q), put(a), None if b is None else put(b), transposed)
