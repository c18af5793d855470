"""What the plan's executable keys share (plan.py, spec_plan.py): the record of a step over the
slots' cache and state (`StepKey`: decode and the verifications) and how a key lowers its step
(the abstract cache and state it is compiled for, its step function per device or per shard)."""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp

from minfer_jax.engine import steps
from minfer_jax.engine.sampling import SamplerMode
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.model.cache import cache_spec


class PlanError(InvalidArgumentError):
    """A plan setting (chunk, sequences, context, draft) outside what the engine supports."""


@dataclasses.dataclass(frozen=True)
class StepKey:
    """A step over the cache of n_slots slots of cache_len positions and their state (history:
    repeat-penalty entries per slot), in a sampler mode, attending over keys [0, span) (None: the
    kernels read [0, len) themselves). Its kinds add their sizes (rows, steps, drafts)."""

    n_slots: int
    cache_len: int
    history: int
    mode: SamplerMode
    span: int | None

    def serves(self, other) -> bool:
        """other is a step of this kind on the same cache and state, in a mode and window this
        one covers (each kind's `covers` adds its sizes)."""
        return (
            isinstance(other, type(self))
            and self.mode.covers(other.mode)
            and span_covers(self.span, other.span)
            and (self.n_slots, self.cache_len, self.history)
            == (other.n_slots, other.cache_len, other.history)
        )


def span_covers(mine: int | None, theirs: int | None) -> bool:
    """An executable reading keys [0, mine) serves one that reads [0, theirs) (None: the whole
    cache, which only a whole-cache executable serves)."""
    return theirs is None if mine is None else theirs is not None and mine >= theirs


def cache_of(model, key):
    """The abstract KV cache a key's executable is lowered for (per shard under tensor
    parallelism)."""
    if model.tp is not None:
        return model.tp.cache_spec(key.n_slots, key.cache_len, model.cache_dtype)
    return cache_spec(
        model.config,
        key.n_slots,
        key.cache_len,
        model.cache_dtype,
        model.kv_types,
        model.kv_rotation,
        model.has_mtp,
    )


def state_of(key):
    # abstract values (what the executable is lowered for), typed as the arrays they stand for
    return steps.SlotState(
        last_token=cast(jax.Array, jax.ShapeDtypeStruct((key.n_slots,), jnp.int32)),
        history=cast(jax.Array, jax.ShapeDtypeStruct((key.n_slots, key.history), jnp.int32)),
    )


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    """An int32 argument of this shape, as an executable is lowered for it."""
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def lower_step(fn, model, key, *inputs):
    """The jitted step fn lowered for the model's params, key's cache and state and these
    abstract inputs (the step's order: params, cache, state, inputs)."""
    return fn.lower(model.params, cache_of(model, key), state_of(key), *inputs)


def jit_step(fn, kind, cfg, tp, donate=(1, 2), **static):
    """fn jitted with its static arguments bound, its cache and state (by default) donated; tp
    (sharding.TensorParallel): run per shard inside shard_map, with the shard's Config. The
    plan's keys build theirs once per static configuration (functools.cache), never per call."""
    if tp is None:
        step = functools.partial(fn, cfg=cfg, **static)
    else:
        step = tp.shard_step(functools.partial(fn, cfg=tp.local, **static), kind)
    return jax.jit(step, donate_argnums=donate)
