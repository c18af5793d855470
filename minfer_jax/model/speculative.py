"""The forward of a speculative verification: T tokens of one sequence as decode rows, with the
recurrent layers' state after each token kept, so a rejected draft can be rolled back.

Attention layers need no undo (a rejected row's K/V lie past the accepted positions and are
written again before any query sees them). A Gated DeltaNet layer's state (model/deltanet.py)
has taken every token it ran, so here it runs the rows one after another (deltanet.mix_rows, the
decode step's math, bit for bit), keeps its conv and delta states after each row as snapshots
[T, ...] and leaves the slot's own state untouched; once acceptance is known, `keep_snapshot`
sets the slot's state to the snapshot after the last accepted row, on the device (a dynamic
index: one executable serves every acceptance count). The snapshots cost T x one sequence's
recurrent state while the step runs (Qwen3.6-35B-A3B: 30 layers x 2 MiB per row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model import deltanet
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.decoder import forward_decode_hidden
from minfer_jax.model.weights import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshots:
    """Per DeltaNet layer (cache.conv / cache.delta order), its states after each of T rows:
    conv [T, K - 1, conv_dim], delta [T, Hv, dk, dv]. Empty for attention-only models."""

    conv: tuple[jax.Array, ...] = ()
    delta: tuple[jax.Array, ...] = ()


def forward_rows(
    params: Params,
    tokens: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    cache: KVCache,
    cfg: Config,
    impl: ops.Impl,
    span: int | None = None,
    par=None,
) -> tuple[jax.Array, jax.Array, KVCache, Snapshots]:
    """tokens [T] of sequence `slot` at positions start + [0, T) as T decode rows -> (logits
    [T, vocab], the final normed hidden states [T, d], cache, Snapshots). The cache's K/V hold
    all T rows; its recurrent states are the slot's before the rows (keep_snapshot sets them)."""
    t = tokens.shape[0]
    positions = start + jnp.arange(t, dtype=jnp.int32)
    slots = jnp.full((t,), slot, jnp.int32)
    if not cfg.recurrent_layer_ids:
        logits, hidden, cache = forward_decode_hidden(
            params, tokens, slots, positions, cache, cfg, impl, span, par
        )
        return logits, hidden, cache, Snapshots()
    if impl.deterministic and impl.kernels != "pallas":
        return _one_row_at_a_time(params, tokens, slot, positions, cache, cfg, impl, span, par)
    convs: list[jax.Array] = []
    deltas: list[jax.Array] = []

    unroll = impl.kernels == "pallas" and not impl.deterministic

    def recur(proj, w, conv, delta):  # called once per DeltaNet layer, in layer order
        out, c, s = deltanet.mix_rows(proj, w, conv[slot], delta[slot], cfg, unroll)
        convs.append(c)
        deltas.append(s)
        return out, conv, delta

    logits, hidden, cache = forward_decode_hidden(
        params, tokens, slots, positions, cache, cfg, impl, span, par, recur=recur
    )
    return logits, hidden, cache, Snapshots(tuple(convs), tuple(deltas))


def _one_row_at_a_time(params, tokens, slot, positions, cache, cfg, impl, span, par):
    """The deterministic XLA path's rows (forward_decode runs them one by one there too), the
    slot's states taken after each; the slot's state is put back as it was."""
    conv0 = tuple(c[slot] for c in cache.conv)
    delta0 = tuple(d[slot] for d in cache.delta)

    def one_row(cache, row):
        token, position = row
        logits, hidden, cache = forward_decode_hidden(
            params, token[None], slot[None], position[None], cache, cfg, impl, span, par
        )
        states = (tuple(c[slot] for c in cache.conv), tuple(d[slot] for d in cache.delta))
        return cache, (logits[0], hidden[0], states)

    cache, (logits, hidden, (convs, deltas)) = jax.lax.scan(one_row, cache, (tokens, positions))
    cache = _set_slot(cache, slot, conv0, delta0)
    return logits, hidden, cache, Snapshots(convs, deltas)


def keep_snapshot(cache: KVCache, snapshots: Snapshots, slot, index) -> KVCache:
    """The cache with slot's recurrent states set to those after row `index` (traced)."""
    if not snapshots.conv:
        return cache
    conv = tuple(s[index] for s in snapshots.conv)
    delta = tuple(s[index] for s in snapshots.delta)
    return _set_slot(cache, slot, conv, delta)


def _set_slot(cache: KVCache, slot, conv, delta) -> KVCache:
    return dataclasses.replace(
        cache,
        conv=tuple(c.at[slot].set(s) for c, s in zip(cache.conv, conv)),
        delta=tuple(d.at[slot].set(s) for d, s in zip(cache.delta, delta)),
    )
