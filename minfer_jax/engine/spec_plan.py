"""The plan's speculation executables (plan.py holds the rest): which verification steps exist,
decided in this one place.

A verification feeds 1 + K rows, K a draft bucket (1, 3, 7, 15: `draft_bucket`), so that the rows
are a power of two. A lone sequence verifies its draft in a `VerifyKey` step (verify.py); a batch
whose rows draft verifies them all in one `VerifyBatchKey` step (verify_batch.py) while its rows
times 1 + K stay within SPEC_ROWS_BUDGET (`spec_drafts`: where drafting stops paying). A server
started with speculation compiles `speculation_keys` in the background.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

from minfer_jax.engine import verify, verify_batch
from minfer_jax.engine.keys import PlanError, StepKey, i32, jit_step, lower_step
from minfer_jax.engine.sampling import MODES, RowSettings, SamplerMode
from minfer_jax.sizes import pow2_at_least

MAX_DRAFT = 15  # drafted tokens one verification takes at most (16 rows)
# Forward rows (batch rows x (1 + drafts)) a speculating step of a batch may take: within it the
# few-token GEMV / smallest GEMM tiles cost about one plain step, beyond it drafting stops paying
# (a guess to measure: docs/ARCHITECTURE.md "Speculation per slot"); a power of two
SPEC_ROWS_BUDGET = 16  # = 1 + MAX_DRAFT: a lone sequence drafts up to MAX_DRAFT


class PlanShape(Protocol):
    """What the speculation keys read of a plan (plan.Plan, which imports this module)."""

    @property
    def draft_max(self) -> int: ...  # most tokens a sequence drafts per step (0: none)

    @property
    def batch_verify(self) -> bool: ...  # several sequences may verify in one step

    @property
    def decode_steps(self) -> int: ...

    @property
    def n_seqs(self) -> int: ...

    @property
    def cache_len(self) -> int: ...

    @property
    def cache_shape(self) -> tuple[int, int, int]: ...  # keys.StepKey's n_slots, cache_len, history

    def rows(self, n_active: int) -> int: ...

    def span(self, end: int) -> int | None: ...


def draft_bucket(n_draft: int) -> int:
    """Drafted tokens a verification executable takes for n_draft (0 verifies one token): 1, 3,
    7 or 15, so that 1 + K rows are a power of two (the GEMV takes up to 8, verify.py)."""
    if not 0 <= n_draft <= MAX_DRAFT:
        raise PlanError(f"a draft is 0..{MAX_DRAFT} tokens, got {n_draft}")
    return pow2_at_least(n_draft + 1, 2) - 1


def verifies_batches(plan: PlanShape) -> bool:
    """Whether several sequences' drafts verify in one step: where the plan allows it and a plain
    step decodes one token (more would cost the plain rows their chunk)."""
    return plan.batch_verify and plan.decode_steps == 1


def spec_drafts(plan: PlanShape, n_active: int) -> int:
    """The largest draft bucket a step of n_active decoding sequences verifies (0: that step
    does not speculate): the one place that decides where drafting stops paying."""
    # budget and rows are powers of two: 1 + K is one, so K is a draft bucket
    return max(SPEC_ROWS_BUDGET // plan.rows(n_active) - 1, 0)


def verify_key(
    plan: PlanShape, n_draft: int, end: int, mode: SamplerMode, on_device: bool = False
) -> VerifyKey:
    """Speculative decoding's verification of n_draft drafted tokens (verify.py): 1 + K rows
    of one sequence, K = draft_bucket(n_draft); end: past the last position it writes;
    on_device: the MTP block drafts them in the step (model/mtp.py)."""
    k = draft_bucket(n_draft)
    return VerifyKey(*plan.cache_shape, mode, plan.span(end + k), drafts=k, on_device=on_device)


def verify_keys(
    plan: PlanShape, draft_max: int, end: int, mode: SamplerMode, on_device: bool = False
) -> list[VerifyKey]:
    """Every verification bucket a sequence drafting up to draft_max tokens meets."""
    keys = (verify_key(plan, n, end, mode, on_device) for n in range(draft_max + 1))
    return list(dict.fromkeys(keys))


def verify_batch_key(
    plan: PlanShape, n_active: int, n_draft: int, end: int, mode: SamplerMode
) -> VerifyBatchKey:
    """A batch's verification step (verify_batch.py): rows(n_active) rows of 1 + K, K =
    draft_bucket(n_draft) for its longest draft; end: past the last position a row feeds."""
    k, rows = draft_bucket(n_draft), plan.rows(n_active)
    return VerifyBatchKey(*plan.cache_shape, mode, plan.span(end + k), rows=rows, drafts=k)


def speculation_keys(plan: PlanShape) -> list[VerifyKey | VerifyBatchKey]:
    """The verification executables a server with speculation (draft_max > 0) compiles in the
    background, over the whole cache (they serve every position): a lone sequence's (VerifyKey)
    and (verifies_batches) a batch's at each row count and draft bucket spec_drafts allows, in the
    sampler modes (no logprobs). Until one is compiled its steps decode plainly."""
    if not plan.draft_max:
        return []
    keys: list[VerifyKey | VerifyBatchKey] = []
    end = plan.cache_len - MAX_DRAFT
    for mode in MODES:
        keys += verify_keys(plan, plan.draft_max, end, mode)
        r = 2
        while verifies_batches(plan) and r <= plan.rows(plan.n_seqs):
            top = min(spec_drafts(plan, r), plan.draft_max)
            keys += [verify_batch_key(plan, r, n, end, mode) for n in range(1, top + 1)]
            r *= 2
    return list(dict.fromkeys(keys))


@dataclasses.dataclass(frozen=True)
class VerifyKey(StepKey):
    drafts: int  # K: the executable verifies up to K drafted tokens in 1 + K rows
    on_device: bool = False  # MTP: the step drafts on the device (model/mtp.py)

    @property
    def label(self) -> str:
        return f"verify [1+{self.drafts}]{' mtp' if self.on_device else ''} {self.mode.label}"

    @property
    def cost(self) -> tuple:
        return (self.drafts, self.mode, self.span or 0)

    def covers(self, other, start: int = 0) -> bool:
        """This executable can run `other`'s verification (its drafts padded to these)."""
        return (
            self.serves(other) and self.drafts >= other.drafts and self.on_device == other.on_device
        )

    def lower(self, model):
        fn = _verify_jit(model.config, model.impl, self.mode, self.span, model.tp, self.on_device)
        rows = RowSettings.spec(1, model.config.vocab_size)
        return lower_step(fn, model, self, i32(), i32(), i32(self.drafts), i32(), rows)


@dataclasses.dataclass(frozen=True)
class VerifyBatchKey(StepKey):
    rows: int  # batch rows, each verifying up to `drafts` drafted tokens in 1 + drafts rows
    drafts: int

    @property
    def label(self) -> str:
        return f"verify [{self.rows} rows x 1+{self.drafts}] {self.mode.label}"

    @property
    def cost(self) -> tuple:
        return (self.rows * (1 + self.drafts), self.mode, self.span or 0)

    def covers(self, other, start: int = 0) -> bool:
        """This executable can run `other`'s step (rows and drafts padded to these)."""
        return self.serves(other) and self.rows >= other.rows and self.drafts >= other.drafts

    def lower(self, model):
        fn = _verify_batch_jit(model.config, model.impl, self.mode, self.span, model.tp)
        vec, rows = i32(self.rows), RowSettings.spec(self.rows, model.config.vocab_size)
        return lower_step(fn, model, self, vec, vec, i32(self.rows, self.drafts), vec, rows)


@functools.cache
def _verify_jit(cfg, impl, mode, span, tp=None, on_device=False):
    static = {"impl": impl, "mode": mode, "span": span, "mtp": on_device}
    return jit_step(verify.verify_chunk, "verify", cfg, tp, **static)


@functools.cache
def _verify_batch_jit(cfg, impl, mode, span, tp=None):
    static = {"impl": impl, "mode": mode, "span": span}
    return jit_step(verify_batch.verify_batch, "verify", cfg, tp, **static)
