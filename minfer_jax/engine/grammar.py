"""Grammars and JSON Schemas as token constraints, through llguidance (the `grammar` extra).

`Grammars` (one per model, `Model.grammars`) turns a `GrammarSpec` into a `GrammarMask`: the spec
becomes llguidance's grammar text, which is compiled once into a matcher and cached (by that text,
least recently used first out); each request gets a copy. Compiling drops the GIL (llguidance),
and callers run it off the scheduler's thread (the server in a worker thread), so a slow schema
never stalls other streams; llguidance's parser limits bound its time and memory, and a grammar
past them is a ConstraintError. The llguidance tokenizer is built once from the GGUF's own
tokenizer (its HF `tokenizers` backend), the vocabulary padded to the model's.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Literal

import numpy as np

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.sampling import mask_words

CACHED_GRAMMARS = 64  # compiled matchers kept per model
# a schema or grammar text longer than this is refused before compiling
MAX_GRAMMAR_CHARS = 1 << 20
KIND_NAMES = {"json_schema": "JSON Schema", "gbnf": "GBNF grammar", "lark": "Lark grammar"}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What constrains a reply: a JSON Schema (any JSON object for json_object), a Lark grammar
    (llguidance's dialect) or a GBNF grammar (llama.cpp's)."""

    kind: Literal["json_schema", "lark", "gbnf"]
    text: str  # the schema as JSON text, or the grammar

    @staticmethod
    def json_schema(schema: Any) -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"a JSON Schema is an object, got {type(schema).__name__}")
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))

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


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec (ConstraintError for one it cannot read)."""
    llguidance = _llguidance()

    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(
            f"the {KIND_NAMES[spec.kind]} is {len(spec.text)} characters "
            f"(at most {MAX_GRAMMAR_CHARS})"
        )
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_flexible": False}
            )
        if spec.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
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


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary (see the module docstring)."""

    def __init__(self, tokenizer, vocab: int, capacity: int = CACHED_GRAMMARS):
        self.tokenizer, self.vocab, self.capacity = tokenizer, vocab, capacity
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
        """A fresh GrammarMask for spec (ConstraintError for a bad or too costly grammar)."""
        text = grammar_text(spec)
        with self._lock:
            template = self._cache.get(text)
            if template is not None:
                self._cache.move_to_end(text)
        if template is None:
            template = self._matcher(text)
            with self._lock:
                self._cache[text] = template
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        return GrammarMask(template.deep_copy(), mask_words(self.vocab))

    def _matcher(self, text: str):
        llguidance = _llguidance()
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0, limits=limits)
        if matcher.is_error():
            raise ConstraintError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return matcher

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return grammar_text(spec) in self._cache
