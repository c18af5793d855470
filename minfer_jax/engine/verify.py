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
`accept_drafts` is that rule for a batch of such rows, this step's and verify_batch.py's.

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
    drafts = drafts.astype(jnp.int32)
    tokens = jnp.concatenate([state.last_token[slot][None], drafts])
    logits, hidden, cache, snapshots = forward_rows(
        params, tokens, slot, position, cache, cfg, impl, span, par
    )
    one = (1,)  # the sequence as a batch of one row
    drawn, n_out, state = accept_drafts(
        par, logits, state, jnp.reshape(slot, one), jnp.reshape(position, one), drafts[None],
        jnp.reshape(n_draft, one), rows, mode,
    )  # fmt: skip
    n_accepted = n_out[0] - 1
    cache = keep_snapshot(cache, snapshots, slot, n_accepted)  # the state after the last fed row
    if mtp:
        cache = catch_up(params, cache, drafts, hidden, slot, position, n_accepted, cfg, impl)
    return drawn[0], n_out[0], state, cache


def accept_drafts(
    par,
    logits: jax.Array,
    state: SlotState,
    slots: jax.Array,
    positions: jax.Array,
    drafts: jax.Array,
    n_draft: jax.Array,
    rows: RowSettings,
    mode: SamplerMode,
) -> tuple[jax.Array, jax.Array, SlotState]:
    """The sampling and acceptance of a verification (the module docstring): batch row b fed
    slots[b]'s last token and drafts[b] [K] int32 (n_draft[b] real) at positions[b] + 0..K, which
    gave logits [B * (1 + K), V]; rows: each batch row's sampler settings ([B] each).

    Returns (tokens [B, K + 1] int32, n_out [B] int32, state): tokens[b, :n_out[b]] are row b's
    accepted drafts followed by the model's own next token; each slot's last token and
    repeat-penalty history advance by its n_out tokens.
    """
    n_rows, k = drafts.shape
    per_row = k + 1
    offsets = jnp.arange(per_row, dtype=jnp.int32)
    at = positions[:, None] + offsets
    every_row = jax.tree.map(lambda a: jnp.repeat(a, per_row, axis=0), rows)
    width = state.history.shape[1] if mode.penalty else 0
    base = state.history[slots] if mode.penalty else jnp.zeros((n_rows, 0), jnp.int32)
    # forward row (b, i)'s penalty window: b's history with its drafts 1..i appended
    window = jnp.concatenate([base, drafts], axis=1)
    history = jax.vmap(
        lambda w: jax.vmap(lambda i: jax.lax.dynamic_slice_in_dim(w, i, width))(offsets)
    )(window).reshape(n_rows * per_row, width)
    drawn = _sample(par, logits, at.reshape(-1) + 1, every_row, history, mode)
    drawn = drawn.reshape(n_rows, per_row)
    match = (drawn[:, :-1] == drafts) & (offsets[None, :-1] < n_draft[:, None])
    n_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    n_out = n_accepted + 1
    last = jnp.take_along_axis(drawn, n_accepted[:, None], axis=1)[:, 0]
    if mode.penalty:
        grown = jnp.concatenate([base, drawn], axis=1)
        kept = jax.vmap(lambda g, n: jax.lax.dynamic_slice_in_dim(g, n, width))(grown, n_out)
        new_history = state.history.at[slots].set(kept)
    else:
        new_history = state.history
    state = SlotState(last_token=state.last_token.at[slots].set(last), history=new_history)
    return drawn, n_out.astype(jnp.int32), state
