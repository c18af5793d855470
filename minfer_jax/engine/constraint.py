"""Token constraints: which tokens a request may sample next, as a bitmask row for the sampler.

A constraint is either fixed (`BannedTokens`: ignore_eos) or follows each token the request
samples (`GrammarMask`, engine/grammar.py). The scheduler gives the jitted sampler one mask input
for every batch (all bits set for free rows, sampling.all_allowed), so constrained and free rows
share the same executables; a dynamic constraint's row waits for its own token before its next
step (scheduler.py), a fixed one does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import jax
import numpy as np

from minfer_jax.engine.sampling import mask_words
from minfer_jax.errors import InvalidArgumentError


class ConstraintError(InvalidArgumentError):
    """A grammar or schema that cannot be compiled, or a token that breaks one."""


class TokenConstraint(Protocol):
    # the mask changes with every token: the host must see each token before the next step
    dynamic: bool

    def fill(self, row: np.ndarray) -> None:
        """Clear the bits of the tokens not allowed next in row (int32 [words], all bits set)."""

    def advance(self, token: int) -> None:
        """Take the sampled token (ConstraintError: it breaks the constraint)."""


def clear_bits(row: np.ndarray, ids: Iterable[int]) -> None:
    """Clear the bits of these token ids in a mask row (int32 words)."""
    view = row.view(np.uint32)
    for t in ids:
        view[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


class BannedTokens:
    """Tokens that may never be sampled (ignore_eos: the end-of-sequence tokens)."""

    dynamic = False

    def __init__(self, ids: Iterable[int]):
        self.ids = sorted(set(ids))

    def fill(self, row: np.ndarray) -> None:
        clear_bits(row, self.ids)

    def advance(self, token: int) -> None:
        if token in self.ids:  # the mask makes this impossible: a sampler bug, not the user's
            raise ConstraintError(f"token {token} is banned but was sampled")


def batch_mask(constraints: list[TokenConstraint | None], rows: int, vocab: int) -> np.ndarray:
    """The mask input for a batch: row i from constraints[i] (None: all allowed), padded rows
    all allowed."""
    mask = np.full((rows, mask_words(vocab)), -1, np.int32)
    for i, c in enumerate(constraints):
        if c is not None:
            c.fill(mask[i])
    return mask


class BatchMasks:
    """A batch's mask input: one all-allowed device array per width while no row is constrained
    (nothing to send each step), else built on the host."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.free: dict[int, jax.Array] = {}  # batch width -> all-allowed mask on the device

    def __call__(self, constraints: list[TokenConstraint | None], width: int):
        if all(c is None for c in constraints):
            if width not in self.free:
                self.free[width] = jax.device_put(batch_mask([], width, self.vocab))
            return self.free[width]
        return batch_mask(constraints, width, self.vocab)
