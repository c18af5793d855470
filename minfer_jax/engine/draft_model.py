"""A draft model: a second, smaller model of the target's vocabulary drafts for speculative decoding
(llama.cpp's -md / --model-draft; Qwen2.5-0.5B drafting for the 7B).

`DraftModel` wraps the loaded draft model with its own KV cache of `slots` sequences; each slot
remembers the tokens whose K/V it holds, so a sequence is rolled back by setting its position back
(the cache is never cleared: a later write covers what a rejected draft left, before any query
reads it, as in verify.py). One drafting step (`draft_chunk`, one executable per attention span,
`DraftKey`) feeds the 1..FEED tokens the draft model has not seen (the target's own token after
an accepted draft, and the draft's last token when the whole draft was accepted) as rows of one
decode step, then decodes greedily in a while loop on the device, token after token through the
same decode path, until it holds n_max tokens or its top probability falls below p_min (llama.cpp's
--draft-p-min, 0.75 by default): the draft stops where the draft model itself is unsure. Longer
gaps (the prompt, the tokens of plain chunks run during a pause) are prefilled in the draft
model's own prefill chunks first.

`ModelDrafter` is one sequence's drafter (drafter.Drafter): it proposes a draft of up to the
current length to the scheduler, which verifies it on the target (verify.py). The length is
drafter.CostPacing's: the one that makes the most tokens per unit of time at the running
acceptance rate, given a drafted token's cost in target steps (first the weights' size ratio,
then the observed draft and verification times); drafting pauses where it does not pay. The draft
is deterministic given the sequence (greedy), so the verification's rule for one-hot drafts keeps
sampled output exact in distribution too.

The vocabularies must agree (check_vocabularies, llama.cpp's common_speculative_are_compatible):
sizes within VOCAB_SLACK (padding rows: Qwen2.5-0.5B has 151936, the 7B 152064), the same BOS /
EOS ids and BOS flag, and the same token text at every id both have from CHECK_FROM on.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import ops, validate
from minfer_jax.engine.drafter import CostPacing, SpecStats
from minfer_jax.engine.executables import execution_devices
from minfer_jax.engine.lookup import DEFAULT_DRAFT_MAX, Speculation, speculation_of
from minfer_jax.engine.plan import MAX_SEQS
from minfer_jax.engine.runtime import Model, load
from minfer_jax.engine.sampling import GREEDY, GREEDY_MODE, RowSettings
from minfer_jax.engine.sharing import common_prefix
from minfer_jax.engine.spec_plan import MAX_DRAFT
from minfer_jax.engine.steps import SlotState, init_slot_state
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.model.cache import KVCache, cache_spec
from minfer_jax.model.config import Config
from minfer_jax.model.decoder import forward_decode
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.weights import Params

DRAFT_TYPES = ("draft", "draft-simple")  # ours, llama.cpp's --spec-type for a draft model
DEFAULT_P_MIN = 0.75  # llama-server's --draft-p-min
FEED = 2  # rows a drafting step feeds before it drafts: the draft's last token, the target's own
VOCAB_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
CHECK_FROM = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID


class VocabularyMismatchError(InvalidArgumentError):
    """A draft model whose token ids do not mean what the target's mean."""


# -- the device step -----------------------------------------------------------------------------
def _top(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The greedy token of logits [vocab] and its probability."""
    logits = logits.astype(jnp.float32)
    token = jnp.argmax(logits).astype(jnp.int32)
    return token, jnp.exp(logits[token] - jax.nn.logsumexp(logits))


def draft_chunk(
    params: Params,
    cache: KVCache,
    slot: jax.Array,
    start: jax.Array,
    feed: jax.Array,
    n_feed: jax.Array,
    n_max: jax.Array,
    p_min: jax.Array,
    *,
    cfg: Config,
    impl: ops.Impl,
    span: int | None,
    width: int = MAX_DRAFT,
) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """Feed feed[:n_feed] (the rest padding) of sequence `slot` at positions start.., then draft
    greedily up to n_max (1..width) tokens, stopping before one whose probability is < p_min.

    Returns (tokens [width] int32, n_drafted [], n_fed [], cache): tokens[:n_drafted] is the draft;
    the K/V of the fed tokens and of tokens[:n_fed] are written (n_fed is n_drafted or one less).
    """
    rows = feed.shape[0]
    positions = start + jnp.arange(rows, dtype=jnp.int32)
    slots = jnp.full((rows,), slot, jnp.int32)
    logits, cache = forward_decode(params, feed, slots, positions, cache, cfg, impl, span)
    token, p = _top(jax.lax.dynamic_index_in_dim(logits, n_feed - 1, keepdims=False))
    tokens = jnp.zeros((width,), jnp.int32).at[0].set(token)
    probs = jnp.zeros((width,), jnp.float32).at[0].set(p)
    first = start + n_feed  # draft token i's position

    def more(carry):
        i, tokens, probs, _ = carry
        return (probs[i] >= p_min) & (i + 1 < n_max)

    def step(carry):
        i, tokens, probs, cache = carry
        logits, cache = forward_decode(
            params, tokens[i][None], slot[None], (first + i)[None], cache, cfg, impl, span
        )
        token, p = _top(logits[0])
        return i + 1, tokens.at[i + 1].set(token), probs.at[i + 1].set(p), cache

    i, tokens, probs, cache = jax.lax.while_loop(
        more, step, (jnp.zeros((), jnp.int32), tokens, probs, cache)
    )
    n_drafted = i + (probs[i] >= p_min).astype(jnp.int32)
    return tokens, n_drafted, i, cache


@dataclasses.dataclass(frozen=True)
class DraftKey:
    """The drafting executable of a draft model's cache layout and attention span."""

    feed: int
    n_slots: int
    cache_len: int
    span: int | None
    width: int = MAX_DRAFT

    @property
    def label(self) -> str:
        return f"draft [{self.feed}+{self.width}]"

    def lower(self, model):
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        cache = cache_spec(
            model.config,
            self.n_slots,
            self.cache_len,
            model.cache_dtype,
            model.kv_types,
            model.kv_rotation,
        )
        fn = _draft_jit(model.config, model.impl, self.span, self.width)
        feed = jax.ShapeDtypeStruct((self.feed,), jnp.int32)
        p_min = jax.ShapeDtypeStruct((), jnp.float32)
        return fn.lower(model.params, cache, i32, i32, feed, i32, i32, p_min)


@functools.cache
def _draft_jit(cfg, impl, span, width):
    step = functools.partial(draft_chunk, cfg=cfg, impl=impl, span=span, width=width)
    return jax.jit(step, donate_argnums=(1,))


# -- the draft model beside its target -----------------------------------------------------------
def check_vocabularies(target: Model, draft: Model) -> None:
    """VocabularyMismatchError unless draft's token ids mean what target's mean (module
    docstring); a model without tokenizer metadata is checked by its size alone."""
    names = f"the draft model {draft.source} and the target {target.source}"
    n_draft, n_target = draft.config.vocab_size, target.config.vocab_size
    if abs(n_draft - n_target) > VOCAB_SLACK:
        raise VocabularyMismatchError(
            f"{names} have vocabularies of {n_draft} and {n_target} tokens, more than "
            f"{VOCAB_SLACK} apart: a draft model must share the target's vocabulary"
        )
    d, t = draft.tokenizer, target.tokenizer
    if d is None or t is None:
        if (d is None) != (t is None):
            which = "draft model" if d is None else "target"
            raise VocabularyMismatchError(
                f"{names}: the {which} has no tokenizer metadata, so its token ids cannot be "
                "checked against the other's"
            )
        return
    for what, mine, theirs in (
        ("BOS id", d.bos_id, t.bos_id),
        ("BOS flag (add_bos_token)", d.add_bos, t.add_bos),
        ("EOS ids", sorted(d.eos_ids), sorted(t.eos_ids)),
    ):
        if mine != theirs:
            raise VocabularyMismatchError(f"{names} differ in their {what}: {mine} vs {theirs}")
    for i in range(CHECK_FROM, min(d.vocab_size, t.vocab_size)):
        if d.id_to_token(i) != t.id_to_token(i):
            raise VocabularyMismatchError(
                f"{names} differ at token {i}: {d.id_to_token(i)!r} in the draft model, "
                f"{t.id_to_token(i)!r} in the target"
            )


class DraftModel:
    """A draft model beside a target: its KV cache of `slots` sequences (the module docstring).
    Reusable across requests and generate() calls: a sequence that starts like one a slot holds
    prefills only the rest."""

    def __init__(self, model: Model, target: Model, slots: int = 1):
        for name, m in (("draft model", model), ("target", target)):
            if not isinstance(m, Model):
                raise InvalidArgumentError(
                    f"the {name} must be a minfer_jax.Model, got {type(m).__name__}"
                )
        if model.config.recurrent_layer_ids:
            raise InvalidArgumentError(
                f"the draft model {model.source} is of the hybrid family {model.config.family!r}: "
                "its recurrent state cannot be rolled back to the accepted tokens"
            )
        if model.tp is not None:
            raise InvalidArgumentError("the draft model must be loaded on one device (no -tp)")
        check_vocabularies(target, model)
        validate.integer("slots", slots, 1, MAX_SEQS)
        self.model = model
        self.plan = model.plan(n_seqs=slots)
        self.cache: KVCache | None = None  # allocated on the first draft
        self.state: SlotState | None = None  # the prefill executables' (unused) slot state
        self.held: list[list[int]] = [[] for _ in range(slots)]  # tokens with K/V at [0, len)
        self.owners: list[Any] = [None] * slots  # weakref to the drafter a slot drafts for
        self.last_use = [0] * slots
        self._clock = 0
        self._checked: weakref.WeakSet[Model] = weakref.WeakSet([target])
        self.prefilled = 0  # tokens the last draft prefilled before drafting (a catch-up)
        self._rows = RowSettings.of([GREEDY], [0], vocab=model.config.vocab_size)
        self._history = np.full((self.plan.history,), -1, np.int32)

    def check(self, target: Model) -> None:
        """The vocabulary check against another target (once per target)."""
        if target not in self._checked:
            check_vocabularies(target, self.model)
            self._checked.add(target)

    def fits(self, n_seq: int, n_max: int) -> bool:
        """Whether a draft of n_max tokens after n_seq tokens fits the draft model's context."""
        return n_seq + n_max + FEED <= self.plan.ctx

    def prepare(self, n_prompt: int) -> None:
        """Compile (or load) what the first draft after a prompt of n_prompt tokens runs: its
        prefill chunks and the drafting step (later ones: a larger attention span on the XLA
        path compile when met)."""
        if n_prompt < 1 or not self.fits(n_prompt + 1, 1):
            return
        for _, bucket, _ in self.plan.chunks(n_prompt + 1 - FEED, 0):
            self.model.executable(self.plan.prefill_key(bucket, GREEDY_MODE))
        self.model.executable(self._draft_key(n_prompt + 1 - FEED))

    def _draft_key(self, tail: int) -> DraftKey:
        """The drafting step feeding from position tail."""
        p = self.plan
        return DraftKey(FEED, p.n_slots, p.cache_len, p.span(tail + FEED + MAX_DRAFT))

    def draft(self, owner: object, seq: list[int], n_max: int, p_min: float) -> list[int]:
        """Up to n_max (1..MAX_DRAFT) greedy tokens after seq, for the drafter `owner`."""
        slot = self._slot_for(owner, seq)
        start = min(self._held_prefix(slot, seq), len(seq) - 1)  # the last token is always fed
        tail = max(start, len(seq) - FEED)
        self.prefilled = tail - start
        try:
            self._ensure_cache()
            if tail > start:
                self._prefill(slot, seq[start:tail], start)
            feed = np.zeros((FEED,), np.int32)
            feed[: len(seq) - tail] = seq[tail:]
            tokens, n, fed, self.cache = self.model.executable(self._draft_key(tail))[0](
                self.model.params,
                self.cache,
                np.int32(slot),
                np.int32(tail),
                feed,
                np.int32(len(seq) - tail),
                np.int32(n_max),
                np.float32(p_min),
            )
            tokens, n, fed = jax.device_get((tokens, n, fed))  # one wait, one transfer
            out = tokens[: int(n)].tolist()
        except BaseException:
            self.cache = self.state = None  # donated buffers may be gone: start afresh
            self.held = [[] for _ in self.held]
            raise
        self.held[slot] = seq + out[: int(fed)]
        return out

    def _held_prefix(self, slot: int, seq: list[int]) -> int:
        held = self.held[slot]
        n = min(len(held), len(seq))
        return n if held[:n] == seq[:n] else common_prefix(held, seq)

    def _slot_for(self, owner: object, seq: list[int]) -> int:
        """owner's slot; else a free one (or, all taken, the least recently used one) holding the
        longest prefix of seq. A slot taken from another drafter only costs that one a prefill."""
        self._clock += 1
        mine = [s for s, ref in enumerate(self.owners) if ref is not None and ref() is owner]
        if not mine:
            free = [s for s, ref in enumerate(self.owners) if ref is None or ref() is None]
            slot = max(
                free or range(len(self.owners)),
                key=lambda s: (common_prefix(self.held[s], seq), -self.last_use[s]),
            )
            self.owners[slot] = weakref.ref(owner)
            mine = [slot]
        self.last_use[mine[0]] = self._clock
        return mine[0]

    def _ensure_cache(self) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache(self.plan.n_slots, self.plan.cache_len)
            self.state = init_slot_state(self.plan.n_slots, self.plan.history)

    def _prefill(self, slot: int, tokens: list[int], start: int) -> None:
        """K/V of tokens at positions start.. in the draft model's prefill chunks."""
        for begin, bucket, n_valid in self.plan.chunks(len(tokens), start):
            chunk = np.zeros((bucket,), np.int32)
            chunk[:n_valid] = tokens[begin - start : begin - start + n_valid]
            exe, _ = self.model.executable(self.plan.prefill_key(bucket, GREEDY_MODE))
            _, self.state, self.cache = exe(
                self.model.params,
                self.cache,
                self.state,
                chunk,
                np.int32(slot),
                np.int32(begin),
                np.int32(n_valid),
                self._history,
                self._rows,
            )


def load_draft(
    target: Model,
    path: str | os.PathLike | None = None,
    slots: int = 1,
    *,
    gguf_model: GGUFModel | None = None,
) -> DraftModel:
    """The GGUF at path (or a parsed gguf_model) loaded as target's draft model: target's load
    options (its context, one device: the target's first), its vocabulary checked; slots: the
    sequences it drafts for at once without taking each other's cache slot."""
    opts = dataclasses.replace(target.options, ctx_size=target.ctx_size, tensor_parallel=None)
    draft = load(path, opts, device=execution_devices(target)[0], gguf_model=gguf_model)
    return DraftModel(draft, target, slots)


# draft models given by path, kept while their target lives: a second call reuses the loaded
# weights, the compiled executables and the KV cache
_KEPT: weakref.WeakKeyDictionary[Model, dict[str, DraftModel]] = weakref.WeakKeyDictionary()


def draft_model_for(target: Model, ref: Any) -> DraftModel:
    """A DraftModel for target from generate()'s draft_model: a DraftModel (kept by the caller:
    its KV cache and prefixes carry over), a loaded Model (its executables carry over; a fresh
    KV cache each call) or a GGUF path (loaded once, kept with the target)."""
    if isinstance(ref, DraftModel):
        ref.check(target)
        return ref
    if isinstance(ref, Model):
        return DraftModel(ref, target)
    if not isinstance(ref, (str, os.PathLike)):
        raise InvalidArgumentError(
            "draft_model must be a minfer_jax.DraftModel, a loaded minfer_jax.Model or a GGUF "
            f"path, got {type(ref).__name__}"
        )
    kept = _KEPT.setdefault(target, {})
    path = os.fspath(ref)
    if path not in kept:
        kept[path] = load_draft(target, path)
    return kept[path]


@dataclasses.dataclass(frozen=True)
class DraftSpeculation:
    """A request's speculative decoding by a draft model: drafts of draft_min..draft_max tokens,
    each token's draft probability at least p_min; vocab: the target's (a draft token past it,
    a padding id of a larger draft vocabulary, ends the draft); cost: a drafted token's time over
    a target step's to start from (decode reads the weights once a token: their sizes' ratio;
    the drafter then follows the times it observes; 0 keeps every draft at draft_max)."""

    draft: DraftModel
    vocab: int
    cost: float = 1.0
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 1
    p_min: float = DEFAULT_P_MIN
    kind: str = "draft"

    def __post_init__(self):
        validate.choice("speculative", self.kind, DRAFT_TYPES)
        validate.integer("draft_max", self.draft_max, 1, MAX_DRAFT)
        validate.integer("draft_min", self.draft_min, 0, self.draft_max)
        validate.number("draft_p_min", self.p_min, 0.0, 1.0)
        validate.number("cost", self.cost, 0.0, 1e3)

    @property
    def on_device(self) -> bool:
        """The draft model drafts on the host's side (drafter.SpeculationSetting)."""
        return False

    def new_drafter(self, prompt: Sequence[int] = ()) -> ModelDrafter:
        """One sequence's drafter; what its first draft after prompt runs is compiled now."""
        self.draft.prepare(len(prompt))
        return ModelDrafter(self)


class ModelDrafter:
    """One sequence's drafter on a draft model (drafter.Drafter)."""

    def __init__(self, spec: DraftSpeculation):
        self.spec = spec
        self.pacing = CostPacing(spec.draft_max, spec.cost)
        self.stats = SpecStats()
        self._drafted_at = 0.0  # when the last draft was made (perf_counter), and its seconds
        self._draft_s = 0.0

    @property
    def wants_tokens(self) -> bool:
        return self.pacing.pause == 0

    def propose(self, seq: list[int], room: int) -> list[int] | None:
        """A draft of up to room - 1 tokens after seq; [] verifies one token alone; None runs a
        plain chunk (a pause, or no draft where drafts have not been paying)."""
        if self.pacing.paused():
            self.stats.plain_chunks += 1
            return None
        k = min(self.pacing.k, room - 1)
        draft: list[int] = []
        if k >= 1 and self.spec.draft.fits(len(seq), k):
            t0 = time.perf_counter()
            draft = self.spec.draft.draft(self, seq, k, self.spec.p_min)
            self._drafted_at = time.perf_counter()
            # a catch-up prefill's time is no drafted token's: not observed
            self._draft_s = 0.0 if self.spec.draft.prefilled else self._drafted_at - t0
            cut = next((i for i, t in enumerate(draft) if t >= self.spec.vocab), len(draft))
            draft = draft[:cut]
        if len(draft) >= max(self.spec.draft_min, 1):
            return draft
        if self.pacing.missed(room):
            return []
        self.stats.plain_chunks += 1
        return None

    def record(self, n_draft: int, n_out: int) -> None:
        self.stats.record(n_draft, n_out)
        if n_draft and self._draft_s:  # read as the verification ended (the scheduler waits)
            self.pacing.observe(self._draft_s, time.perf_counter() - self._drafted_at, n_draft)
        self.pacing.record(n_draft, n_out - 1)


def speculation_for(
    target: Model,
    kind: str | None,
    draft_max: int | None = None,
    draft_min: int | None = None,
    *,
    draft_model: Any = None,
    p_min: float | None = None,
) -> Speculation | DraftSpeculation | None:
    """generate()'s speculation settings: a draft model's for the draft types (draft_model
    required), else lookup.speculation_of's (draft_model and p_min refused)."""
    if kind in DRAFT_TYPES:
        if draft_model is None:
            raise InvalidArgumentError(
                f"speculative={kind!r} needs draft_model (a GGUF path, a loaded Model or a "
                "DraftModel of the target's vocabulary)"
            )
        sizes: dict[str, Any] = {"draft_max": draft_max, "draft_min": draft_min, "p_min": p_min}
        draft = draft_model_for(target, draft_model)
        return DraftSpeculation(
            draft,
            target.config.vocab_size,
            draft.model.weight_nbytes / max(target.weight_nbytes, 1),
            kind=str(kind),
            **{k: v for k, v in sizes.items() if v is not None},
        )
    if draft_model is not None or p_min is not None:
        raise InvalidArgumentError(
            "draft_model / draft_p_min need speculative='draft' (llama.cpp's 'draft-simple')"
        )
    return speculation_of(kind, draft_max, draft_min)
