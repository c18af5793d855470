"""Speculation per slot in the host loop (scheduler.py): whether a decode step drafts, each row's
draft, the inputs of a batch's verification step (verify_batch.py) and what each row takes from it.

A step drafts where the plan says drafting pays for its row count (spec_plan.spec_drafts: a
batch of many rows is compute-bound, and padding every row to 1 + K tokens would cost more than
drafts gain) and some row's drafter wants tokens; only such a step reads every row's tokens
before it dispatches (a draft needs them), so large batches keep their asynchronous pipeline.
Then every decoding row runs in one executable: rows with a draft verify it, the others (no
drafter, a paused one, no match) decode their one token on padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from minfer_jax.engine.plan import Plan
from minfer_jax.engine.request import Request, follows_tokens, row_places
from minfer_jax.engine.spec_plan import spec_drafts, verifies_batches


@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """In flight: one verification step, of a batch (verify_batch.py) or of one sequence
    (verify.py: tokens [1 + K], n_out [])."""

    rows: list[tuple[Request, int | None]]  # (request, its draft's length; None: no draft)
    tokens: jax.Array  # [B, 1 + K] int32: each row's accepted drafts, then the model's token
    n_out: jax.Array  # [B] int32: how many of them count


def speculates(plan: Plan, rows: Sequence[Request]) -> bool:
    """Whether this decode step drafts (rows: the sequences it decodes)."""
    wants = any(r.drafter is not None and r.drafter.wants_tokens for r in rows)
    return wants and spec_drafts(plan, len(rows)) > 0


def propose(rows: Sequence[Request], cap: int) -> dict[Request, list[int]]:
    """The draft of each row whose drafter proposes one this step, cut to cap tokens (every row's
    tokens have been read); rows left out decode plainly."""
    drafts = {}
    for r in rows:
        if r.drafter is None:
            continue
        assert r.stream is not None  # a decoding row
        draft = r.drafter.propose(r.prompt + list(r.stream.tokens), r.limit - r.produced)
        if draft is not None:
            drafts[r] = draft[:cap]
    return drafts


def count_down(rows: Sequence[Request]) -> None:
    """A step that does not draft still counts down each paused drafter's pause (its propose
    reads nothing then), so drafting resumes after the pause."""
    for r in rows:
        if r.drafter is not None and not r.drafter.wants_tokens:
            r.drafter.propose([], 0)


def batches(plan: Plan, rows: Sequence[Request]) -> bool:
    """Whether a drafting step of these rows runs as one batch verification: where the plan
    verifies batches (verifies_batches), several rows, none that needs each token before its
    next mask or wants logprobs (those rows' speculating neighbours verify one by one instead,
    verify.py)."""
    return (
        verifies_batches(plan)
        and len(rows) > 1
        and not any(follows_tokens(r) or r.logprobs is not None for r in rows)
    )


def batch_inputs(
    plan: Plan, rows: Sequence[Request], drafts: dict[Request, list[int]], width: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """verify_batch's slots, positions [width], drafts [width, k] and n_draft [width]: padded
    rows in the scratch slot at position 0 with no draft."""
    slots, positions = row_places(rows, width, plan.scratch_slot)
    tokens = np.zeros((width, k), np.int32)
    n_draft = np.zeros((width,), np.int32)
    for i, r in enumerate(rows):
        draft = drafts.get(r, [])
        tokens[i, : len(draft)], n_draft[i] = draft, len(draft)
    return slots, positions, tokens, n_draft


def verified(item: VerifyBatch):
    """(request, its tokens from the step) per row, the drafters told their outcome; waits for
    the step."""
    n_out = np.asarray(item.n_out).reshape(-1)
    tokens = np.asarray(item.tokens).reshape(len(n_out), -1)
    for i, (req, n_draft) in enumerate(item.rows):
        n = int(n_out[i])
        if n_draft is not None:
            assert req.drafter is not None
            req.drafter.record(n_draft, n)
        valid = min(n, req.limit - req.produced)
        req.produced += n
        yield req, tokens[i, :valid].tolist()
