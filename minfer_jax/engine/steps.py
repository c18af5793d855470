"""Pure step functions of the engine (usable inside a caller's own jax.jit):

    prefill_chunk(params, cache, state, tokens, slot, start, n_valid, history, rows, *, cfg, impl,
                  mode)
    decode_chunk(params, cache, state, slots, positions, rows, *, cfg, impl, mode, n_steps, span)
    prompt_logits(params, cache, tokens, slot, start, *, cfg, impl)

A prompt runs in fixed-size chunks (the last one padded to a power of two >= 16): each chunk is
one executable whatever the prompt's length, and attention reads the cache up to the chunk's end
only. Padded tokens write junk K/V behind the prompt; a later token overwrites a position before
any query can see it (keys are masked by absolute position). Decode advances B rows, each in its
own cache slot at its own position, `n_steps` tokens inside one executable (a fori_loop, ~8 us
per iteration on the H200). The per-slot `SlotState` (last token, repeat-penalty history) stays
on the device, so the host loop (scheduler.py) never waits for a token before dispatching the
next step.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.engine.sampling import (
    RowSettings,
    Sampled,
    SamplerMode,
    empty_logprobs,
    push_history,
    sample_rows,
    token_logprobs,
)
from minfer_jax.errors import ContextOverflowError
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.decoder import forward_chunk, forward_decode, logits_from_hidden
from minfer_jax.model.mtp import warm_up as mtp_warm_up
from minfer_jax.model.weights import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """What a slot's next decode step needs besides the cache, kept on the device."""

    last_token: jax.Array  # [n_slots] int32: the token to feed next
    history: jax.Array  # [n_slots, W] int32: the last W tokens (-1: none), for the repeat penalty


def init_slot_state(n_slots: int, history: int) -> SlotState:
    """Every slot's state before its first prompt: last token 0, `history` empty entries (the
    repeat penalty's window; 0 when no sampler penalizes)."""
    return SlotState(
        last_token=jnp.zeros((n_slots,), jnp.int32),
        history=jnp.full((n_slots, history), -1, jnp.int32),
    )


def prefill_chunk(
    params: Params,
    cache: KVCache,
    state: SlotState,
    tokens: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    n_valid: jax.Array,
    history: jax.Array,
    rows: RowSettings,
    *,
    cfg: Config,
    impl: ops.Impl,
    mode: SamplerMode,
    par=None,
) -> tuple[jax.Array | Sampled, SlotState, KVCache]:
    """Run tokens [C] (the first n_valid real) of sequence `slot` from position `start`.

    Samples the token after the last valid one with the slot's settings `rows` ([1] each) and its
    history [W] (the prompt's tail) and stores both in `state`, so decode can follow without the
    host. Returns (token, state, cache); only the last chunk of a prompt's token matters. In
    LOGPROBS_MODE the token is a Sampled (token [], its TokenLogprobs).
    A start + C past the cache is refused where start is concrete (outside jit).
    """
    check_span(start, tokens.shape[0], cache.max_len)
    h, cache = forward_chunk(params, tokens, slot, start, cache, cfg, impl, par, n_valid)  # [C, d]
    if params.mtp is not None:  # the MTP block's rows for this chunk (draft-mtp speculation)
        cache = mtp_warm_up(params, cache, tokens, h, slot, start, n_valid, cfg, impl)
    last = jax.lax.dynamic_slice_in_dim(
        h, n_valid - 1, 1, axis=0
    )  # [1, d]: one row through the head
    logits = logits_from_hidden(params, last, impl, cfg)
    token = _sample(par, logits, (start + n_valid)[None], rows, history[None], mode)
    history = push_history(history[None], token)[0]
    state = SlotState(
        last_token=state.last_token.at[slot].set(token[0]),
        history=state.history.at[slot].set(history),
    )
    if mode.logprobs:
        first = jax.tree.map(lambda x: x[0], _logprobs(par, logits, token))
        return Sampled(token[0], first), state, cache
    return token[0], state, cache


def decode_chunk(
    params: Params,
    cache: KVCache,
    state: SlotState,
    slots: jax.Array,
    positions: jax.Array,
    rows: RowSettings,
    *,
    cfg: Config,
    impl: ops.Impl,
    mode: SamplerMode,
    n_steps: int,
    span: int | None = None,
    par=None,
) -> tuple[jax.Array | Sampled, SlotState, KVCache]:
    """Advance rows [B] (slot slots[b], feeding its last token at positions[b]) by n_steps tokens.

    span (static, XLA path): attend over cache positions [0, span) (positions + n_steps <= span).
    Returns (tokens [n_steps, B] int32, state, cache); in LOGPROBS_MODE the tokens are a Sampled
    (tokens, their TokenLogprobs [n_steps, B, ...]).
    """

    def step(i, carry):
        out, tokens, history, cache = carry
        pos = positions + i
        logits, cache = forward_decode(params, tokens, slots, pos, cache, cfg, impl, span, par)
        nxt = _sample(par, logits, pos + 1, rows, history, mode)
        if mode.logprobs:
            lp = _logprobs(par, logits, nxt)
            out = Sampled(
                out.tokens.at[i].set(nxt),
                jax.tree.map(lambda all_, one: all_.at[i].set(one), out.logprobs, lp),
            )
        else:
            out = out.at[i].set(nxt)
        return out, nxt, push_history(history, nxt), cache

    tokens0 = jnp.zeros((n_steps, slots.shape[0]), jnp.int32)
    out: jax.Array | Sampled = tokens0
    if mode.logprobs:  # the carry holds every step's logprobs
        out = Sampled(tokens0, empty_logprobs((n_steps, slots.shape[0]), cfg.vocab_size))
    # only the penalty reads or grows the history: other modes leave it where it is
    history = state.history[slots] if mode.penalty else jnp.zeros((slots.shape[0], 0), jnp.int32)
    out, tokens, history, cache = jax.lax.fori_loop(
        0, n_steps, step, (out, state.last_token[slots], history, cache)
    )
    history = state.history.at[slots].set(history) if mode.penalty else state.history
    return out, SlotState(last_token=state.last_token.at[slots].set(tokens), history=history), cache


def prompt_logits(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    *,
    cfg: Config,
    impl: ops.Impl,
    par=None,
) -> tuple[jax.Array, KVCache]:
    """Logits at every position of tokens [T] of sequence `slot` from `start`:
    ([T, vocab] f32, cache). A start + T past the cache is refused where start is a concrete value
    (outside jit); inside a jit the caller bounds it, as the plan's chunks do."""
    check_span(start, tokens.shape[0], cache.max_len)
    h, cache = forward_chunk(params, tokens, slot, start, cache, cfg, impl, par)
    logits = logits_from_hidden(params, h, impl, cfg)
    return (logits if par is None else par.full_logits(logits)), cache


def check_span(start: Any, n: int, max_len: int) -> None:
    """ContextOverflowError when positions start .. start + n - 1 do not fit a cache of max_len;
    a traced start (inside jit) cannot be read and is left to the caller."""
    try:
        first = int(start)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return
    if first < 0 or first + n > max_len:
        raise ContextOverflowError(
            f"positions {first}..{first + n - 1} do not fit the cache's {max_len} positions"
        )


def _sample(par, logits, positions, rows, history, mode):
    """sample_rows on one device; inside shard_map (par) from this shard's vocabulary slice."""
    if par is None:
        return sample_rows(logits, positions, rows, history, mode)
    return par.sample_rows(logits, positions, rows, history, mode)


def _logprobs(par, logits, tokens):
    """token_logprobs on one device; inside shard_map over the gathered vocabulary."""
    return token_logprobs(logits if par is None else par.full_logits(logits), tokens)


class StopReason(enum.StrEnum):
    """Why a sequence ended; str-valued, so it compares, formats and serializes as its value."""

    EOS = "eos"  # the model sampled an end-of-sequence token
    STOP = "stop"  # a stop string appeared (cut from the text)
    LENGTH = "length"  # max_new_tokens generated
    CONTEXT = "context"  # the sequence filled its cache slot
    CANCELLED = "cancelled"  # Request.cancel() (a client went away)
    ERROR = "error"  # the loop failed; the request carries the error


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model's distribution (sampling.py,
    TokenLogprobs) and the `top` most likely tokens with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids (stop token excluded)
    text: str  # their text (stop string excluded)
    prompt_tokens: list[int]
    stop_reason: StopReason
    prefill_s: float
    decode_s: float
    compile_s: float
    # prompt tokens whose K/V a previous request left in the slot (not prefilled again)
    cached_tokens: int = 0
    # speculative decoding's counts (drafter.SpecStats), None when it was off
    speculation: Any = None
    # one per token of `tokens` when the request asked for logprobs (None: it did not)
    logprobs: list[TokenLogprob] | None = None
    # the stop string that ended the text (stop_reason STOP), None otherwise
    stop_string: str | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens prefilled (reused ones excluded) per second."""
        n = self.n_prompt - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first token comes out of the prefill
        return n / self.decode_s if self.decode_s > 0 and n else float("nan")
