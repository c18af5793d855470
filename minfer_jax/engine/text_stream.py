"""Token ids -> the text a caller sees for one sequence: EOS, stop strings (held back until they
can no longer start one, so a stop split over two chunks never leaks) and the length / context
limits (scheduler.py feeds it each chunk's tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from minfer_jax.engine.steps import StopReason


class TextStream:
    """Token ids -> text pieces for one sequence, with EOS, stop strings and length/context limits.

    A stop string's length of text is held back until it can no longer start a stop string, so a
    stop split over two chunks never leaks.
    """

    def __init__(self, tokenizer, *, max_new_tokens: int, limit: int, stop: Sequence[str]):
        self.decoder = tokenizer.decode_stream(skip_special=True) if tokenizer is not None else None
        self.eos = tokenizer.eos_ids if tokenizer is not None else frozenset()
        self.max_new, self.limit = max_new_tokens, limit
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.reason: StopReason | None = None
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    def push(self, token: int) -> None:
        """Take one sampled token (ignored once the sequence has ended)."""
        if self.reason is not None:
            return
        if token in self.eos:
            self.reason = StopReason.EOS
        else:
            self.tokens.append(token)
            if self.decoder is not None:
                self.text += self.decoder.step(token)
            cut, which = self._earliest_stop()
            if cut >= 0:
                self.text, self.reason, self.stop_string = self.text[:cut], StopReason.STOP, which
            elif len(self.tokens) >= self.limit:  # no cache position left to feed this token
                self.reason = StopReason.CONTEXT
            elif len(self.tokens) >= self.max_new:
                self.reason = StopReason.LENGTH
        if self.reason is not None and self.reason != StopReason.STOP and self.decoder is not None:
            self.text += self.decoder.finish()

    def _earliest_stop(self) -> tuple[int, str | None]:
        """(where the earliest stop string starts, which one); (-1, None) where none does."""
        # Text before emitted - hold was searched when it arrived: a stop cannot start there now.
        frm = max(0, self.emitted - self.hold)
        hits = [(h, s) for s in self.stop if (h := self.text.find(s, frm)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else (-1, None)

    def take(self) -> str:
        """Text that is final now (all of it once the sequence has ended)."""
        end = (
            len(self.text)
            if self.reason is not None
            else max(len(self.text) - self.hold, self.emitted)
        )
        piece, self.emitted = self.text[self.emitted : end], end
        return piece
