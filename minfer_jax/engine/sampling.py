"""Token sampling: a user's settings as a small frozen dataclass (`Sampler`), and the engine's
`sample_rows`, which draws one token for each row of a batch from per-row settings arrays.

Order of operations follows llama.cpp's default sampler chain: repetition penalty over the last
`repeat_last_n` tokens -> top-k -> top-p -> min-p -> temperature -> draw. temperature <= 0 is
greedy.
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict, Unpack, cast

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import validate

FULL_SORT_CAP = 4096  # top-p/min-p without top-k consider at most this many candidates
MAX_REPEAT_LAST_N = (
    1 << 24
)  # history slots on the device (64 MiB); generate() and the CLI clamp it to the context


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
            "repeat_penalty": validate.number(
                "repeat_penalty", self.repeat_penalty, 0.0, lo_open=True
            ),
            "repeat_last_n": validate.integer(
                "repeat_last_n", self.repeat_last_n, 0, MAX_REPEAT_LAST_N
            ),
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


def sampler_of(
    *, history_cap: int | None = None, vocab: int | None = None, **settings: Unpack[SamplerKeywords]
) -> Sampler:
    """A Sampler from keywords: the fields not given take Sampler's defaults (top_k=40 alone
    samples at temperature 0.8, as Sampler(top_k=40) does); no keyword at all is greedy. Greedy
    drops the filters (they do not change argmax), so every greedy request shares one executable.

    history_cap (a context's length) and vocab: the extreme-value policy (validate.clamped_count):
    repeat_last_n of -1 or past the context is the context, top_k past the vocabulary is all of it.
    """
    if history_cap is not None and "repeat_last_n" in settings:
        settings["repeat_last_n"] = validate.clamped_count(
            "repeat_last_n", settings["repeat_last_n"], history_cap, all_of="the context"
        )
    if vocab is not None and "top_k" in settings:
        settings["top_k"] = validate.clamped_count(
            "top_k", settings["top_k"], vocab, all_of="the vocabulary", minus_one=False
        )
    s = Sampler(**settings) if settings else GREEDY
    if s.greedy:
        return dataclasses.replace(
            GREEDY, repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n
        )
    return s


def within_context(sampler: Sampler, ctx: int, vocab: int | None = None) -> Sampler:
    """sampler with repeat_last_n cut to ctx (a device array longer than the context is waste) and
    top_k to the vocabulary."""
    top_k = sampler.top_k if vocab is None else min(sampler.top_k, vocab)
    if sampler.repeat_last_n <= ctx and top_k == sampler.top_k:
        return sampler
    return dataclasses.replace(sampler, repeat_last_n=min(sampler.repeat_last_n, ctx), top_k=top_k)


def apply_repeat_penalty(
    logits: jax.Array, history: jax.Array, penalty: float | jax.Array
) -> jax.Array:
    """llama.cpp's penalty: logits of tokens in history [n] (-1 = empty) divided (if > 0) or
    multiplied by penalty."""
    valid = history >= 0
    idx = jnp.where(valid, history, 0)
    seen = jnp.zeros(logits.shape, bool).at[idx].max(valid)
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


# -- the engine's sampler: many rows at once -------------------------------------------------------
# Settings travel as arrays (one row per sequence) so a batch of different samplers shares one
# executable; only three static modes exist (`SamplerMode`), so no setting a request may carry
# compiles a new executable. A row's random key is derived from its seed and the position of the
# token it draws, and its draw is a Gumbel-max over the whole vocabulary masked by value
# thresholds, so a sequence samples the same tokens whatever batch, mode, chunk or slot it runs in.

# candidates the SAMPLED mode sorts: enough for top_k <= 64 (llama.cpp's default 40)
NARROW_CAP = 64
WIDE_CAP = FULL_SORT_CAP  # the FULL mode's: top_k up to 4096, top-p/min-p without a small top_k


def mask_words(vocab: int) -> int:
    """int32 words of one row's token bitmask (bit t % 32 of word t // 32: token t allowed)."""
    return (vocab + 31) // 32


def all_allowed(rows: int, vocab: int) -> np.ndarray:
    """The bitmask of rows that no constraint narrows: every bit set."""
    return np.full((rows, mask_words(vocab)), -1, np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row sampler settings, each an array [B] (the mask [B, mask_words(vocab)]).

    The mask is always an input (all bits set for free rows) so that a constrained row and free
    rows share one executable."""

    temperature: jax.Array  # f32; <= 0: greedy
    top_k: jax.Array  # i32; 0: off
    top_p: jax.Array  # f32
    min_p: jax.Array  # f32
    repeat_penalty: jax.Array  # f32; 1: off
    repeat_last_n: jax.Array  # i32
    seed: jax.Array  # u32: the seed's low 32 bits
    seed_hi: jax.Array  # u32: its high 32 bits (0 for seeds below 2**32: their keys are unchanged)
    mask: jax.Array  # i32 [B, words]: allowed tokens as bits (grammar, banned EOS)

    @staticmethod
    def of(
        samplers,
        seeds,
        rows: int | None = None,
        *,
        vocab: int,
        mask: jax.Array | np.ndarray | None = None,
    ) -> RowSettings:
        """Host arrays for these samplers (padded with greedy rows up to `rows`); seeds in
        0..2**64-1; mask: [rows, mask_words(vocab)] (None: every token allowed)."""
        pad = (rows or len(samplers)) - len(samplers)
        samplers = list(samplers) + [GREEDY] * pad
        seeds = [int(s) % 2**64 for s in seeds] + [0] * pad

        # host columns: an executable's arguments, typed as the arrays it sees
        def col(name, dtype) -> jax.Array:
            return cast(jax.Array, np.asarray([getattr(s, name) for s in samplers], dtype))

        return RowSettings(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            repeat_penalty=col("repeat_penalty", np.float32),
            repeat_last_n=cast(jax.Array, np.asarray([s.history_len for s in samplers], np.int32)),
            seed=cast(jax.Array, np.asarray([s % 2**32 for s in seeds], np.uint32)),
            seed_hi=cast(jax.Array, np.asarray([s >> 32 for s in seeds], np.uint32)),
            mask=cast(jax.Array, all_allowed(len(samplers), vocab) if mask is None else mask),
        )

    @staticmethod
    def spec(rows: int, vocab: int) -> RowSettings:
        """The abstract shapes of `of(...)` for `rows` rows (what an executable is lowered for)."""
        # abstract values, typed as the arrays they stand for
        f32, i32, u32 = (
            cast(jax.Array, jax.ShapeDtypeStruct((rows,), t))
            for t in (jnp.float32, jnp.int32, jnp.uint32)
        )
        return RowSettings(
            temperature=f32,
            top_k=i32,
            top_p=f32,
            min_p=f32,
            repeat_penalty=f32,
            repeat_last_n=i32,
            seed=u32,
            seed_hi=u32,
            mask=cast(jax.Array, jax.ShapeDtypeStruct((rows, mask_words(vocab)), jnp.int32)),
        )


@dataclasses.dataclass(frozen=True, order=True)
class SamplerMode:
    """The static part of a batch's sampling: one of GREEDY_MODE < SAMPLED_MODE < FULL_MODE, each
    able to serve every batch a smaller one serves (`covers`), with or without each token's
    logprobs (`token_logprobs`: only a batch with a row that asks pays for them; LOGPROBS_MODE,
    the full mode with them, serves every batch). Everything else is traced."""

    rank: int = 0  # 0 greedy, 1 sampled (NARROW_CAP candidates), 2 full (WIDE_CAP, repeat penalty)
    logprobs: bool = False  # the step also returns each token's logprobs (`Sampled`)

    @property
    def sampled(self) -> bool:  # some row may draw (temperature > 0)
        return self.rank >= 1

    @property
    def cap(self) -> int:  # candidates sorted for the top-k / top-p thresholds
        return WIDE_CAP if self.rank >= 2 else NARROW_CAP

    @property
    def penalty(
        self,
    ) -> bool:  # the repeat penalty is applied (rows with repeat_penalty 1 are unchanged)
        return self.rank >= 2

    @property
    def label(self) -> str:
        return ("greedy", "sampled", "full")[self.rank] + (" logprobs" if self.logprobs else "")

    def covers(self, other: SamplerMode) -> bool:
        return self.rank >= other.rank and self.logprobs >= other.logprobs

    def join(self, other: SamplerMode) -> SamplerMode:
        """The smallest mode covering both."""
        return SamplerMode(max(self.rank, other.rank), self.logprobs or other.logprobs)

    @staticmethod
    def of(samplers, logprobs: bool = False) -> SamplerMode:
        """The smallest mode serving every one of these samplers (logprobs: a row asks for its
        tokens' logprobs)."""
        mode = max((_mode_of(s) for s in samplers), default=GREEDY_MODE)
        return dataclasses.replace(mode, logprobs=True) if logprobs else mode


def _mode_of(s: Sampler) -> SamplerMode:
    if s.history_len:
        return FULL_MODE
    if s.greedy:
        return GREEDY_MODE
    narrow = 0 < s.top_k <= NARROW_CAP or (s.top_k == 0 and s.top_p >= 1.0)
    return SAMPLED_MODE if narrow else FULL_MODE


GREEDY_MODE, SAMPLED_MODE, FULL_MODE = SamplerMode(0), SamplerMode(1), SamplerMode(2)
MODES = (GREEDY_MODE, SAMPLED_MODE, FULL_MODE)  # what samplers alone need
GREEDY_LOGPROBS_MODE, LOGPROBS_MODE = SamplerMode(0, True), SamplerMode(2, True)
# what a server compiles (plan.serving_keys): greedy batches with logprobs (scoring, evals) get
# their own; a sampled batch with logprobs runs on the ready set's LOGPROBS_MODE (its sampler
# costs more than the rows and span it wastes)
SERVING_MODES = (*MODES, GREEDY_LOGPROBS_MODE)


def push_history(history: jax.Array, tokens: jax.Array) -> jax.Array:
    """history [B, W] (oldest first) with tokens [B] appended, the oldest dropped."""
    if history.shape[-1] == 0:
        return history
    return jnp.concatenate([history[:, 1:], tokens[:, None].astype(history.dtype)], axis=1)


def row_keys(rows: RowSettings, positions: jax.Array) -> jax.Array:
    """One PRNG key per row from its 64-bit seed and the position of the token it draws."""

    def key(lo, hi, pos):
        k = jax.random.PRNGKey(lo)
        k = jnp.where(hi != 0, jax.random.fold_in(k, hi), k)
        return jax.random.fold_in(k, pos)

    return jax.vmap(key)(rows.seed, rows.seed_hi, positions)


def keep_mask(logits: jax.Array, rows: RowSettings, cap: int) -> jax.Array:
    """llama.cpp's top-k -> top-p -> min-p filters as value thresholds: bool [B, vocab].

    The thresholds come from the `cap` largest logits (top-p over the top-k set at temperature 1,
    min-p relative to the most likely token), so rows whose filters stay within `cap` candidates
    get the same mask from any cap.
    """
    cap = min(cap, logits.shape[-1])
    vals, _ = jax.lax.top_k(logits, cap)  # [B, cap] descending
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, cap), cap)  # [B]
    in_k = jnp.arange(cap)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # keep the smallest prefix reaching top_p
    n_top_p = jnp.sum(in_k & (before < rows.top_p[:, None]), axis=-1)  # >= 1
    at = lambda n: jnp.take_along_axis(vals, (jnp.maximum(n, 1) - 1)[:, None], axis=1)  # noqa: E731
    ninf = jnp.float32(-jnp.inf)
    t_k = jnp.where((rows.top_k > 0)[:, None], at(k), ninf)
    t_p = jnp.where((rows.top_p < 1.0)[:, None], at(n_top_p), ninf)
    t_min = jnp.where(
        (rows.min_p > 0.0)[:, None],
        vals[:, :1] + jnp.log(jnp.maximum(rows.min_p, 1e-30))[:, None],
        ninf,
    )
    return logits >= jnp.maximum(jnp.maximum(t_k, t_p), t_min)


def allowed_bits(mask: jax.Array, ids: jax.Array | None = None, vocab: int = 0) -> jax.Array:
    """The bitmask [B, words] as bool [B, vocab] (ids: only these token ids, [n] -> [B, n])."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, words, 32]
    flat = bits.reshape(mask.shape[0], -1).astype(bool)
    if ids is None:
        return flat[:, :vocab]
    return jnp.take(flat, jnp.minimum(ids, flat.shape[1] - 1), axis=1) & (ids < flat.shape[1])


def first_max_index(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) as int32 (the first maximum; a NaN counts as the maximum) in
    vectorized reductions: XLA CPU's (value, index) reduce takes 614-661 us over a 151936-word row
    against 116 here (2026-12-07, this 2-core CPU, loaded), 3 % of a 0.5B decode step. Other
    backends keep jnp.argmax: one reduction, and nothing measured there says otherwise."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    nan = jnp.isnan(x)  # XLA CPU's max skips NaN (fast min / max)
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1).astype(jnp.int32)


def sample_rows(
    logits: jax.Array,
    positions: jax.Array,
    rows: RowSettings,
    history: jax.Array,
    mode: SamplerMode,
) -> jax.Array:
    """logits [B, vocab] -> token ids [B] int32; row b draws the token of position positions[b]."""
    logits = logits.astype(jnp.float32)
    # disallowed tokens first: no filter or penalty below can bring one back
    logits = jnp.where(allowed_bits(rows.mask, vocab=logits.shape[-1]), logits, -jnp.inf)
    if mode.penalty:
        width = history.shape[1]
        recent = jnp.arange(width)[None, :] >= width - rows.repeat_last_n[:, None]
        logits = jax.vmap(apply_repeat_penalty)(
            logits, jnp.where(recent, history, -1), rows.repeat_penalty
        )
    greedy = first_max_index(logits)
    if not mode.sampled:
        return greedy
    keys = row_keys(rows, positions)
    temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(
        keys
    )  # [B, vocab]
    filtered = (rows.top_k > 0) | (rows.top_p < 1.0) | (rows.min_p > 0.0)
    keep = keep_mask(logits, rows, mode.cap) | ~filtered[:, None]
    tokens = jnp.argmax(jnp.where(keep, logits / temp + gumbel, -jnp.inf), axis=-1).astype(
        jnp.int32
    )
    return jnp.where(rows.temperature > 0, tokens, greedy)


# -- logprobs -------------------------------------------------------------------------------------
TOP_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's bound): one static top-N


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of sampled tokens under the model's distribution: the softmax of the raw
    logits, before the mask, the repeat penalty, the filters and the temperature (what llama-server
    reports for n_probs without post_sampling_probs, and OpenAI for logprobs)."""

    chosen: jax.Array  # [..., B] f32: of the sampled token
    top_ids: jax.Array  # [..., B, TOP_LOGPROBS] i32: the most likely tokens, most likely first
    top: jax.Array  # [..., B, TOP_LOGPROBS] f32: their logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """A LOGPROBS_MODE step's tokens with their logprobs (other modes return the tokens alone)."""

    tokens: jax.Array
    logprobs: TokenLogprobs


def empty_logprobs(shape: tuple[int, ...], vocab: int) -> TokenLogprobs:
    """Zeros shaped as token_logprobs' output for `shape` ([steps, B]) tokens."""
    k = min(TOP_LOGPROBS, vocab)
    return TokenLogprobs(
        chosen=jnp.zeros(shape, jnp.float32),
        top_ids=jnp.zeros((*shape, k), jnp.int32),
        top=jnp.zeros((*shape, k), jnp.float32),
    )


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logits [B, vocab] (raw, as the model gave them), tokens [B] -> their TokenLogprobs."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(logp, min(TOP_LOGPROBS, logp.shape[-1]))
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
    return TokenLogprobs(chosen=chosen, top_ids=top_ids.astype(jnp.int32), top=top)
