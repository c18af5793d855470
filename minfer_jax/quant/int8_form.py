"""The CPU's weight form, decided here: which GGUF matrices become an `Int8Weight`, and the
conversion from GGUF bytes (through the format's integer form, so the values are bit-exact with
`planes.dequantize`).

The vocabulary matrices (token_embd, output) of a block format whose integer form fits int8
(Q4_0 ... Q8_0, the K-quants, IQ4_NL, IQ4_XS; not MXFP4, whose scales leave f32's exact range).
They are read one row at a time (a lookup; the head for the last token), where XLA's CPU dot runs
with q * a (+ b) decoded inside it and streams about a quarter of the f32 bytes (the 0.5B's head:
4.4 vs 16.8 ms alone). The layer matrices stay dense f32: a prefill chunk reads them at many rows,
where XLA CPU decodes int8 into f32 far slower than it reads f32 (2-4x the f32 GEMM's time at
64-256 rows; docs/BENCHMARKS.md, "The int8 CPU weight form").
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
    """Whether a weight of this format can be held as an Int8Weight."""
    fmt = FORMATS.get(QType(qtype))
    return fmt is not None and fmt.ints is not None and fmt.exact_f32 is None


INT8_TENSORS = ("token_embd.weight", "output.weight")


def takes_int8(name: str, qtype) -> bool:
    """Whether the GGUF tensor `name` is held as an Int8Weight on the CPU (module docstring)."""
    return name in INT8_TENSORS and holds_int8(qtype)


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


def int8_weight(raw, qtype, shape: Sequence[int], device) -> Int8Weight:
    """One GGUF tensor [n, k] as an Int8Weight on `device`."""
    q, a, b = int8_parts(raw, qtype, shape)
    put = functools.partial(jax.device_put, device=device)
    return Int8Weight(put(q), put(a), None if b is None else put(b))
