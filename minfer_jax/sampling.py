"""Token sampling as a small frozen dataclass: static (hashable) so each setting compiles once.

Order of operations follows llama.cpp's default sampler chain: repetition penalty over the last
`repeat_last_n` tokens -> top-k -> top-p -> min-p -> temperature -> draw. temperature <= 0 is greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax import validate

FULL_SORT_CAP = 4096  # top-p/min-p without top-k consider at most this many candidates
MAX_REPEAT_LAST_N = 1 << 24  # history slots on the device (64 MiB); generate() and the CLI clamp it to the context


@dataclasses.dataclass(frozen=True)
class Sampler:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64

    def __post_init__(self):
        # Plain Python values: the sampler is a static jit argument, hashed and compared per call.
        fields = {
            "temperature": validate.number("temperature", self.temperature),
            "top_k": validate.integer("top_k", self.top_k, 0, validate.INT32_MAX),
            "top_p": validate.number("top_p", self.top_p, 0.0, 1.0, lo_open=True),
            "min_p": validate.number("min_p", self.min_p, 0.0, 1.0),
            "repeat_penalty": validate.number("repeat_penalty", self.repeat_penalty, 0.0, lo_open=True),
            "repeat_last_n": validate.integer("repeat_last_n", self.repeat_last_n, 0, MAX_REPEAT_LAST_N),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def history_len(self) -> int:
        """Tokens of history the sampler needs on the device (0: none)."""
        return self.repeat_last_n if self.repeat_penalty != 1.0 else 0


GREEDY = Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def apply_repeat_penalty(logits: jax.Array, history: jax.Array, penalty: float) -> jax.Array:
    """llama.cpp's penalty: logits of tokens in history [n] (-1 = empty) divided (if > 0) or multiplied by penalty."""
    valid = history >= 0
    idx = jnp.where(valid, history, 0)
    seen = jnp.zeros(logits.shape, bool).at[idx].max(valid)
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits: jax.Array, key: jax.Array, sampler: Sampler, history: jax.Array | None = None) -> jax.Array:
    """logits [vocab] f32 -> token id (int32 scalar)."""
    logits = logits.astype(jnp.float32)
    if history is not None and sampler.repeat_penalty != 1.0:
        logits = apply_repeat_penalty(logits, history, sampler.repeat_penalty)
    if sampler.greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    vocab = logits.shape[-1]
    filtered = sampler.top_k > 0 or sampler.top_p < 1.0 or sampler.min_p > 0.0
    if not filtered:
        return jax.random.categorical(key, logits / sampler.temperature).astype(jnp.int32)
    k = min(sampler.top_k if sampler.top_k > 0 else FULL_SORT_CAP, vocab)
    vals, ids = jax.lax.top_k(logits, k)  # [k] descending
    probs = jax.nn.softmax(vals)
    keep = jnp.ones((k,), bool)
    if sampler.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = jnp.cumsum(probs) - probs
        keep &= before < sampler.top_p
    if sampler.min_p > 0.0:
        keep &= probs >= sampler.min_p * probs[0]
    masked = jnp.where(keep, vals / sampler.temperature, -jnp.inf)
    choice = jax.random.categorical(key, masked)
    return ids[choice].astype(jnp.int32)
