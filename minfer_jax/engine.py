"""Generation engine: bucketed prefill, on-device decode loop (pure step functions) and the host loop.

Pure functions (usable inside a caller's own jax.jit):
    prefill_step(params, cache, tokens, start, n_valid, key, history, *, cfg, impl, sampler)
    decode_loop(params, cache, token, pos, key, history, *, cfg, impl, sampler, n_steps)
    prompt_logits(params, cache, tokens, start, *, cfg, impl)

Prompts are padded to a bucket (a power of two >= 16, capped by the cache length) so a session
compiles a handful of executables; padded slots write junk K/V behind the prompt, which decode
overwrites before any query can see it (keys are masked by absolute position). Decode runs
`n_steps` tokens inside one executable (a fori_loop, ~8 us per iteration on the H200) and hands
the tokens to the host once per chunk for streaming and stop checks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import ops
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.qwen2 import forward, forward_hidden, logits_from_hidden
from minfer_jax.model.weights import Params
from minfer_jax.sampling import Sampler, sample

MIN_BUCKET = 16
MIN_SPAN = 256  # smallest attention window a decode executable is compiled for


def bucket_for(n: int, max_len: int) -> int:
    """Padded length for an n-token prompt: the next power of two >= 16, at most max_len."""
    if n > max_len:
        raise ContextOverflowError(f"prompt of {n} tokens does not fit in a context of {max_len} tokens")
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, max_len)


def decode_span(end: int, max_len: int) -> int:
    """Cache slots a decode chunk must attend over when its last token sits at slot end - 1.

    Decode executables attend over a power-of-two prefix of the cache instead of all of it: at
    a 4096 context the full window made CPU decode ~2x slower. A generation switches to the next
    span (one more compile, cached) as it grows.
    """
    s = MIN_SPAN
    while s < end:
        s *= 2
    return min(s, max_len)


def _history_push(history: jax.Array, token: jax.Array) -> jax.Array:
    if history.shape[0] == 0:
        return history
    return jnp.roll(history, -1).at[-1].set(token)


def prefill_step(params: Params, cache: KVCache, tokens: jax.Array, start: jax.Array, n_valid: jax.Array,
                 key: jax.Array, history: jax.Array, *, cfg: Config, impl: ops.Impl, sampler: Sampler):
    """Run the padded prompt tokens [T] from position `start`; sample the token after the last valid one.

    Returns (token, logits [vocab] of the last valid position, cache).
    """
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    h, cache = forward_hidden(params, tokens, positions, cache, cfg, impl)  # [T, d]
    last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=0)  # [1, d]: only one row through the head
    logits = logits_from_hidden(params, last, impl)[0]
    return sample(logits, key, sampler, history), logits, cache


def prompt_logits(params: Params, cache: KVCache, tokens: jax.Array, start: jax.Array, *, cfg: Config,
                  impl: ops.Impl):
    """Logits at every position of tokens [T] (from position start): ([T, vocab] f32, cache)."""
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return forward(params, tokens, positions, cache, cfg, impl)


def decode_loop(params: Params, cache: KVCache, token: jax.Array, pos: jax.Array, key: jax.Array,
                history: jax.Array, *, cfg: Config, impl: ops.Impl, sampler: Sampler, n_steps: int,
                span: int | None = None):
    """Feed `token` at `pos` and keep sampling for n_steps tokens, all on the device.

    span: attend over cache slots [0, span) only (pos + n_steps <= span must hold); None: all.

    Returns (tokens [n_steps] int32, last token, next pos, key, history, cache).
    """

    def step(i, carry):
        out, token, pos, key, history, cache = carry
        logits, cache = forward(params, token[None], pos[None], cache, cfg, impl, span)
        key, sub = jax.random.split(key)
        nxt = sample(logits[0], sub, sampler, history)
        return out.at[i].set(nxt), nxt, pos + 1, key, _history_push(history, nxt), cache

    out = jnp.zeros((n_steps,), jnp.int32)
    out, token, pos, key, history, cache = jax.lax.fori_loop(0, n_steps, step, (out, token, pos, key, history, cache))
    return out, token, pos, key, history, cache


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids (stop token excluded)
    text: str  # their text (stop string excluded)
    prompt_tokens: list[int]
    stop_reason: str  # "eos" | "stop" | "length" | "context"
    prefill_s: float
    decode_s: float
    compile_s: float

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prefill_tps(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first token comes out of the prefill
        return n / self.decode_s if self.decode_s > 0 and n else float("nan")


def _earliest_stop(text: str, stops: Sequence[str]) -> int:
    hits = [text.find(s) for s in stops if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


def run_generation(model, prompt_ids: Sequence[int], *, max_new_tokens: int, sampler: Sampler, seed: int,
                   stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                   chunk: int = 16, max_len: int | None = None) -> GenerationResult:
    """Host loop: prefill, then decode chunks until EOS / stop string / max_new_tokens / full context."""
    tok = model.tokenizer
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise InvalidArgumentError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    max_len = max_len or model.ctx_size
    n = len(prompt_ids)
    if n >= max_len:
        raise ContextOverflowError(
            f"prompt of {n} tokens leaves no room to generate in a context of {max_len} tokens (use a larger -c)")
    stop = [s for s in stop if s]
    compile_s = 0.0

    cache = model.new_cache(max_len)
    bucket = bucket_for(n, max_len)
    tokens = np.zeros((bucket,), np.int32)
    tokens[:n] = prompt_ids
    hist_len = sampler.history_len
    history = np.full((hist_len,), -1, np.int32)
    if hist_len:
        tail = prompt_ids[-hist_len:]
        history[hist_len - len(tail):] = tail
    key = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(key)

    exe, dt = model.prefill_executable(bucket, max_len, sampler)
    compile_s += dt
    t0 = time.perf_counter()
    token, _, cache = exe(model.params, cache, jnp.asarray(tokens), jnp.int32(0), jnp.int32(n), sub,
                          jnp.asarray(history))
    token = int(token)  # waits for the device
    prefill_s = time.perf_counter() - t0

    generated: list[int] = []
    text = ""
    emitted = 0  # characters of `text` already handed to on_text
    stream = tok.decode_stream(skip_special=True) if tok is not None else _NoText()
    eos_ids = tok.eos_ids if tok is not None else frozenset()
    reason = "length"
    history = _host_history_push(history, token)
    pending = [token]
    decode_s = 0.0
    # Hold back a stop string's length of text so a stop string split over chunks never leaks.
    hold = max((len(s) for s in stop), default=0)
    while True:
        done = False
        for t in pending:
            if len(generated) >= max_new_tokens:
                reason, done = "length", True
            elif t in eos_ids:
                reason, done = "eos", True
            else:
                generated.append(t)
                text += stream.step(t)
                cut = _earliest_stop(text, stop)
                if cut >= 0:
                    text, reason, done = text[:cut], "stop", True
                elif n + len(generated) >= max_len:  # no cache slot left to feed this token
                    reason, done = "context", True
            if done:
                break
        if not done and len(generated) >= max_new_tokens:
            reason, done = "length", True
        if done:
            if reason != "stop":
                text += stream.finish()
            if on_text and len(text) > emitted:
                on_text(text[emitted:])
            break
        if on_text and len(text) - hold > emitted:
            on_text(text[emitted:len(text) - hold])
            emitted = len(text) - hold
        span = decode_span(n + len(generated) - 1 + chunk, max_len)
        exe, dt = model.decode_executable(chunk, max_len, sampler, span)
        compile_s += dt
        t0 = time.perf_counter()
        out, _, _, key, history_d, cache = exe(model.params, cache, jnp.int32(generated[-1]),
                                               jnp.int32(n + len(generated) - 1), key, jnp.asarray(history))
        pending = [int(t) for t in np.asarray(out)]  # waits for the device
        decode_s += time.perf_counter() - t0
        history = np.asarray(history_d)
    return GenerationResult(tokens=generated, text=text, prompt_tokens=prompt_ids, stop_reason=reason,
                            prefill_s=prefill_s, decode_s=decode_s, compile_s=compile_s)


class _NoText:
    """Stand-in detokenizer for models without tokenizer metadata (synthetic benchmarks)."""

    def step(self, token: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


def _host_history_push(history: np.ndarray, token: int) -> np.ndarray:
    if history.shape[0] == 0:
        return history
    return np.concatenate([history[1:], np.array([token], np.int32)])
