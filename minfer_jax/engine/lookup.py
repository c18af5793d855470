"""Prompt lookup: the n-gram drafter of speculative decoding (no second model), on the host.

`Speculation` is a request's setting (generate(..., speculative="lookup"), the CLI's --spec-type);
`Drafter` is one sequence's drafting state. It proposes the tokens that followed the latest
earlier occurrence of the sequence's last n tokens (prompt and output so far; n from ngram_max
down to ngram_min, longest first), preferring the place its last accepted draft came from (code
re-emitted from the prompt keeps copying from the same place, where a short n-gram also occurs
elsewhere). The draft length adapts to what is accepted (draft buckets 1, 3, 7, 15: a verify step
of 1 + k rows, spec_plan.draft_bucket), and where drafts stop paying (misses in a row, or few
accepted) the drafter pauses for a growing number of plain decode chunks: drafter.Pacing's rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from minfer_jax import validate
from minfer_jax.engine.drafter import Pacing, SpecStats
from minfer_jax.engine.spec_plan import MAX_DRAFT
from minfer_jax.errors import InvalidArgumentError

# llama.cpp's --spec-type names (common/speculative); "lookup" is ours for ngram-simple, "mtp"
# for draft-mtp (the file's MTP block drafts in the verification step: MtpDrafter)
MTP_TYPES = ("draft-mtp", "mtp")
SPEC_TYPES = ("ngram-simple", "lookup", *MTP_TYPES)
LLAMA_CPP_SPEC_TYPES = (
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)
DEFAULT_DRAFT_MAX = 7  # 1 + 7 = 8 rows: the GEMV's largest, about one decode step's cost
DEFAULT_MTP_DRAFT = 3  # chained MTP drafts: the block is trained for one, acceptance falls after


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A request's speculative decoding: prompt lookup drafts of draft_min..draft_max tokens from
    n-grams of ngram_min..ngram_max tokens."""

    kind: str = "lookup"
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 1
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self):
        validate.choice("speculative", self.kind, SPEC_TYPES)
        validate.integer("draft_max", self.draft_max, 1, MAX_DRAFT)
        validate.integer("draft_min", self.draft_min, 0, self.draft_max)
        validate.integer("ngram_max", self.ngram_max, 1, 64)
        validate.integer("ngram_min", self.ngram_min, 1, self.ngram_max)

    @property
    def on_device(self) -> bool:
        """The verification step drafts (MTP: model/mtp.py), not the host."""
        return self.kind in MTP_TYPES

    def new_drafter(self, prompt: Sequence[int] = ()) -> Drafter:
        """One sequence's drafter (drafter.SpeculationSetting; the prompt is read as it drafts)."""
        return MtpDrafter(self) if self.on_device else Drafter(self)


def speculation_of(kind, draft_max=None, draft_min=None) -> Speculation | None:
    """generate()'s and the CLI's settings as a Speculation (None or "none": off); a llama.cpp
    type this engine has no drafter for is an InvalidArgumentError saying so."""
    if kind is None or kind == "none":
        if draft_max is not None or draft_min is not None:
            raise InvalidArgumentError("draft_max / draft_min need speculative='lookup'")
        return None
    if kind in LLAMA_CPP_SPEC_TYPES and kind not in SPEC_TYPES:
        raise InvalidArgumentError(
            f"speculative decoding of type {kind!r} is not implemented: only prompt lookup "
            f"and MTP ({' / '.join(repr(t) for t in SPEC_TYPES)}) and a draft model ('draft')"
        )
    if kind in MTP_TYPES and draft_max is None:
        draft_max = DEFAULT_MTP_DRAFT
    fields = {"draft_max": draft_max, "draft_min": draft_min}
    return Speculation(kind, **{k: v for k, v in fields.items() if v is not None})


class Drafter:
    """One sequence's prompt-lookup state (the module docstring)."""

    def __init__(self, spec: Speculation):
        self.spec = spec
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(spec.ngram_max + 1)]
        self.indexed = 0  # n-grams ending before this position are in the index
        self.offset: int | None = None  # where the last accepted draft came from, minus seq length
        self.pacing = Pacing(spec.draft_max)  # the draft length and the pauses
        self.stats = SpecStats()
        self._pending: int | None = None  # source position of the draft in flight

    @property
    def wants_tokens(self) -> bool:
        """Whether the next propose() reads the sequence (else, paused, the row decodes plain
        chunks and its tokens may be read late, as any plain row's)."""
        return self.pacing.pause == 0

    def propose(self, seq: list[int], room: int) -> list[int] | None:
        """The draft to verify after seq (at most room - 1 tokens: room is what the sequence may
        still produce); [] verifies one token without a draft; None runs a plain chunk."""
        if self.pacing.paused():
            self.stats.plain_chunks += 1
            return None
        self._extend_index(seq)
        k = min(self.pacing.k, room - 1)
        source = self._source(seq) if k > 0 else None
        draft = _continuation(seq, source, k) if source is not None else []
        if len(draft) < max(self.spec.draft_min, 1):
            if self.pacing.missed(room):
                self._pending = None
                return []
            self.stats.plain_chunks += 1
            return None
        self._pending = (source or 0) - len(seq)
        return draft

    def record(self, n_draft: int, n_out: int) -> None:
        """A verify step's outcome: n_draft drafts proposed, n_out tokens produced."""
        self.stats.record(n_draft, n_out)
        if n_draft == 0:
            return
        # the source stays aligned where the draft was accepted whole (the model's own token
        # may continue it too; the next lookup checks)
        self.offset = self._pending if n_out - 1 == n_draft else None
        self.pacing.record(n_draft, n_out - 1)

    def _extend_index(self, seq: list[int]) -> None:
        """Index the n-grams ending at positions indexed .. len(seq) - 1 (not the sequence's own
        last n-gram: a match must have a continuation)."""
        top = self.spec.ngram_max
        for end in range(max(self.indexed, 1), len(seq)):
            for n in range(self.spec.ngram_min, min(top, end) + 1):
                self.index[n][tuple(seq[end - n : end])] = end
        self.indexed = max(self.indexed, len(seq))

    def _source(self, seq: list[int]) -> int | None:
        """Where the draft's tokens start in seq: the followed place if its last ngram_min tokens
        still match, else the latest occurrence of the longest matching n-gram."""
        n_min = self.spec.ngram_min
        if self.offset is not None:
            at = len(seq) + self.offset
            if n_min <= at < len(seq) and seq[at - n_min : at] == seq[-n_min:]:
                return at
        for n in range(min(self.spec.ngram_max, len(seq)), n_min - 1, -1):
            end = self.index[n].get(tuple(seq[-n:]))
            if end is not None:
                return end
        return None


class MtpDrafter(Drafter):
    """A sequence's MTP speculation on the host: how many tokens the device drafts next (the
    draft length adapting as lookup's does); the tokens themselves never come here (verify.py
    drafts them with the file's MTP block). It never pauses: a plain decode chunk would leave the
    block's cache behind the sequence."""

    def propose(self, seq: list[int], room: int) -> list[int]:
        """Placeholders for min(k, room - 1) drafts."""
        return [0] * min(self.pacing.k, room - 1)

    def record(self, n_draft: int, n_out: int) -> None:
        super().record(n_draft, n_out)
        self.pacing.pause = 0


def check_speculation(cfg, constraint, logprobs: int | None = None) -> None:
    """What speculation cannot combine with yet: a grammar (each token needs the host before the
    next is drafted against its mask) and logprobs (the verification step does not compute them).
    Recurrent layers roll back through per-token snapshots (model/speculative.py)."""
    if logprobs is not None:
        raise InvalidArgumentError("speculative decoding does not report logprobs yet")
    if constraint is not None and constraint.dynamic:
        raise InvalidArgumentError(
            "speculative decoding does not combine with a grammar or JSON schema yet"
        )


def _continuation(seq: list[int], source: int, k: int) -> list[int]:
    """k tokens from seq[source], continued periodically where they run into seq's end (a match
    near the end is a repeat of period len(seq) - source)."""
    out: list[int] = []
    for j in range(source, source + k):
        out.append(seq[j] if j < len(seq) else out[j - len(seq)])
    return out
