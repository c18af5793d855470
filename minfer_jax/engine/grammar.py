"""Grammars and JSON Schemas as token constraints, through llguidance (the `grammar` extra).

`Grammars` (one per model, `Model.grammars`) turns a `GrammarSpec` into a `GrammarMask`: the spec
becomes llguidance's grammar text, which is compiled once into a matcher and cached (by that text,
least recently used first out); each request gets a copy. Compiling drops the GIL (llguidance),
and callers run it off the scheduler's thread (the server in a worker thread), so a slow schema
never stalls other streams; llguidance's parser limits bound its time and memory, and a grammar
past them is a ConstraintError. The llguidance tokenizer is built once from the GGUF's own
tokenizer (its HF `tokenizers` backend), the vocabulary padded to the model's.

Hostile input (tests/hostile_grammars.py, 100+ cases): text past a size limit, a GBNF of more
rules than its (quadratic, pure Python) converter takes in bounded time, and more `$ref`s or Lark
rules than llguidance's recursive compiler takes are refused before compiling; the compile and the
first mask run on a thread with a deep stack (llguidance recurses once per level of a `$ref` or
rule chain: ~1000 levels overflow a default 8 MiB thread stack and kill the process); a grammar
that admits no text at all is refused once its first mask shows it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import numpy as np

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.sampling import mask_words

CACHED_GRAMMARS = 64  # compiled matchers kept per model
# a schema or grammar text longer than this is refused before compiling (a lexeme costs ~400 bytes
# of lexer memory per character once its first mask is computed: ~100 MiB at this size)
MAX_GRAMMAR_CHARS = 1 << 18
# llguidance's GBNF converter is pure Python and quadratic in the rules: ~1.5 s at these bounds
MAX_GBNF_CHARS = 1 << 17
MAX_GBNF_RULES = 512
# llguidance recurses per level of a $ref or rule chain; with COMPILE_STACK_BYTES the chains these
# allow use a tenth of the stack at most (~1000 levels fill 8 MiB)
MAX_SCHEMA_REFS = 1000
MAX_LARK_RULES = 4096
COMPILE_STACK_BYTES = 256 << 20  # address space, committed only as deep as the compile goes
# a server's compile threads' nice value (Linux: per thread): where cores are short, the streams
# decoding get them first and a compile takes what they leave (Grammars.compile_nice)
SERVING_COMPILE_NICE = 10
# Earley items in one row: llguidance's default (2000) ends a schema of ~500 properties, or a
# GBNF of 2000 alternatives, at its first token; the work per token stays capped by its
# step_max_items (50k items, ~2.5 ms)
MAX_ITEMS_IN_ROW = 20_000
KIND_NAMES = {"json_schema": "JSON Schema", "gbnf": "GBNF grammar", "lark": "Lark grammar"}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What constrains a reply: a JSON Schema (any JSON object for json_object), a Lark grammar
    (llguidance's dialect) or a GBNF grammar (llama.cpp's)."""

    kind: Literal["json_schema", "lark", "gbnf"]
    text: str  # the schema as JSON text, or the grammar

    @staticmethod
    def json_schema(schema: Any) -> GrammarSpec:
        if schema is False:
            raise ConstraintError("the JSON Schema false admits no value")
        if schema is True:  # any value: the empty schema
            schema = {}
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON Schema is an object, got {type(schema).__name__}")
        try:
            return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))
        except RecursionError:
            raise ConstraintError("the JSON Schema is nested too deeply") from None

    @staticmethod
    def grammar(text: str) -> GrammarSpec:
        """A grammar as llama.cpp takes it (GBNF), or llguidance's Lark when it opens with
        `%llguidance`."""
        if not isinstance(text, str):
            raise ConstraintError(f"a grammar is text, got {type(text).__name__}")
        return GrammarSpec("lark" if text.lstrip().startswith("%llguidance") else "gbnf", text)

    @staticmethod
    def json_object() -> GrammarSpec:
        return GrammarSpec.json_schema({"type": "object"})


def _llguidance():
    """The llguidance module (ConstraintError when it is not installed)."""
    try:
        import llguidance
    except ImportError:
        raise ConstraintError(
            "constrained output needs llguidance: pip install 'minfer_jax[grammar]'"
        ) from None
    return llguidance


_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.M)
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?[ \t]*:", re.M)


def _check_size(spec: GrammarSpec) -> None:
    """Refuse a spec past the bounds llguidance compiles in bounded time, memory and stack."""
    name = KIND_NAMES[spec.kind]
    most = MAX_GBNF_CHARS if spec.kind == "gbnf" else MAX_GRAMMAR_CHARS
    if len(spec.text) > most:
        raise ConstraintError(f"the {name} is {len(spec.text)} characters (at most {most})")
    counted = {
        "gbnf": ("rules", _GBNF_RULE, MAX_GBNF_RULES),
        "lark": ("rules", _LARK_RULE, MAX_LARK_RULES),
        "json_schema": ("$refs", re.compile(r'"\$ref"'), MAX_SCHEMA_REFS),
    }
    what, pattern, limit = counted[spec.kind]
    found = sum(1 for _ in pattern.finditer(spec.text))
    if found > limit:
        raise ConstraintError(f"the {name} has {found} {what} (at most {limit})")
    refs = spec.text.count('"$ref"')  # %json schemas inside a grammar too
    if refs > MAX_SCHEMA_REFS:
        raise ConstraintError(f"the {name} has {refs} $refs (at most {MAX_SCHEMA_REFS})")


Result = TypeVar("Result")
_stack_size_lock = threading.Lock()


def on_deep_stack(fn: Callable[[], Result], nice: int = 0) -> Result:
    """fn() on a fresh thread of COMPILE_STACK_BYTES of stack, its nice value raised by `nice`
    (its exception re-raised here)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        if nice:
            with contextlib.suppress(AttributeError, OSError):  # no per-thread priority here
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001  handed to the caller's thread
            outcome["error"] = e

    with _stack_size_lock:  # the size applies to threads started while it is set
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec (ConstraintError for one it cannot read)."""
    llguidance = _llguidance()
    _check_size(spec)
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_flexible": False}
            )
        if spec.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    except RecursionError:  # the GBNF converter's recursive descent
        raise ConstraintError(f"the {KIND_NAMES[spec.kind]} is nested too deeply") from None
    except Exception as e:  # noqa: BLE001  llguidance's parse errors: the user's grammar
        raise ConstraintError(f"invalid {KIND_NAMES[spec.kind]}: {e}") from None


class GrammarMask:
    """A request's grammar state: the tokens allowed next, and each sampled token taken."""

    dynamic = True

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        # the first mask, computed now (off the scheduler's thread)
        self.ready: np.ndarray | None = np.full((words,), -1, np.int32)
        self._compute(self.ready)

    def _compute(self, row: np.ndarray) -> None:
        # never raises on the scheduler's thread: a matcher in error ends its request at the next
        # token (advance), not the batch
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill(self, row: np.ndarray) -> None:
        if self.ready is not None:
            row[:] = self.ready
            self.ready = None
            return
        self._compute(row)

    def advance(self, token: int) -> None:
        self.ready = None
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())


def _probe_first_token(spec: GrammarSpec, mask: GrammarMask) -> None:
    """Take one allowed first token on a copy: a grammar past llguidance's per-token limits
    fails here, as a refusal, rather than at the request's first token."""
    assert mask.ready is not None
    words = np.flatnonzero(mask.ready)
    if not len(words):
        return
    word = int(words[0])
    bits = int(mask.ready[word]) & 0xFFFFFFFF
    token = word * 32 + (bits & -bits).bit_length() - 1
    probe = mask.matcher.deep_copy()
    if not probe.consume_token(token) or probe.is_error():
        raise ConstraintError(
            f"the {KIND_NAMES[spec.kind]} is past the parser's limits at its first token: "
            f"{probe.get_error().removesuffix('<non-verbose/>').strip()}"
        )


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary (see the module docstring)."""

    def __init__(self, tokenizer, vocab: int, capacity: int = CACHED_GRAMMARS):
        self.tokenizer, self.vocab, self.capacity = tokenizer, vocab, capacity
        self.compile_nice = 0  # the server sets SERVING_COMPILE_NICE
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def ll_tokenizer(self):
        """llguidance's tokenizer, built on first use (about a second for a 150k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llguidance = _llguidance()
                if self.tokenizer is None:
                    raise ConstraintError("this model has no tokenizer, so no grammar can apply")
                eos = self.tokenizer.eos_id
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend_json(),
                    n_vocab=self.vocab,
                    eos_token=eos if eos is not None else min(self.tokenizer.eos_ids, default=0),
                )
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> GrammarMask:
        """A fresh GrammarMask for spec (ConstraintError for a bad or too costly grammar); the
        work runs on a deep stack (on_deep_stack)."""
        self.ll_tokenizer()  # built on this thread: its first use is slow, not deep
        return on_deep_stack(lambda: self._compile(spec), self.compile_nice)

    def _compile(self, spec: GrammarSpec) -> GrammarMask:
        text = grammar_text(spec)
        with self._lock:
            template = self._cache.get(text)
            if template is not None:
                self._cache.move_to_end(text)
        if template is not None:
            return GrammarMask(template.deep_copy(), mask_words(self.vocab))
        template = self._matcher(text)
        mask = GrammarMask(template.deep_copy(), mask_words(self.vocab))
        if mask.matcher.is_error():  # e.g. a rule or $ref that is only itself
            raise ConstraintError(
                f"the {KIND_NAMES[spec.kind]} admits no text: no token can begin it "
                "(a rule or $ref defined only by itself?)"
            )
        _probe_first_token(spec, mask)
        with self._lock:
            self._cache[text] = template
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return mask

    def _matcher(self, text: str):
        llguidance = _llguidance()
        limits = llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=MAX_ITEMS_IN_ROW)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0, limits=limits)
        if matcher.is_error():
            raise ConstraintError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return matcher

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return grammar_text(spec) in self._cache
