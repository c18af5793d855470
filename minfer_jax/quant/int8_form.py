"""The CPU's weight form, decided here: which GGUF matrices become an `Int8Weight`, and the
conversion from GGUF bytes (through the format's integer form, so the values are bit-exact with
`planes.dequantize`).

Every matrix of a block format whose integer form fits int8 (Q4_0 ... Q8_0, the K-quants,
IQ4_NL, IQ4_XS; not MXFP4, whose scales leave f32's exact range), outside expert tensors. A
decode step reads each one row at a time, where XLA's CPU dot runs with q * a (+ b) decoded
inside it and streams about a quarter of the f32 bytes (quant/int8_dot.py). The layer matrices
also keep their dense f32 copy (Int8Weight.dense): a prefill chunk reads them at many rows, where
XLA CPU decodes int8 into f32 far slower than it reads f32 (2-4x the f32 GEMM's time at 64-256
rows; docs/BENCHMARKS.md, "The int8 CPU weight form"). The vocabulary matrices (token_embd,
output) have none: only one row at a time reads them (a lookup; the head for the last token).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.quant.int8_dot import chunks_for
from minfer_jax.quant.matrix import DenseWeight, Int8Weight
from minfer_jax.quant.planes import FORMATS, QType, get_format, repack

ROW_CHUNK = 16384  # rows decoded per jitted call: bounds the int32 transient of a vocab matrix


def holds_int8(qtype) -> bool:
    """Whether a weight of this format can be held as an Int8Weight."""
    fmt = FORMATS.get(QType(qtype))
    return fmt is not None and fmt.ints is not None and fmt.exact_f32 is None


VOCABULARY = ("token_embd.weight", "output.weight")  # int8 alone, no dense copy


def takes_int8(name: str, qtype) -> bool:
    """Whether the GGUF matrix `name` (not an expert tensor) is held as an Int8Weight on the CPU
    (module docstring); gemma4's per-layer embedding table stays dense."""
    return (name in VOCABULARY or name.startswith("blk.")) and holds_int8(qtype)


def keeps_dense(name: str) -> bool:
    """Whether an Int8Weight of the GGUF matrix `name` keeps its dense f32 copy (module
    docstring)."""
    return name not in VOCABULARY


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


def stacked_parts(parts: Sequence[tuple]):
    """Several tensors' int8 parts (q, a, b), stacked along the rows: the smallest group of
    them, and an offset of 0 where a member has none but another has (q * a + 0 is q * a)."""
    if len(parts) == 1:
        return parts[0]
    group = min(q.shape[1] // a.shape[1] for q, a, _ in parts)

    def regroup(v, q):  # per-group values [n, k / g] -> [n, k / group]
        return np.repeat(v, q.shape[1] // v.shape[1] // group, axis=1)

    q = np.concatenate([qi for qi, _, _ in parts])
    a = np.concatenate([regroup(ai, qi) for qi, ai, _ in parts])
    if all(bi is None for _, _, bi in parts):
        return q, a, None
    zero = np.zeros_like
    b = np.concatenate([regroup(zero(ai) if bi is None else bi, qi) for qi, ai, bi in parts])
    return q, a, b


def int8_weight(tensors: Sequence, device, dense: DenseWeight | None = None) -> Int8Weight:
    """GGUF tensors (RawTensor, each [n_i, k]) stacked along the rows as one Int8Weight on
    `device`, stored in int8_dot.chunks_for slices along k, with the dense copy given."""
    q, a, b = stacked_parts([int8_parts(t.data, t.qtype, t.shape) for t in tensors])
    chunks = chunks_for(q.shape[1], q.shape[1] // a.shape[1])
    w = Int8Weight.from_parts(q, a, b, chunks)
    put = functools.partial(jax.device_put, device=device)
    return Int8Weight(put(w.q), put(w.a), None if w.b is None else put(w.b), dense)
