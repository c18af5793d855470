"""The plan of executables: which shapes the host loop compiles, decided in this one place.

A process compiles a handful of executables whatever the prompt lengths: prompts run in chunks of
`chunk` tokens (the last padded to a power of two >= 16), decode runs `decode_steps` tokens per
executable for a power-of-two number of rows, and (XLA path only) decode attends over a
power-of-two prefix of the cache. Each key below names one executable; `Model.executable(key)`
compiles it once per process (and JAX's persistent cache across processes). Speculative
decoding's verification keys are spec_plan.py's; what the keys share, keys.py's.
"""

from __future__ import annotations

import dataclasses
import functools

from minfer_jax.engine import steps
from minfer_jax.engine.keys import PlanError, StepKey, cache_of, i32, jit_step, lower_step
from minfer_jax.engine.sampling import (
    GREEDY_MODE,
    LOGPROBS_MODE,
    SERVING_MODES,
    RowSettings,
    SamplerMode,
)
from minfer_jax.engine.spec_plan import MAX_DRAFT, VerifyKey, speculation_keys, verify_keys
from minfer_jax.errors import ContextOverflowError
from minfer_jax.sizes import pow2_at_least, round_up

MIN_BUCKET = 16  # smallest padded prompt chunk
MIN_SPAN = 256  # smallest attention window an XLA decode executable is compiled for
CACHE_ALIGN = 256  # cache positions per slot are a multiple of this (attention kernel blocks)
MAX_SEQS = 64  # sequences one batch decodes at once
DEFAULT_CHUNK = {
    "gpu": 2048,
    "cpu": 256,
}  # prefill chunk per platform (docs/BENCHMARKS.md, "Prefill chunk")
DECODE_STEPS = 16  # tokens per decode executable: the host sees tokens once per chunk
MAX_DECODE_STEPS = 4096  # more only delays streaming and stop checks (bench tgN runs N in one)


@dataclasses.dataclass(frozen=True)
class Plan:
    ctx: int  # tokens per sequence: prompt + generated
    n_seqs: int = 1  # sequences decoded at once (cache slots; one scratch slot more when > 1)
    chunk: int = DEFAULT_CHUNK["cpu"]
    decode_steps: int = DECODE_STEPS
    # decode attends over a power-of-two prefix (XLA path; kernels read [0, len))
    spans: bool = True
    # most tokens a sequence drafts per step (0: no speculation): the verification executables
    # serving_keys() adds (a server started with --spec-type; spec_plan.py)
    draft_max: int = 0
    # several sequences verify in one step (verify_batch.py); off for recurrent layers, whose
    # per-row state rollback only the one-sequence verification does (verify.py)
    batch_verify: bool = True

    def __post_init__(self):
        for name, lo, hi in (
            ("ctx", 1, 1 << 24),
            ("n_seqs", 1, MAX_SEQS),
            ("decode_steps", 1, MAX_DECODE_STEPS),
            ("chunk", MIN_BUCKET, 1 << 16),
            ("draft_max", 0, MAX_DRAFT),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise PlanError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        if self.chunk & (self.chunk - 1):
            raise PlanError(f"chunk must be a power of two, got {self.chunk}")

    @property
    def n_slots(self) -> int:
        return self.n_seqs + (self.n_seqs > 1)  # padded batch rows write into the scratch slot

    @property
    def history(self) -> int:
        """Repeat-penalty history kept per slot on the device: the whole context, so any
        repeat_last_n a request may ask for runs in the same executables."""
        return self.ctx

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """A step key's cache and state (keys.StepKey): n_slots, cache_len, history."""
        return self.n_slots, self.cache_len, self.history

    @property
    def scratch_slot(self) -> int:
        return self.n_slots - 1

    @property
    def cache_len(self) -> int:
        """Positions per slot: the context plus one decode chunk (at least a smallest prefill
        bucket) past it, in whole chunks."""
        align = max(self.chunk, CACHE_ALIGN)
        # >= MIN_BUCKET past ctx: a padded chunk starting anywhere before ctx fits
        return round_up(self.ctx + max(self.decode_steps, MIN_BUCKET), align)

    def chunks(self, n: int, start: int = 0) -> list[tuple[int, int, int]]:
        """(start, padded length, real tokens) of each prefill chunk of n tokens from `start`."""
        if start + n > self.ctx:
            raise ContextOverflowError(
                f"{start + n} tokens do not fit in a context of {self.ctx} tokens"
            )
        out = []
        while n > 0:
            size = min(n, self.chunk)
            bucket = min(pow2_at_least(size, MIN_BUCKET), self.chunk)
            # a chunk from an unaligned start (prefix reuse) must not pad past the slot's end
            while start + bucket > self.cache_len and bucket > MIN_BUCKET:
                bucket //= 2
                size = min(size, bucket)
            out.append((start, bucket, size))
            start, n = start + size, n - size
        return out

    def rows(self, n_active: int) -> int:
        """Batch rows compiled for n_active sequences: the next power of two."""
        return min(pow2_at_least(n_active), pow2_at_least(self.n_seqs))

    def span(self, end: int) -> int | None:
        """Decode attention window for positions < end (None: the kernels read [0, len)
        themselves)."""
        return min(pow2_at_least(end, MIN_SPAN), self.cache_len) if self.spans else None

    def prefill_key(self, bucket: int, mode: SamplerMode) -> PrefillKey:
        return PrefillKey(bucket, self.n_slots, self.cache_len, self.history, prefill_mode(mode))

    def decode_key(
        self, n_active: int, end: int, mode: SamplerMode, one_step: bool = False
    ) -> DecodeKey:
        """one_step: a batch with a grammar row, whose every token needs the host (a plan of
        decode_steps 1, the server's default, has no other executable for it)."""
        n_steps = 1 if one_step else self.decode_steps
        rows = self.rows(n_active)
        return DecodeKey(*self.cache_shape, mode, self.span(end), rows=rows, n_steps=n_steps)

    def serving_keys(self, modes=SERVING_MODES) -> list:
        """Every executable a long-running server meets (for these sampler modes; by default the
        three samplers' and greedy with logprobs (sampling.SERVING_MODES), so no sampler setting
        and no logprobs request is a reason to compile): each prefill bucket a prompt of up to ctx
        tokens can take and decode at every row count up to n_seqs (the XLA path's smallest
        attention window)."""
        buckets, b = [], MIN_BUCKET
        while b <= min(self.chunk, pow2_at_least(self.ctx, MIN_BUCKET)):
            buckets.append(b)
            b *= 2
        rows, r = [], 1
        while r <= self.rows(self.n_seqs):
            rows.append(r)
            r *= 2
        keys: list[PrefillKey | StepKey] = [self.prefill_key(b, m) for m in modes for b in buckets]
        keys += [self.decode_key(r, self.decode_steps + 1, m) for m in modes for r in rows]
        keys += speculation_keys(self)
        return list(dict.fromkeys(keys))

    def ready_keys(self) -> list:
        """The executables that serve every request on their own (the largest prefill bucket and
        decode at every row, in the top mode (LOGPROBS: FULL and each token's logprobs), over the
        whole cache): what a server compiles before
        it says it is ready; `covers` lets them stand in for the rest while those compile."""
        bucket = min(self.chunk, pow2_at_least(self.ctx, MIN_BUCKET))
        top = LOGPROBS_MODE
        return [self.prefill_key(bucket, top), self.decode_key(self.n_seqs, self.cache_len, top)]

    def logits_key(self, bucket: int) -> LogitsKey:
        return LogitsKey(bucket, self.n_slots, self.cache_len)

    def first_keys(
        self,
        n_prompt: int,
        max_new: int,
        mode: SamplerMode,
        batch: tuple[int, SamplerMode],
        start: int = 0,
        one_step: bool = False,
        speculation=None,
    ) -> list:
        """The executables a request of n_prompt tokens runs first: its prefill chunks from start
        (prompt tokens a slot holds), its verification buckets when it speculates (lookup.py's
        Speculation), the decode chunk of the batch it joins (rows, their mode)."""
        keys: list[PrefillKey | DecodeKey | VerifyKey] = list(
            dict.fromkeys(
                self.prefill_key(b, mode) for _, b, _ in self.chunks(n_prompt - start, start)
            )
        )
        if max_new > 1 and speculation is not None:
            keys += verify_keys(self, speculation.draft_max, n_prompt, mode, speculation.on_device)
        if max_new > 1:
            rows, batch_mode = batch
            keys.append(self.decode_key(rows, n_prompt + self.decode_steps, batch_mode, one_step))
        return keys


def prefill_mode(mode: SamplerMode) -> SamplerMode:
    """Prefill samples one token per chunk: greedy, or the top mode (LOGPROBS) for anything else
    (its sampler's and logprobs' cost is nothing beside a chunk's, and it halves the prefill
    executables)."""
    return GREEDY_MODE if mode == GREEDY_MODE else LOGPROBS_MODE


@dataclasses.dataclass(frozen=True)
class PrefillKey:
    bucket: int
    n_slots: int
    cache_len: int
    history: int
    mode: SamplerMode

    @property
    def label(self) -> str:
        return f"prefill [{self.bucket}] {self.mode.label}"

    @property
    def cost(self) -> tuple:
        return (self.bucket, self.mode)

    def covers(self, other, start: int = 0) -> bool:
        """This executable can run `other`'s chunk starting at `start` (padded to this bucket)."""
        return (
            isinstance(other, PrefillKey)
            and self.mode.covers(other.mode)
            and self.bucket >= other.bucket
            and (self.n_slots, self.cache_len, self.history)
            == (other.n_slots, other.cache_len, other.history)
            and start + self.bucket <= self.cache_len
        )

    def lower(self, model):
        fn = _prefill_jit(model.config, model.impl, self.mode, model.tp)
        rows = RowSettings.spec(1, model.config.vocab_size)
        return lower_step(
            fn, model, self, i32(self.bucket), i32(), i32(), i32(), i32(self.history), rows
        )


@dataclasses.dataclass(frozen=True)
class DecodeKey(StepKey):
    rows: int
    n_steps: int

    @property
    def label(self) -> str:
        shape = f"[{self.n_steps}]" if self.rows == 1 else f"[{self.rows} rows x {self.n_steps}]"
        return f"decode {shape} {self.mode.label}"

    def covers(self, other, start: int = 0) -> bool:
        """This executable can run `other`'s batch (padded to these rows)."""
        return self.serves(other) and self.rows >= other.rows and self.n_steps == other.n_steps

    @property
    def cost(self) -> tuple:
        return (self.rows, self.mode, self.span or 0)

    def lower(self, model):
        fn = _decode_jit(model.config, model.impl, self.mode, self.n_steps, self.span, model.tp)
        vec, rows = i32(self.rows), RowSettings.spec(self.rows, model.config.vocab_size)
        return lower_step(fn, model, self, vec, vec, rows)


@dataclasses.dataclass(frozen=True)
class LogitsKey:
    bucket: int
    n_slots: int
    cache_len: int

    @property
    def label(self) -> str:
        return f"logits [{self.bucket}]"

    def lower(self, model):
        fn = _logits_jit(model.config, model.impl, model.tp)
        return fn.lower(model.params, cache_of(model, self), i32(self.bucket), i32(), i32())


@functools.cache
def _prefill_jit(cfg, impl, mode, tp=None):
    return jit_step(steps.prefill_chunk, "prefill", cfg, tp, impl=impl, mode=mode)


@functools.cache
def _decode_jit(cfg, impl, mode, n_steps, span, tp=None):
    static = {"impl": impl, "mode": mode, "n_steps": n_steps, "span": span}
    return jit_step(steps.decode_chunk, "decode", cfg, tp, **static)


@functools.cache
def _logits_jit(cfg, impl, tp=None):
    return jit_step(steps.prompt_logits, "logits", cfg, tp, donate=(1,), impl=impl)
