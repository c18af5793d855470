"""Speculative decoding's device step: verify k drafted tokens of one sequence in one forward.

    verify_chunk(params, cache, state, slot, position, drafts, n_draft, rows, *, cfg, impl, mode,
                 span)

The slot's last token and the drafts run as 1 + K rows of one decode step, every row in the same
slot at consecutive positions (forward_decode): each layer writes all rows' K/V before any row
attends, and row i attends over keys [0, position + i], which is causal attention over the chunk.
On the kernels 1 + K <= 8 rows take the GEMV, which reads the weights once for all of them: a
verification costs about one decode step.

Acceptance couples the draft with the plain sampler (sampling.sample_rows): row i draws the token
of position + i + 1 exactly as plain decoding would (the same logits up to batch rounding, the same
key from the seed and that position), and draft i + 1 is accepted iff it equals that draw. For a
greedy row that is greedy acceptance; for a sampled row it is the standard rejection rule for a
deterministic (one-hot) draft: d is accepted with probability p(d), and on a rejection the token
drawn is distributed as p with d removed, renormalised. The output distribution is unchanged
(and, with the same seed, so are the tokens wherever the batch's logits are the plain step's).

Rejected drafts leave K/V at positions past the accepted ones; the next step writes those positions
before any query can see them (keys are masked by position), so nothing needs undoing. Recurrent
layers (the hybrid families) keep their state after each row and the slot takes the one after the
last accepted token (model/speculative.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.engine.sampling import RowSettings, SamplerMode
from minfer_jax.engine.steps import SlotState, _sample
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.mtp import catch_up
from minfer_jax.model.mtp import draft as mtp_draft
from minfer_jax.model.speculative import forward_rows, keep_snapshot
from minfer_jax.model.weights import Params


def verify_chunk(
    params: Params,
    cache: KVCache,
    state: SlotState,
    slot: jax.Array,
    position: jax.Array,
    drafts: jax.Array,
    n_draft: jax.Array,
    rows: RowSettings,
    *,
    cfg: Config,
    impl: ops.Impl,
    mode: SamplerMode,
    span: int | None = None,
    par=None,
    mtp: bool = False,
) -> tuple[jax.Array, jax.Array, SlotState, KVCache]:
    """Feed slot's last token at `position` and drafts [K] (the first n_draft real, the rest
    padding) after it; rows: the sequence's sampler settings ([1] each).

    Returns (tokens [K + 1] int32, n_out [] int32, state, cache): tokens[:n_out] are the accepted
    drafts followed by the model's own next token (1 <= n_out <= n_draft + 1); the state's last
    token and repeat-penalty history advance by those n_out tokens. mtp: the file's MTP block
    drafts them here instead (model/mtp.py; `drafts` only gives their count).
    """
    if mtp:
        drafts, cache = mtp_draft(
            params, cache, state.last_token[slot], slot, position, drafts.shape[0], cfg, impl
        )
    n_rows = drafts.shape[0] + 1
    offsets = jnp.arange(n_rows, dtype=jnp.int32)
    tokens = jnp.concatenate([state.last_token[slot][None], drafts.astype(jnp.int32)])
    positions = position + offsets
    logits, hidden, cache, snapshots = forward_rows(
        params, tokens, slot, position, cache, cfg, impl, span, par
    )
    every_row = jax.tree.map(lambda a: jnp.repeat(a, n_rows, axis=0), rows)
    width = state.history.shape[1] if mode.penalty else 0
    base = state.history[slot] if mode.penalty else jnp.zeros((0,), jnp.int32)
    # row i's penalty window: the slot's history with drafts 1..i appended
    window = jnp.concatenate([base, drafts.astype(jnp.int32)])
    history = jax.vmap(lambda i: jax.lax.dynamic_slice_in_dim(window, i, width))(offsets)
    drawn = _sample(par, logits, positions + 1, every_row, history, mode)  # [K + 1]
    match = (drawn[:-1] == drafts) & (offsets[:-1] < n_draft)
    n_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    n_out = n_accepted + 1
    cache = keep_snapshot(cache, snapshots, slot, n_accepted)  # the state after the last fed row
    if mtp:
        cache = catch_up(params, cache, drafts, hidden, slot, position, n_accepted, cfg, impl)
    if mode.penalty:
        grown = jnp.concatenate([base, drawn])
        new_history = state.history.at[slot].set(jax.lax.dynamic_slice_in_dim(grown, n_out, width))
    else:
        new_history = state.history
    state = SlotState(
        last_token=state.last_token.at[slot].set(drawn[n_accepted]), history=new_history
    )
    return drawn, n_out.astype(jnp.int32), state, cache
