"""The CLI's generation session: one request at a time through the model's scheduler, with a
"compiling ..." message (animated on a terminal) for what the scheduler says it will run first,
and the prompt/generation speed summary printed on stderr."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence

from minfer_jax.engine.drafter import SpeculationSetting
from minfer_jax.engine.phases import format_executable, process_age
from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import CONTENT, HarmonyStream, split_channels

CHUNK = 16  # tokens per on-device decode call: text streams out once per chunk


@dataclasses.dataclass
class _Totals:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, reused from the previous turn's K/V (not prefilled)
    prefill_s: float = 0.0
    generated: int = 0
    # generated tokens that came out of decode (the first comes from prefill)
    decode_tokens: int = 0
    decode_s: float = 0.0
    compile_s: float = 0.0
    stop_reason: StopReason | None = None
    turns: int = 0

    def add(self, other: _Totals) -> None:
        for f in dataclasses.fields(self):
            if f.name != "stop_reason":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.stop_reason = other.stop_reason


def _rate(n: int, s: float) -> str:
    return f"{n / s:.1f} tok/s" if s > 0 and n > 0 else "n/a tok/s"


def _summary(t: _Totals) -> str:
    cached = f" ({t.cached_tokens} reused)" if t.cached_tokens else ""
    return (
        f"prompt: {t.prompt_tokens} tokens{cached}, "
        f"{_rate(t.prompt_tokens - t.cached_tokens, t.prefill_s)} ({t.prefill_s:.2f} s) | "
        f"generated: {t.generated} tokens, {_rate(t.decode_tokens, t.decode_s)} ({t.decode_s:.2f} "
        "s)\n"
        f"compile: {t.compile_s:.2f} s | stop: {t.stop_reason or '-'}\n"
    )


@dataclasses.dataclass(eq=False)
class _Session:
    model: object
    sampler: object
    seed: int
    max_len: int
    n_predict: int
    stop: tuple
    stream: bool
    out: object
    err: object
    verbose: bool
    constrain: dict = dataclasses.field(default_factory=dict)  # Model.constraint's keywords
    speculation: SpeculationSetting | None = None  # --spec-type or -md, and the draft sizes
    totals: _Totals = dataclasses.field(default_factory=_Totals)
    last: _Totals | None = None
    partial: list = dataclasses.field(default_factory=list)  # text streamed by the current reply
    wrote_any: bool = False
    last_char_newline: bool = False
    first_text_at: float | None = None  # seconds after the process started (phases.process_age)
    # a harmony chat (gpt-oss): the reply's channels, the answer to stdout, reasoning to stderr
    channels: HarmonyStream | None = None

    def write(self, text: str) -> None:
        if not text:
            return
        self.out.write(text)
        self.out.flush()
        if not self.wrote_any:
            self.first_text_at = process_age()
        self.wrote_any = True
        self.last_char_newline = text.endswith("\n")

    def _on_text(self, text: str) -> None:
        if self.channels is None:
            self._show(CONTENT, text)
            return
        for field, piece in self.channels.feed(text):
            self._show(field, piece)

    def _show(self, field: str, text: str) -> None:
        """A streamed piece: the answer to stdout (and the turn's text), reasoning to stderr."""
        if field == CONTENT:
            self.partial.append(text)
            self.write(text)
        else:
            self.err.write(text)
            self.err.flush()

    def answer(self, text: str) -> str:
        """What of a reply's text is the answer (a harmony chat: its final channel)."""
        return text if self.channels is None else split_channels(text)[CONTENT]

    def generate(self, ids: Sequence[int], *, turn: int = 0):
        max_new = self.n_predict if self.n_predict >= 0 else self.max_len
        self.partial = []
        if self.channels is not None:
            self.channels = HarmonyStream()
        result, compile_s = self._produce(ids, max_new, (self.seed + turn) % 2**32)
        if self.channels is not None and self.stream:
            for field, piece in self.channels.finish():
                self._show(field, piece)
        self.last = _Totals(
            prompt_tokens=result.n_prompt,
            cached_tokens=result.cached_tokens,
            prefill_s=result.prefill_s,
            generated=len(result.tokens),
            decode_tokens=max(len(result.tokens) - 1, 0),
            decode_s=result.decode_s,
            compile_s=compile_s + result.compile_s,
            stop_reason=result.stop_reason,
            turns=1,
        )
        self.totals.add(self.last)
        return result

    def _produce(self, ids: Sequence[int], max_new: int, seed: int):
        """One generation through the model's scheduler: (GenerationResult, seconds compiling
        ahead)."""
        sched = self.model.scheduler(1, ctx=self.max_len, decode_steps=CHUNK)
        constraint = self.model.constraint(**self.constrain)  # type: ignore[attr-defined]
        req = sched.submit(
            ids,
            max_new_tokens=max_new,
            sampler=self.sampler,
            seed=seed,
            stop=self.stop,
            on_text=self._on_text if self.stream else None,
            constraint=constraint,
            speculation=self.speculation,
        )
        one_step = constraint is not None and constraint.dynamic
        compile_s = self._compile_ahead(sched, len(ids), max_new, one_step)
        sched.run([req])
        return req.result(), compile_s

    def _compile_ahead(self, sched, n: int, max_new: int, one_step: bool = False) -> float:
        """Compile what the scheduler says this generation runs first, with a message on stderr."""
        needed = sched.needed(
            n, max_new, self.sampler, one_step=one_step, speculation=self.speculation
        )
        todo = [k for k in needed if not self.model.is_compiled(k)]
        if not todo:
            return 0.0
        what = " + ".join(k.label for k in todo)
        stored = all(self.model.in_store(k) for k in todo)
        message = f"loading {what} from the executable store" if stored else f"compiling {what}"
        with _Spinner(
            self.err, f"{message} (context {self.max_len})", "loaded" if stored else "compiled"
        ) as spin:
            sched.compile(todo)
        if self.verbose:
            for k in todo:
                rec = self.model.executable_record(k)
                if rec is not None:
                    self.err.write(format_executable(rec) + "\n")
        return spin.elapsed


class _Spinner:
    """'compiling ...' on stderr: an animated line on a terminal, two plain lines otherwise."""

    def __init__(self, err, message: str, done: str = "compiled"):
        self.err, self.message, self.done = err, message, done
        self.animate = bool(getattr(err, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = None
        self.elapsed = 0.0

    def _spin(self):
        for ch in itertools.cycle("|/-\\"):
            with contextlib.suppress(Exception):
                self.err.write(f"\r{self.message} ... {ch} {time.perf_counter() - self._t0:4.0f} s")
                self.err.flush()
            if self._stop.wait(0.2):
                return

    def __enter__(self):
        self._t0 = time.perf_counter()
        if self.animate:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            self.err.write(f"{self.message} ...\n")
            self.err.flush()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.elapsed = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        status = f"done in {self.elapsed:.1f} s" if exc_type is None else "interrupted"
        if self.animate:
            self.err.write(f"\r\033[K{self.message} ... {status}\n")
        else:
            self.err.write(
                f"{self.done} in {self.elapsed:.1f} s\n"
                if exc_type is None
                else "compile interrupted\n"
            )
        self.err.flush()
        return False
