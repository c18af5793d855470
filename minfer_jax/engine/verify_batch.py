"""Speculation under continuous batching: one decode step in which every row of a batch verifies
its own draft and rows without one decode a single token.

    verify_batch(params, cache, state, slots, positions, drafts, n_draft, rows, *, cfg, impl, mode,
                 span)

Row b feeds its slot's last token at positions[b] and drafts[b] (the first n_draft[b] real, the
rest padding) after it: 1 + K forward rows in its slot at consecutive positions, B x (1 + K) rows
in one forward_decode. Each row's acceptance is verify.py's (the draft coupled with the plain
sampler's draw at each position: greedy acceptance, or the rejection rule for a sampled row), so a
row's tokens are the ones plain decoding gives it. A row with n_draft 0 is a plain decode step:
its one real token is the plain step's, and its K padding rows write K/V past its position that
the next step overwrites before any query can see them (verify.py's argument). Padded batch rows
sit in the scratch slot, as plain decode's do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.engine.sampling import RowSettings, SamplerMode
from minfer_jax.engine.steps import SlotState
from minfer_jax.engine.verify import accept_drafts
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.decoder import forward_decode
from minfer_jax.model.weights import Params


def verify_batch(
    params: Params,
    cache: KVCache,
    state: SlotState,
    slots: jax.Array,
    positions: jax.Array,
    drafts: jax.Array,
    n_draft: jax.Array,
    rows: RowSettings,
    *,
    cfg: Config,
    impl: ops.Impl,
    mode: SamplerMode,
    span: int | None = None,
    par=None,
) -> tuple[jax.Array, jax.Array, SlotState, KVCache]:
    """Rows [B] (slot slots[b], its last token at positions[b]) verify drafts [B, K] (n_draft [B]
    real each); rows: each row's sampler settings ([B] each).

    Returns (tokens [B, K + 1] int32, n_out [B] int32, state, cache): verify.accept_drafts's.
    """
    per_row = drafts.shape[1] + 1
    drafts = drafts.astype(jnp.int32)
    tokens = jnp.concatenate([state.last_token[slots][:, None], drafts], axis=1)  # [B, 1 + K]
    at = positions[:, None] + jnp.arange(per_row, dtype=jnp.int32)
    logits, cache = forward_decode(
        params,
        tokens.reshape(-1),
        jnp.repeat(slots, per_row),
        at.reshape(-1),
        cache,
        cfg,
        impl,
        span,
        par,
    )
    drawn, n_out, state = accept_drafts(
        par, logits, state, slots, positions, drafts, n_draft, rows, mode
    )
    return drawn, n_out, state, cache
