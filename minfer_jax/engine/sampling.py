"""Token sampling: a user's settings as a small frozen dataclass (`Sampler`), and the engine's
`sample_rows`, which draws one token for each row of a batch from per-row settings arrays.

Order of operations follows llama.cpp's default sampler chain: repetition penalty over the last
`repeat_last_n` tokens -> top-k -> top-p -> min-p -> temperature -> draw. temperature <= 0 is greedy.
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict, Unpack

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


class SamplerKeywords(TypedDict, total=False):
    """A Sampler's fields as keywords (generate()'s convenience form)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int


def sampler_of(*, history_cap: int | None = None, **settings: Unpack[SamplerKeywords]) -> Sampler:
    """A Sampler from keywords, greedy unless a temperature is given; greedy drops the filters
    (they do not change argmax), so every greedy request shares one executable.

    history_cap (a context's length): repeat_last_n beyond it is cut to it (no more history
    exists), so any int up to INT32_MAX is accepted there, not only MAX_REPEAT_LAST_N.
    """
    if history_cap is not None and "repeat_last_n" in settings:
        n = validate.integer("repeat_last_n", settings["repeat_last_n"], 0, validate.INT32_MAX)
        settings["repeat_last_n"] = min(n, history_cap)
    s = Sampler(**{"temperature": 0.0, **settings})
    if s.greedy:
        return dataclasses.replace(GREEDY, repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n)
    return s


def within_context(sampler: Sampler, ctx: int) -> Sampler:
    """sampler with repeat_last_n cut to ctx (a device array longer than the context is waste)."""
    if sampler.repeat_last_n <= ctx:
        return sampler
    return dataclasses.replace(sampler, repeat_last_n=ctx)


def apply_repeat_penalty(logits: jax.Array, history: jax.Array, penalty: float) -> jax.Array:
    """llama.cpp's penalty: logits of tokens in history [n] (-1 = empty) divided (if > 0) or multiplied by penalty."""
    valid = history >= 0
    idx = jnp.where(valid, history, 0)
    seen = jnp.zeros(logits.shape, bool).at[idx].max(valid)
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


# -- the engine's sampler: many rows at once ---------------------------------------------------------
# Settings travel as arrays (one row per sequence) so a batch of different samplers shares one
# executable; only their shape is static (`SamplerMode`). A row's random key is derived from its
# seed and the position of the token it draws, so a sequence samples the same tokens whatever
# batch, chunk or slot it runs in.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row sampler settings, each an array [B]."""

    temperature: jax.Array  # f32; <= 0: greedy
    top_k: jax.Array  # i32; 0: off
    top_p: jax.Array  # f32
    min_p: jax.Array  # f32
    repeat_penalty: jax.Array  # f32; 1: off
    repeat_last_n: jax.Array  # i32
    seed: jax.Array  # u32

    @staticmethod
    def of(samplers, seeds, rows: int | None = None) -> RowSettings:
        """Host arrays for these samplers (padded with greedy rows up to `rows`)."""
        import numpy as np

        pad = (rows or len(samplers)) - len(samplers)
        samplers = list(samplers) + [GREEDY] * pad
        seeds = [int(s) % 2**32 for s in seeds] + [0] * pad

        def col(name, dtype):
            return np.asarray([getattr(s, name) for s in samplers], dtype)

        return RowSettings(temperature=col("temperature", np.float32), top_k=col("top_k", np.int32),
                           top_p=col("top_p", np.float32), min_p=col("min_p", np.float32),
                           repeat_penalty=col("repeat_penalty", np.float32),
                           repeat_last_n=np.asarray([s.history_len for s in samplers], np.int32),
                           seed=np.asarray(seeds, np.uint32))


@dataclasses.dataclass(frozen=True)
class SamplerMode:
    """The static shape of a batch's sampling; one executable per mode."""

    sampled: bool = False  # some row draws (temperature > 0); else every row is greedy
    top_k_cap: int = 0  # candidates kept for rows with a filter (0: no such row)
    history: int = 0  # repeat-penalty history width per row (0: none)

    @staticmethod
    def of(samplers, history: int, vocab: int) -> SamplerMode:
        drawn = [s for s in samplers if not s.greedy]
        filtered = [s for s in drawn if s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0]
        cap = max((min(s.top_k if s.top_k > 0 else FULL_SORT_CAP, vocab) for s in filtered), default=0)
        if cap:
            cap = min(1 << (cap - 1).bit_length(), vocab)  # power-of-two buckets: few executables
        return SamplerMode(sampled=bool(drawn), top_k_cap=cap, history=history)


def push_history(history: jax.Array, tokens: jax.Array) -> jax.Array:
    """history [B, W] (oldest first) with tokens [B] appended, the oldest dropped."""
    if history.shape[-1] == 0:
        return history
    return jnp.concatenate([history[:, 1:], tokens[:, None].astype(history.dtype)], axis=1)


def sample_rows(logits: jax.Array, positions: jax.Array, rows: RowSettings, history: jax.Array,
                mode: SamplerMode) -> jax.Array:
    """logits [B, vocab] -> token ids [B] int32; row b draws the token of position positions[b]."""
    logits = logits.astype(jnp.float32)
    if mode.history:
        width = history.shape[1]
        recent = jnp.arange(width)[None, :] >= width - rows.repeat_last_n[:, None]
        logits = jax.vmap(apply_repeat_penalty)(logits, jnp.where(recent, history, -1), rows.repeat_penalty)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not mode.sampled:
        return greedy
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(rows.seed, positions)
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    tokens = jax.vmap(jax.random.categorical)(keys, logits / temp).astype(jnp.int32)
    if mode.top_k_cap:
        cap = mode.top_k_cap
        vals, ids = jax.lax.top_k(logits, cap)  # [B, cap] descending
        k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, cap), cap)[:, None]
        vals = jnp.where(jnp.arange(cap)[None, :] < k, vals, -jnp.inf)
        probs = jax.nn.softmax(vals, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # keep the smallest prefix reaching top_p
        keep = (before < rows.top_p[:, None]) & (probs >= rows.min_p[:, None] * probs[:, :1]) & (vals > -jnp.inf)
        choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, vals / temp, -jnp.inf))
        picked = jnp.take_along_axis(ids, choice[:, None], axis=1)[:, 0].astype(jnp.int32)
        filtered = (rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0)
        tokens = jnp.where(filtered, picked, tokens)
    return jnp.where(rows.temperature > 0, tokens, greedy)
