"""Grouped matmuls over an expert tensor in plain XLA: the routes ops.expert_matmul picks from.

An expert tensor is one weight with a leading expert axis (model/weights.py: QWeight / DenseWeight
with experts = E, shape (N, K) per expert). Every function here takes x [T, K] (one input row per
token, shared by its k chosen experts) or [T, k, K] (one row per chosen expert, as the down
projection gets), ids [T, k] int32 expert ids on the device, and returns [T, k, N] f32.

- `gather_matmul` (the reference): each token's k chosen matrices gathered, dequantized and
  multiplied. Correct for any T; reads T x k matrices, so it is the decode (few tokens) path.
- `tiled_matmul`: the T x k rows sorted by expert on the device, each expert's rows padded to
  whole tiles of TILE_ROWS, one [TILE_ROWS, K] x [K, N] dot per tile in a scan whose tiles past the
  used ones are skipped; reads about T x k / TILE_ROWS + E matrices, once each. The CPU's prefill.
On the kernels, quantized experts take pallas/expert_gemv.py and pallas/expert_gemm.py instead
(ops.expert_route).
No host sync and no data-dependent shape anywhere: the sort, group sizes and tile table are
device arrays of static shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax.pallas import expert_kernels
from minfer_jax.quant.matrix import DenseWeight, Weight
from minfer_jax.quant.planes import decode, get_format

TILE_ROWS = 16  # rows per tile of tiled_matmul: few enough that padding each expert costs little


# expert_glu's activations by name, (gate, up) -> the down projection's input: the ones the fused
# kernel applies (SwiGLU "silu", gpt-oss's clamped "swiglu_oai"), one definition for every route
GLU_ACTIVATIONS = expert_kernels.GLU_ACTIVATIONS


def _compute_dtype(w: Weight):
    """The dtype a weight's values are multiplied in: the stored dtype (dense) or the format's
    kernel compute dtype (as ops.matmul's "xla" route decodes)."""
    return w.w.dtype if isinstance(w, DenseWeight) else get_format(w.qtype).compute_dtype


def expert_matrices(w: Weight, ids: jax.Array, dtype=None) -> jax.Array:
    """The matrices of experts ids [...] -> [..., N, K] in dtype (default _compute_dtype(w))."""
    dtype = dtype or _compute_dtype(w)
    if isinstance(w, DenseWeight):
        m = w.w[ids]
        return (jnp.swapaxes(m, -1, -2) if w.transposed else m).astype(dtype)
    n, k = w.shape
    flat = ids.reshape(-1)
    tiles = {name: p[flat] for name, p in w.planes.items()}  # [M, Npad, cols]
    rows = next(iter(tiles.values())).shape[1]
    vals = decode(w.qtype, {name: t.reshape(-1, t.shape[-1]) for name, t in tiles.items()}, dtype)
    return vals.reshape(*ids.shape, rows, k)[..., :n, :]


def _rows_per_choice(x: jax.Array, k: int) -> jax.Array:
    """x [T, K] or [T, k, K] -> [T, k, K]: each chosen expert's input row."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], k, x.shape[-1])) if x.ndim == 2 else x


def gather_matmul(x: jax.Array, w: Weight, ids: jax.Array) -> jax.Array:
    """The reference: each (token, choice)'s matrix gathered and multiplied -> [T, k, N] f32."""
    m = expert_matrices(w, ids)  # [T, k, N, K]
    xs = _rows_per_choice(x, ids.shape[1]).astype(m.dtype)
    return jnp.einsum("tjk,tjnk->tjn", xs, m, preferred_element_type=jnp.float32)


def sort_by_expert(ids: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """ids [T, k] -> (order [T k]: the flat (token, choice) indices grouped by expert, stably;
    group_sizes [E] int32: rows per expert)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def _sorted_rows(x: jax.Array, order: jax.Array, k: int) -> jax.Array:
    """The input rows in sorted order: [T k, K]."""
    return x.reshape(-1, x.shape[-1])[order] if x.ndim == 3 else x[order // k]


def _unsort(y: jax.Array, order: jax.Array, ids_shape) -> jax.Array:
    """Sorted rows [T k, N] back to [T, k, N]."""
    inverse = jnp.argsort(order)
    return y[inverse].reshape(*ids_shape, y.shape[-1])


def tile_table(ids: jax.Array, n_experts: int, tile: int = TILE_ROWS):
    """Where tiled_matmul puts each sorted row: (order [M], dest [M]: the row's slot in the padded
    buffer, tile_expert [n_tiles], tile_used [n_tiles] bool), M = T k. Each expert's rows start
    at a tile boundary; n_tiles = ceil((M + E (tile - 1)) / tile) bounds any routing."""
    m = ids.size
    order, sizes = sort_by_expert(ids, n_experts)
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(sizes) - sizes, padded_end - padded
    expert = ids.reshape(-1)[order]
    dest = padded_start[expert] + jnp.arange(m) - start[expert]
    n_tiles = -(-(m + n_experts * (tile - 1)) // tile)
    first_row = jnp.arange(n_tiles) * tile
    tile_expert = jnp.searchsorted(padded_end, first_row, side="right")
    return order, dest, jnp.minimum(tile_expert, n_experts - 1), first_row < padded_end[-1]


def tiled_matmul(x: jax.Array, w: Weight, ids: jax.Array, tile: int = TILE_ROWS) -> jax.Array:
    """Rows sorted by expert into whole tiles, one dot per used tile (a scan) -> [T, k, N]."""
    order, dest, tile_expert, tile_used = tile_table(ids, w.experts, tile)
    rows = _sorted_rows(x, order, ids.shape[1])
    n_tiles, n = tile_expert.shape[0], w.shape[0]
    buf = jnp.zeros((n_tiles * tile, rows.shape[-1]), rows.dtype).at[dest].set(rows)

    def one_tile(_, xs):
        xt, e, used = xs

        def product():
            m = expert_matrices(w, e[None])[0]  # [N, K]: one expert, dynamically indexed
            return jnp.dot(xt.astype(m.dtype), m.T, preferred_element_type=jnp.float32)

        return None, jax.lax.cond(used, product, lambda: jnp.zeros((tile, n), jnp.float32))

    _, ys = jax.lax.scan(one_tile, None, (buf.reshape(n_tiles, tile, -1), tile_expert, tile_used))
    return _unsort(ys.reshape(-1, n)[dest], order, ids.shape)


def weighted_sum(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y [T, k, N] x routing weights [T, k] -> [T, N]: summed in slot order, as llama.cpp's
    build_moe_ffn adds its k views."""
    out = y[:, 0] * weights[:, 0:1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * weights[:, j : j + 1]
    return out


def add_bias(y: jax.Array, bias: jax.Array | None, ids: jax.Array) -> jax.Array:
    """y [T, k, N] plus each chosen expert's bias (bias [E, N]; y itself without one)."""
    return y if bias is None else y + bias[ids].astype(jnp.float32)
