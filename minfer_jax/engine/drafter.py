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

`Pacing` is the one rule for the draft length and the pauses, which every host drafter holds (prompt
lookup, MTP, a draft model): the length moves between the verification buckets with what is
accepted, and where drafts stop paying (few accepted per step, or misses in a row) the drafter
pauses for a growing number of plain chunks. `CostPacing` is a draft model's: it weighs the
drafts' cost too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

PAYS = 0.25  # accepted drafts per verify step (running mean) below which drafting pauses
HOT = 1.0  # ... above which a miss still verifies one token instead of a plain chunk
MAX_PAUSE = 16  # plain chunks a pause lasts at most
EMA = 0.3  # weight of the latest step in the running mean


@dataclasses.dataclass
class SpecStats:
    """What speculation did for one sequence."""

    verify_steps: int = 0  # verification steps run
    drafted: int = 0  # draft tokens proposed to them
    accepted: int = 0  # ... of which accepted
    plain_chunks: int = 0  # plain decode chunks run instead (no draft, or a pause)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification step produced, on average (accepted + the model's own)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def record(self, n_draft: int, n_out: int) -> None:
        """A verify step's outcome: n_draft drafts proposed, n_out tokens produced."""
        self.verify_steps += 1
        self.drafted += n_draft
        self.accepted += n_out - 1


class SpeculationSetting(Protocol):
    """A request's speculative decoding: what the plan compiles for it and its drafters' maker."""

    @property
    def kind(self) -> str: ...

    @property
    def draft_max(self) -> int: ...  # verification buckets up to draft_bucket(draft_max)

    @property
    def draft_min(self) -> int: ...

    @property
    def on_device(self) -> bool: ...  # the verification step drafts (MTP), not the drafter

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
    """The draft length k and the pauses of one drafter (the module docstring)."""

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


def best_length(rate: float, cost: float, draft_max: int) -> int:
    """The draft length k (1..draft_max) that makes the most tokens per unit of time when each
    draft token is accepted with probability `rate` (after an accepted one) and drafting one
    token costs `cost` verification steps (a verification of up to 8 rows costs about one plain
    step): expected tokens (1 - rate^(k+1)) / (1 - rate) over 1 + k cost; the longest of equals."""
    rate = min(max(rate, 0.0), 1.0)

    def tokens_per_cost(k: int) -> float:
        made = k + 1 if rate == 1.0 else (1 - rate ** (k + 1)) / (1 - rate)
        return made / (1 + k * cost)

    best = max(tokens_per_cost(k) for k in range(1, draft_max + 1))
    return max(k for k in range(1, draft_max + 1) if tokens_per_cost(k) >= best * (1 - 1e-9))


class CostPacing(Pacing):
    """Pacing for a drafter whose drafts cost time (a draft model): the draft length is
    best_length at the running per-token acceptance rate and the running cost of a drafted token
    (from an estimate, then from the times observed); pauses as Pacing's."""

    PRIOR = (3.0, 4.0)  # (accepted, tried) before any verification: a rate of 0.75

    def __init__(self, draft_max: int, cost: float):
        super().__init__(draft_max)
        self.cost = cost  # one drafted token's time over one verification's
        self.hits, self.tried = self.PRIOR
        self.k = best_length(self.rate, cost, draft_max)

    @property
    def rate(self) -> float:
        """The running per-token acceptance rate."""
        return self.hits / self.tried

    def record(self, n_draft: int, accepted: int) -> None:
        paused = self.pause
        super().record(n_draft, accepted)
        if n_draft == 0:
            return
        # the tokens tried: those accepted and the first rejected one
        rejected = 1 if accepted < n_draft else 0
        self.hits = (1 - EMA) * self.hits + accepted
        self.tried = (1 - EMA) * self.tried + accepted + rejected
        if self.pause > paused:  # a pause began: judged afresh after it
            self.hits, self.tried = self.PRIOR
        self.k = best_length(self.rate, self.cost, self.draft_max)

    def observe(self, draft_s: float, verify_s: float, n_draft: int) -> None:
        """A draft of n_draft tokens took draft_s seconds, its verification verify_s: the cost
        moves toward their ratio per token (bounded: a compile or a catch-up prefill is an
        outlier, not the new cost)."""
        if n_draft > 0 and verify_s > 0:
            sample = min(max(draft_s / n_draft / verify_s, 0.25 * self.cost), 4.0 * self.cost)
            self.cost += EMA * (sample - self.cost)
