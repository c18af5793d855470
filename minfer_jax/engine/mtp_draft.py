"""Speculative decoding's MTP drafter on the host (`speculative="draft-mtp"`, llama.cpp's
spelling): how many tokens the verification step drafts with the file's MTP block (model/mtp.py
drafts, verifies' and catches up on the device; engine/verify.py runs it)."""

from __future__ import annotations

from minfer_jax.engine.lookup import MAX_PAUSE, MTP_TYPES, Drafter, Speculation


class MtpDrafter(Drafter):
    """A sequence's MTP speculation on the host: how many tokens the device drafts next (the
    draft buckets' length adapting as lookup's does); the tokens themselves never come here. It
    never pauses: a plain decode chunk would leave the block's cache behind the sequence."""

    def propose(self, seq: list[int], room: int) -> list[int]:
        """Placeholders for min(k, room - 1) drafts (verify.py drafts them on the device)."""
        return [0] * min(self.k, room - 1)

    def record(self, n_draft: int, n_out: int) -> None:
        super().record(n_draft, n_out)
        self.pause, self.backoff = 0, min(self.backoff, MAX_PAUSE)


def drafter_for(spec: Speculation) -> Drafter:
    """The drafter a request's Speculation asks for."""
    return MtpDrafter(spec) if spec.kind in MTP_TYPES else Drafter(spec)
