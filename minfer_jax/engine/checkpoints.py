"""Checkpoints of a hybrid model's recurrent state, for prefix reuse (as llama-server keeps them).

A Gated DeltaNet layer's state (model/deltanet.py) holds every token its slot ran and cannot be
cut back to a shared prefix the way K/V can (HYBRID_NOTES, section 4). So each slot keeps one copy
of its recurrent state (conv and delta, every DeltaNet layer), taken when a prompt's prefill ends,
with the prompt it covers. A later request in that slot whose prompt starts with that prompt and
goes on past it (a conversation's next turn) gets the copy back and prefills only the rest: the
slot's attention K/V before that position are still that prompt's (the slot's kept tokens start
with it). Any other request in a hybrid model is prefilled from position 0, which resets the state
(decoder.forward_chunk). Starting a request forgets its slot's checkpoint (its prefill overwrites
the K/V the checkpoint relies on). The copies cost one more recurrent state per slot on the device
(Qwen3.6-27B: 48 layers x 48 heads x 128 x 128 f32, ~150 MB a slot).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.model.cache import KVCache


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slot(dst: tuple, src: tuple, slot: jax.Array) -> tuple:
    """dst's arrays with slot `slot` (their leading axis) set from src's."""
    return tuple(d.at[slot].set(s[slot]) for d, s in zip(dst, src))


class Checkpoints:
    """One recurrent-state copy per slot, and the prompt each covers (see the module docstring)."""

    def __init__(self, cache: KVCache):
        self.conv = tuple(jnp.zeros_like(c) for c in cache.conv)
        self.delta = tuple(jnp.zeros_like(d) for d in cache.delta)
        # with the MTP block (model/mtp.py): its hidden state of the prompt's last token
        self.hidden = tuple(jnp.zeros_like(h) for h in cache.mtp[2:])
        self.tokens: dict[int, list[int]] = {}
        # compiled now, not on a server's loop thread later (take and restore share it)
        self.conv = _copy_slot(self.conv, cache.conv, np.int32(0))
        self.delta = _copy_slot(self.delta, cache.delta, np.int32(0))

    def take(self, cache: KVCache, slot: int, prompt: Sequence[int]) -> None:
        """Copy slot's state, which has just run `prompt` from position 0."""
        self.conv = _copy_slot(self.conv, cache.conv, np.int32(slot))
        self.delta = _copy_slot(self.delta, cache.delta, np.int32(slot))
        self.hidden = _copy_slot(self.hidden, cache.mtp[2:], np.int32(slot))
        self.tokens[slot] = list(prompt)

    def restore(self, cache: KVCache, slot: int, prompt: Sequence[int]) -> tuple[KVCache, int]:
        """(cache, the prompt tokens it now holds for slot): the slot's checkpoint put back where
        `prompt` extends the prompt it covers, else (cache, 0). Forgets the checkpoint anyway."""
        kept = self.tokens.pop(slot, [])
        if not kept or len(kept) >= len(prompt) or list(prompt[: len(kept)]) != kept:
            return cache, 0
        conv = _copy_slot(cache.conv, self.conv, np.int32(slot))
        delta = _copy_slot(cache.delta, self.delta, np.int32(slot))
        mtp = cache.mtp[:2] + _copy_slot(cache.mtp[2:], self.hidden, np.int32(slot))
        return dataclasses.replace(cache, conv=conv, delta=delta, mtp=mtp), len(kept)
