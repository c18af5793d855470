"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic before any work starts.

Strict types (no "0.5" for a number, no `true` for an int; null is the field's default, as the
official client sends it for a setting passed as None), finite numbers only, ranges as OpenAI
documents them, text that is valid Unicode (no lone surrogates). Only settings that map onto
minfer_jax's Sampler (and llama-server's extensions top_k, min_p, repeat_penalty, repeat_last_n)
are accepted; a setting the engine cannot honour (n > 1, logprobs, echo, penalties other than
repeat_penalty, ...) is rejected rather than ignored, except at its no-op value (0 and 0.0 alike:
the official client sends `frequency_penalty: 0.0`). Counts past what exists (max_tokens past the
context, top_k past the vocabulary, repeat_last_n past the context) are accepted here and clamped
by the app (validate.clamped_count). Unknown fields are ignored, as OpenAI's own clients send a
few (user, metadata, ...).

`parse` turns a body into a request in this order: JSON (the collector paused: a body of a million
empty lists otherwise takes seconds), the raw checks the caller gives (limits.py: message count,
prompt length, before pydantic spends time per item), then validation; a body nested too deeply
for Python's parser is a 400 like any other malformed body.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from minfer_jax import validate
from minfer_jax.errors import InvalidArgumentError, MinferError


def _unicode(value: str) -> str:
    try:
        return validate.text("the text", value)
    except InvalidArgumentError as e:  # pydantic reports a ValueError as "Value error, <message>"
        raise ValueError(str(e)) from None


Text = Annotated[str, AfterValidator(_unicode)]
StopString = Annotated[Text, Field(max_length=validate.MAX_STOP_CHARS)]

# OpenAI settings the engine does not implement: accepted only at their no-op values.
UNSUPPORTED = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),  # the deprecated spelling of tools and tool_choice
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class BadRequest(MinferError, ValueError):
    """A request the server rejects with `status` (400); `param` names the offending field
    (or None)."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Body = TypeVar("Body", bound=BaseModel)
_collector = threading.Lock()
_parsing = 0  # bodies being parsed now, by any thread: the collector runs again when none is


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector paused while a body is parsed: each container json builds counts
    towards a collection that walks them all again (4 MB of `[[],[],...]`: 1.2 s instead of
    0.14)."""
    global _parsing
    with _collector:
        _parsing += 1
        was_enabled = gc.isenabled() if _parsing == 1 else True
        gc.disable()
    try:
        yield
    finally:
        with _collector:
            _parsing -= 1
            if _parsing == 0 and was_enabled:
                gc.enable()


def _same(value: Any, allowed: Any) -> bool:
    """A no-op value: 0 and 0.0 alike, but never true for 1 or false for 0."""
    numbers = (int, float)
    if (
        isinstance(value, numbers)
        and isinstance(allowed, numbers)
        and not isinstance(value, bool)
        and not isinstance(allowed, bool)
    ):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


def parse(kind: type[Body], raw: bytes, check: Callable[[dict], None] | None = None) -> Body:
    """Validate a JSON request body as `kind`, after `check(data)` on the parsed JSON; every problem
    becomes one BadRequest."""
    try:
        with _collector_paused():
            data = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    if check is not None:
        check(data)
    # null is "not given", as OpenAI and llama-server read it: the default (a required field stays)
    required = {name for name, field in kind.model_fields.items() if field.is_required()}
    data = {key: value for key, value in data.items() if value is not None or key in required}
    for key, allowed in UNSUPPORTED.items():
        if key in data and not any(_same(data[key], a) for a in allowed):
            ok = " or ".join(json.dumps(a) for a in allowed)
            raise BadRequest(f"{key}={_shown(data[key])} is not supported (only {ok})", key)
    try:
        return kind.model_validate(data)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to validate") from None
    except ValidationError as e:
        errs = e.errors()
        # of a union's alternatives: the deepest, then one that matched the type, then the last
        err = max(reversed(errs), key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        where = ".".join(str(p) for p in err["loc"] if _is_field(p)) or None
        raise BadRequest(
            f"{where or 'body'}: {err['msg']} (got {_shown(err.get('input'))})", where
        ) from None


def _shown(value: Any) -> str:
    """At most 80 characters of a JSON value, for an error message
    (deep nesting and surrogates too)."""
    try:
        text = json.dumps(value, default=str)
    except (RecursionError, ValueError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_field(part: str | int) -> bool:
    """A field name or list index of an error's location, not the tag of a union's alternative
    ("str", "list[int]", "function-after[...]")."""
    return isinstance(part, int) or (
        part.isidentifier() and part not in ("str", "int", "float", "bool")
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


# llama-server's; the server warms up its executables for it and for greedy
DEFAULT_TEMPERATURE = 0.8
SEED_MAX = 2**64 - 1  # OpenAI's seed is an integer; llama-server's a uint32: 64 bits hold both


class _Generation(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (llama-server's defaults)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=-1)  # -1 or past the context: until the context is full
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)  # 0: greedy
    top_k: int = Field(40, ge=0)  # past the vocabulary: all of it
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=-1)  # -1 or past the context: the context
    seed: int | None = Field(
        None, ge=-1, le=SEED_MAX
    )  # None or -1: a random seed; passed on whole (64 bits)
    stop: (
        StopString | Annotated[list[StopString], Field(max_length=validate.MAX_STOP_STRINGS)] | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Generation):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: Text | Annotated[list[int], Field(min_length=1)]


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as a chat template expects it: text content only."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=-1)  # OpenAI's newer name

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self
