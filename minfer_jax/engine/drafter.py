"""What a drafter of speculative decoding gives the scheduler (scheduler.py), and the pacing the
model drafters share.

A request's speculation setting (lookup.Speculation, draft_model.DraftSpeculation) is a
`SpeculationSetting`: its draft sizes and `new_drafter(prompt)`, one `Drafter` per sequence, made
when the request is submitted (on the submitting thread: a drafter may compile what it needs
there, not on the loop's). Before each
step of a speculating row the scheduler asks its drafter for a draft (`propose(seq, room)`: the
tokens to verify, [] to verify one token alone, None for a plain decode chunk), verifies it
(verify.py) and tells the drafter the outcome (`record(n_draft, n_out)`); `wants_tokens` says
whether the next proposal reads the sequence (a paused drafter does not, so its row's tokens may be
read late, as any plain row's). `stats` is what result.speculation reports.

`Pacing` is lookup.py's rule for the draft length and the pauses, for drafters that draft by other
means (a draft model): the length moves between the verification buckets with what is accepted,
and where drafts stop paying (few accepted per step, or misses in a row) the drafter pauses for a
growing number of plain chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from minfer_jax.engine.lookup import EMA, HOT, MAX_PAUSE, PAYS, SpecStats


class SpeculationSetting(Protocol):
    """A request's speculative decoding: what the plan compiles for it and its drafters' maker."""

    @property
    def kind(self) -> str: ...

    @property
    def draft_max(self) -> int: ...  # verification buckets up to draft_bucket(draft_max)

    @property
    def draft_min(self) -> int: ...

    def new_drafter(self, prompt: Sequence[int]) -> Drafter: ...  # at submit, off the loop


class Drafter(Protocol):
    """One sequence's drafting state (the module docstring)."""

    @property
    def spec(self) -> SpeculationSetting: ...

    @property
    def stats(self) -> SpecStats: ...

    @property
    def wants_tokens(self) -> bool: ...

    def propose(self, seq: list[int], room: int) -> list[int] | None: ...

    def record(self, n_draft: int, n_out: int) -> None: ...


class Pacing:
    """The draft length k and the pauses of one drafter (lookup.Drafter's rule, its constants)."""

    def __init__(self, draft_max: int):
        self.draft_max = draft_max
        self.k = draft_max  # current draft length
        self.gain = 1.0  # running mean of accepted drafts per verify step
        self.pause = 0  # plain chunks to run before drafting again
        self.backoff = 1

    def paused(self) -> bool:
        """Whether this step is a plain chunk of a pause (and counts it down)."""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def missed(self, room: int) -> bool:
        """No draft worth verifying: True verifies one token anyway (drafts have been paying),
        False runs a plain chunk now and, after misses in a row, more before drafting again."""
        self.gain *= 1 - EMA  # a miss: a step that accepts nothing
        if self.gain >= HOT and room > 1:
            return True
        self.pause, self.backoff = self.backoff - 1, min(2 * self.backoff, MAX_PAUSE)
        return False

    def record(self, n_draft: int, accepted: int) -> None:
        """A verification's outcome: accepted of n_draft drafted tokens."""
        if n_draft == 0:
            return
        self.gain += EMA * (accepted - self.gain)
        if accepted == n_draft:
            self.k = min(2 * self.k + 1, self.draft_max)
        elif 2 * accepted < n_draft:
            self.k = max(1, (self.k - 1) // 2)
        if self.gain < PAYS:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, MAX_PAUSE)
            self.gain = HOT  # judged afresh after the pause
        else:
            self.backoff = 1
