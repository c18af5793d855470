"""One generation request as the scheduler (scheduler.py) holds it: prompt and settings in, its
clock (Timing), streamed text and a GenerationResult out."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from minfer_jax.engine import steps
from minfer_jax.engine.constraint import ConstraintError, TokenConstraint
from minfer_jax.engine.drafter import Drafter, SpeculationSetting
from minfer_jax.engine.sampling import Sampled, Sampler, TokenLogprobs
from minfer_jax.engine.text_stream import TextStream

_ids = itertools.count()


@dataclasses.dataclass
class Timing:
    """A request's clock, kept by the scheduler: when its prefill was dispatched and its first token
    read, the loop's compile seconds at each (compiles are subtracted from the phase they stalled),
    and the seconds each phase took."""

    start: float | None = None  # prefill dispatched (perf_counter)
    first: float | None = None  # first token read
    compile_at_start: float = 0.0  # Scheduler.compile_s at start / at first
    compile_at_first: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0

    def started(self, compile_s: float) -> None:
        """Its prefill is dispatched (compile_s: the loop's compile seconds so far)."""
        self.start, self.compile_at_start = time.perf_counter(), compile_s

    def first_read(self, compile_s: float) -> None:
        """Its first token is read: the prefill's seconds, less the compiles since it started."""
        self.first = time.perf_counter()
        assert self.start is not None  # set when its prefill was dispatched
        self.prefill_s = self.first - self.start - (compile_s - self.compile_at_start)
        self.compile_at_first = compile_s

    def finished(self, compile_s: float) -> None:
        """It ends: the decode's seconds less the compiles since the first token, and the
        compiles it waited for."""
        if self.first is not None:
            self.decode_s = time.perf_counter() - self.first - (compile_s - self.compile_at_first)
        if self.start is not None:
            self.compile_s += compile_s - self.compile_at_start


class Request:
    """One generation: prompt and settings in, streamed text and a GenerationResult out."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampler: Sampler,
        seed: int,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        on_done: Callable[[Request], None] | None = None,
        constraint: TokenConstraint | None = None,
        speculation: SpeculationSetting | None = None,
        logprobs: int | None = None,
        leader: Request | None = None,
    ):
        self.id = next(_ids)
        # speculative decoding (drafter.py): this sequence's drafter, None when off
        self.drafter: Drafter | None = (
            speculation.new_drafter(prompt_ids) if speculation is not None else None
        )
        # alternatives each token reports with its logprob (0..TOP_LOGPROBS; None: no logprobs)
        self.logprobs = logprobs
        self.token_logprobs: list[steps.TokenLogprob] = []  # one per token of stream.tokens
        # the request whose prefill this one shares (n > 1: the same prompt, its K/V copied)
        self.leader = leader
        self.constraint = constraint  # the tokens it may sample (grammar, banned EOS)
        self.prompt = [int(t) for t in prompt_ids]
        self.max_new_tokens, self.sampler, self.seed = max_new_tokens, sampler, seed
        self.stop, self.on_text = tuple(stop), on_text
        self.on_done = on_done  # called from the loop's thread once done is set (must not raise)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._cancelled = False
        # scheduler-side state (touched by the loop's thread only)
        self.stream: TextStream | None = None
        self.slot: int | None = None
        self.chunks: list[tuple[int, int, int]] = []
        self.produced = 0  # tokens sampled by dispatched work (the first by the last prefill chunk)
        self.cached = 0  # prompt tokens reused from the slot's previous sequence (prefix reuse)
        # most tokens this sequence may produce (max_new_tokens, or the context's room)
        self.limit = 0
        self.timing = Timing()

    def cancel(self) -> None:
        """Stop generating (a client went away); the slot is freed at the next step."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def finished(self) -> bool:
        return self.stream is not None and self.stream.reason is not None

    def result(self, timeout: float | None = None) -> steps.GenerationResult:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        s, t = self.stream, self.timing
        assert s is not None and s.reason is not None  # done without an error: finished
        return steps.GenerationResult(
            tokens=list(s.tokens),
            text=s.text,
            prompt_tokens=self.prompt,
            stop_reason=s.reason,
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            compile_s=t.compile_s,
            cached_tokens=self.cached,
            speculation=None if self.drafter is None else self.drafter.stats,
            logprobs=None if self.logprobs is None else list(self.token_logprobs),
            stop_string=s.stop_string,
        )


def on_host(out, logprobs: bool) -> tuple[np.ndarray, TokenLogprobs | None]:
    """A step's tokens on the host (waits for them) and, where asked and computed, their
    logprobs."""
    if isinstance(out, Sampled):
        lps = jax.tree.map(np.asarray, out.logprobs) if logprobs else None
        return np.asarray(out.tokens), lps
    return np.asarray(out), None


def token_logprob(token: int, lps: TokenLogprobs, i: int, top: int) -> steps.TokenLogprob:
    """Row i of host logprobs as the result's entry, with `top` alternatives."""
    alternatives = zip(lps.top_ids[i][:top].tolist(), lps.top[i][:top].tolist())
    return steps.TokenLogprob(int(token), float(lps.chosen[i]), tuple(alternatives))


def kept_tokens(req: Request) -> list[int]:
    """The tokens whose K/V req's slot holds at [0, len) once req ends: the prompt up to the
    first chunk not dispatched, then every generated token that was fed back (all but the
    last one produced; a token a late stop discarded lies past them)."""
    written = req.chunks[0][0] if req.chunks else len(req.prompt)
    kept = req.prompt[:written]
    if written == len(req.prompt) and req.stream is not None:
        kept += list(req.stream.tokens)[:-1]
    return kept


def chunk_inputs(
    prompt: list[int], start: int, n_valid: int, bucket: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """A prefill chunk's tokens [bucket] (prompt[start:start + n_valid], then padding) and the
    repeat-penalty history [width] after it (the prompt's last width tokens so far; -1: none)."""
    tokens = np.zeros((bucket,), np.int32)
    tokens[:n_valid] = prompt[start : start + n_valid]
    history = np.full((width,), -1, np.int32)
    tail = prompt[max(0, start + n_valid - width) : start + n_valid] if width else []
    history[width - len(tail) :] = tail
    return tokens, history


def position(req: Request) -> int:
    """Where req's last token goes (all its tokens dispatched so far were fed back)."""
    return len(req.prompt) + req.produced - 1


def row_places(
    rows: Sequence[Request], width: int, scratch_slot: int
) -> tuple[np.ndarray, np.ndarray]:
    """A batch step's slots and positions [width] (each row's last token): padded rows in the
    scratch slot at position 0."""
    slots = np.full((width,), scratch_slot, np.int32)
    positions = np.zeros((width,), np.int32)
    for i, r in enumerate(rows):
        assert r.slot is not None  # a decoding row holds a slot
        slots[i], positions[i] = r.slot, position(r)
    return slots, positions


def follows_tokens(req: Request) -> bool:
    """req's mask changes with every token it samples (a grammar)."""
    return req.constraint is not None and req.constraint.dynamic


def deliver(req: Request, tokens: list[int], lps=None) -> steps.StopReason | None:
    """Hand tokens to req's stream (its constraint advanced, its logprobs kept; lps: their
    TokenLogprobs, host arrays, a row a token) and its new text to on_text; returns why req ends
    now (None: it goes on). A token its constraint refuses ends it with the error."""
    stream = req.stream
    assert stream is not None  # tokens reach started requests only
    for i, t in enumerate(tokens):
        if req.constraint is not None and stream.reason is None:
            try:
                req.constraint.advance(t)
            except ConstraintError as e:
                req.error = e
                return steps.StopReason.ERROR
        kept = len(stream.tokens)
        stream.push(t)
        if lps is not None and req.logprobs is not None and len(stream.tokens) > kept:
            req.token_logprobs.append(token_logprob(t, lps, i, req.logprobs))
    piece = stream.take()
    if piece and req.on_text is not None:
        req.on_text(piece)
    return stream.reason
