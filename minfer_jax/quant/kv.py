"""8-bit KV cache: one layer's K or V held as 8-bit values plus a scale per block of a row.

Two kinds (`KV_TYPES`), chosen by the command line's -ctk / -ctv:
- "q8_0": llama.cpp's layout and rounding (ggml's quantize_row_q8_0): blocks of 32 values of a
  head's row, one f16 scale d = amax / 127 per block, int8 quants round(x / d) (half away from
  zero, from f32 x and the f32 d's inverse).
- "fp8": float8_e4m3fn values with one f16 scale per head row (amax / 448). e4m3 carries its own
  exponent, so a finer scale buys little; one scale per row keeps the scale array a 128th of the
  values and the kernels' dequantization one multiply per key.
rotated (the default, as llama.cpp's "attention rotation" since its PR 21038): K and Q (V and the
attention's output) are multiplied by an orthonormal Hadamard matrix of head_dim (`hadamard`)
before K (V) is stored, which leaves q.k and P.V unchanged but spreads a row's outliers over all
its values: the built-in 0.5B's layer-0 K holds values near 145 beside ones near 1, and unrotated
q8_0 K moved its next-token distributions by a mean KL of 0.56 nats (llama.cpp unrotated: 0.46),
rotated 0.003 (llama.cpp: 0.004). q8_0 only (ROTATED_TYPES): fp8 keeps each value's relative
precision, so rotating spreads the outliers' error instead (fp8 K + V: 0.008 unrotated, 1.85
rotated; 2026-12-07, tools/kv_quality.py, this CPU, first 6 prompts).
A QuantizedKV stands where the float cache array stood ([n_slots, Hkv, max_len, head_dim] values,
[n_slots, Hkv, max_len, head_dim / block] scales); `dtype` is the float dtype it dequantizes to
(the attention's compute dtype: f16 on a GPU, f32 on a CPU), `shape` the values' shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.errors import InvalidArgumentError

Q8_0, FP8 = "q8_0", "fp8"
KV_TYPES = (Q8_0, FP8)
ROTATED_TYPES = (Q8_0,)  # stored Hadamard-rotated unless told otherwise (see above)
Q8_0_BLOCK = 32  # ggml's QK8_0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
VALUE_DTYPES = {Q8_0: jnp.int8, FP8: jnp.float8_e4m3fn}
SCALE_DTYPE = jnp.float16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    values: jax.Array  # [n_slots, Hkv, max_len, head_dim] int8 (q8_0) or float8_e4m3fn (fp8)
    scales: jax.Array  # [n_slots, Hkv, max_len, head_dim / block] f16
    dtype: np.dtype = dataclasses.field(metadata={"static": True}, default=np.dtype(np.float16))
    rotated: bool = dataclasses.field(metadata={"static": True}, default=False)  # by `hadamard`

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def kind(self) -> str:
        return Q8_0 if jnp.dtype(self.values.dtype) == jnp.int8 else FP8

    @property
    def block(self) -> int:
        """Values per scale along head_dim."""
        return self.values.shape[-1] // self.scales.shape[-1]


def block_size(kind: str, head_dim: int) -> int:
    return Q8_0_BLOCK if kind == Q8_0 else head_dim


def check_kind(kind: str, head_dim: int) -> None:
    """Raise InvalidArgumentError unless `kind` is a KV_TYPES entry this head_dim can hold."""
    if kind not in KV_TYPES:
        raise InvalidArgumentError(f"KV cache type {kind!r}: expected one of {', '.join(KV_TYPES)}")
    if head_dim % block_size(kind, head_dim):
        raise InvalidArgumentError(
            f"KV cache type {kind}: head_dim {head_dim} is not a multiple of {Q8_0_BLOCK}"
        )


def spec(kind: str, shape: tuple[int, ...], dtype, rotated: bool = False) -> QuantizedKV:
    """The abstract QuantizedKV of a float cache shape [..., head_dim] (for lowering)."""
    blocks = shape[-1] // block_size(kind, shape[-1])
    return QuantizedKV(
        values=jax.ShapeDtypeStruct(shape, VALUE_DTYPES[kind]),  # type: ignore[arg-type]
        scales=jax.ShapeDtypeStruct((*shape[:-1], blocks), SCALE_DTYPE),  # type: ignore[arg-type]
        dtype=np.dtype(dtype),
        rotated=rotated,
    )


def hadamard(n: int) -> np.ndarray:
    """The orthonormal (Sylvester) Hadamard matrix of size n, a power of two: symmetric, its own
    inverse."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise InvalidArgumentError(f"a rotated KV cache needs a power-of-two head_dim, got {n}")
    return h / np.float32(np.sqrt(n))


def rotate(x: jax.Array) -> jax.Array:
    """x [..., head_dim] times hadamard(head_dim) in f32 (applying it twice gives x back)."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    return jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)


def roundf(x: jax.Array) -> jax.Array:
    """C's roundf (half away from zero) as gguf-py's np_roundf computes it, bit for bit."""
    a = jnp.abs(x)
    floored = jnp.floor(a)
    b = floored + jnp.floor(2 * (a - floored))
    return jnp.where(x < 0, -b, b)


def scale_of(amax: jax.Array, kind: str) -> jax.Array:
    """The f32 scale d of a block whose largest magnitude is amax."""
    return amax / (127.0 if kind == Q8_0 else FP8_MAX)


def quantize_with(x: jax.Array, d: jax.Array, kind: str) -> jax.Array:
    """x (f32) / d (broadcast against it) -> the 8-bit values, times the f32 d's inverse as ggml
    does (d = 0: zeros)."""
    inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    scaled = x * inverse
    if kind == Q8_0:
        return roundf(scaled).astype(jnp.int8)
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def quantize(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] (any float) -> (values [..., head_dim], scales [..., head_dim / block])."""
    x = x.astype(jnp.float32)
    block = block_size(kind, x.shape[-1])
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    d = scale_of(jnp.max(jnp.abs(blocks), axis=-1), kind)
    values = quantize_with(blocks, d[..., None], kind)
    return values.reshape(x.shape), d.astype(SCALE_DTYPE)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """(values [..., hd], scales [..., hd / block]) -> f32 [..., hd]: each value times its scale."""
    hd, n_blocks = values.shape[-1], scales.shape[-1]
    blocks = values.astype(jnp.float32).reshape(*values.shape[:-1], n_blocks, hd // n_blocks)
    return (blocks * scales.astype(jnp.float32)[..., None]).reshape(values.shape)


def dequantized(cache: QuantizedKV) -> jax.Array:
    """The whole cache in f32."""
    return dequantize(cache.values, cache.scales)
