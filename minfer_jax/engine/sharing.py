"""n > 1 choices from one prefill: a follower request (Request.leader) waits until its leader's
prompt is dispatched, then starts from a copy of the leader's slot and prefills only its last
prompt token (which yields its own first token, drawn with its own seed).

The copy takes every position of the slot: what the leader wrote past the shared prompt (its
decode) lies where the follower writes before it reads, as after any prefix reuse. Not used where
the scheduler reuses no prefix (the deterministic mode) or keeps recurrent state (a hybrid model's
state holds every token its slot ran, so a copy taken mid-decode is not the prompt's): there a
follower prefills its whole prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from minfer_jax.engine.request import Request
from minfer_jax.model.cache import KVCache


def _copy(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """cache with slot dst (every leaf's leading axis) set to slot src."""
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), cache)


def slot_copier(cache: KVCache) -> Callable[[KVCache, Any, Any], KVCache]:
    """copy(cache, src, dst) for caches laid out as this one (its shardings kept: a tensor
    parallel cache stays split by heads), compiled now (once per layout), not on a server's loop
    thread later."""
    leaves, treedef = jax.tree.flatten(cache)
    compiled = _compiled_copy(treedef, tuple((a.shape, a.dtype, a.sharding) for a in leaves))
    return lambda c, src, dst: compiled(c, np.int32(src), np.int32(dst))


@functools.cache
def _compiled_copy(treedef, layout: tuple):
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for shape, dtype, s in layout]
    shardings = jax.tree.unflatten(treedef, [s for _, _, s in layout])
    copy = jax.jit(_copy, donate_argnums=0, out_shardings=shardings)
    i32 = jax.ShapeDtypeStruct((), np.int32)
    return copy.lower(jax.tree.unflatten(treedef, specs), i32, i32).compile()


def waits_for_leader(req: Request) -> bool:
    """req shares a prefill whose prompt is not dispatched yet (the leader has not produced its
    first token and is not done)."""
    leader = req.leader
    return leader is not None and leader.produced == 0 and not leader.done.is_set()


def shared_prefix(req: Request) -> int:
    """Prompt tokens req can take from its leader's live slot (0: none; at least one token is
    prefilled: it yields the first token's logits)."""
    leader = req.leader
    if leader is None or leader.slot is None or leader.produced == 0 or leader.chunks:
        return 0
    return min(common_prefix(leader.prompt, req.prompt), len(req.prompt) - 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
