"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic before any work starts.

Strict types (no "0.5" for a number, no `true` for an int; null is the field's default, as the
official client sends it for a setting passed as None), finite numbers only, ranges as OpenAI
documents them, text that is valid Unicode (no lone surrogates). Only settings that map onto
minfer_jax's Sampler (and llama-server's extensions top_k, min_p, repeat_penalty, repeat_last_n)
are accepted, with constrained output (response_format, llama-server's json_schema and grammar)
and ignore_eos, n choices and logprobs; a setting the engine cannot honour (best_of, echo,
penalties other than repeat_penalty, mirostat, typical_p, ...) is rejected rather than ignored,
except at its no-op value (0 and 0.0 alike: the official client sends `frequency_penalty: 0.0`).
Counts past what exists (max_tokens past the context, top_k past the vocabulary, repeat_last_n
past the context) are accepted here and clamped by the app (validate.clamped_count). Every other
field is a 400 that names it, except the few that only describe the caller (`CALLER_FIELDS`:
user, metadata, ...), which change nothing in the reply.

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

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from minfer_jax import validate
from minfer_jax.engine.plan import MAX_SEQS
from minfer_jax.engine.sampling import TOP_LOGPROBS
from minfer_jax.errors import InvalidArgumentError, MinferError


def _unicode(value: str) -> str:
    try:
        return validate.text("the text", value)
    except InvalidArgumentError as e:  # pydantic reports a ValueError as "Value error, <message>"
        raise ValueError(str(e)) from None


Text = Annotated[str, AfterValidator(_unicode)]
StopString = Annotated[Text, Field(max_length=validate.MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=validate.MAX_STOP_STRINGS)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]  # OpenAI's rule

# OpenAI settings the engine does not implement: accepted only at their no-op values.
UNSUPPORTED = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "functions": (None, []),  # the deprecated spelling of tools and tool_choice
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    # llama-server's samplers, at the values that leave its chain as minfer_jax's
    "mirostat": (None, 0),
    "mirostat_tau": (None, 5.0),
    "mirostat_eta": (None, 0.1),
    "typical_p": (None, 1.0),
    "tfs_z": (None, 1.0),
    "n_probs": (None, 0),
    "min_keep": (None, 0),
    "dynatemp_range": (None, 0),
    "dynatemp_exponent": (None, 1.0),
    "xtc_probability": (None, 0),
    "xtc_threshold": (None, 0.1),
    "dry_multiplier": (None, 0),
    "top_n_sigma": (None, -1),
    "penalty_last_n": (None,),  # llama-server's name of repeat_last_n: send repeat_last_n
    "logit_bias_eog": (None,),
    "n_keep": (None, 0),
    "id_slot": (None, -1),
    "n_indent": (None, 0),
    "t_max_predict_ms": (None, 0),
    "post_sampling_probs": (None, False),
    "return_tokens": (None, False),
    "timings_per_token": (None, False),
    "lora": (None, []),
    "samplers": (None,),
}
# Fields that only describe the caller (OpenAI's and llama-server's): accepted, and they change
# nothing in the reply. cache_prompt: prefix reuse is always on (engine/scheduler.py).
CALLER_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "cache_prompt",
)


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
    # a body kind may declare its own (anthropic.py's Messages): else the OpenAI bodies' lists
    caller = getattr(kind, "caller_fields", CALLER_FIELDS)
    unsupported = getattr(kind, "unsupported", UNSUPPORTED)
    fields = {field.alias or name for name, field in kind.model_fields.items()}
    known = fields | set(unsupported) | set(caller)
    for key in data:
        if isinstance(key, str) and key.startswith("speculative.") and key not in known:
            raise BadRequest(
                f"{key}: not implemented (a request takes speculative.n_max, speculative.n_min "
                "and speculative.p_min; the drafter is the server's --spec-type)",
                key,
            )
        if key not in known:
            raise BadRequest(
                f"unknown field {_shown(key)}: minfer_jax does not implement it (fields that only "
                f"describe the caller are accepted: {', '.join(caller)})",
                key,
            )
    data = {key: value for key, value in data.items() if key not in caller}
    # null is "not given", as OpenAI and llama-server read it: the default (a required field stays)
    required = {name for name, field in kind.model_fields.items() if field.is_required()}
    data = {key: value for key, value in data.items() if value is not None or key in required}
    for key, allowed in unsupported.items():
        if key in data and not any(_same(data[key], a) for a in allowed):
            ok = " or ".join(json.dumps(a) for a in allowed)
            raise BadRequest(f"{key}={_shown(data[key])} is not supported (only {ok})", key)
    # at their no-op values they are said and done: not fields of the body
    data = {key: value for key, value in data.items() if key not in unsupported}
    try:
        return kind.model_validate(data)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to validate") from None
    except ValidationError as e:
        raise refusal(e) from None


def refusal(e: ValidationError) -> BadRequest:
    """The one BadRequest of a body's validation errors, naming the field."""
    errs = e.errors()
    # of a union's alternatives: the deepest, then one that matched the type, then the last
    err = max(reversed(errs), key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    where = ".".join(str(p) for p in err["loc"] if _is_field(p)) or None
    if err["type"] == "extra_forbidden":
        return BadRequest(f"{where}: unknown field, not implemented by minfer_jax", where)
    return BadRequest(f"{where or 'body'}: {err['msg']} (got {_shown(err.get('input'))})", where)


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
        all(p.isidentifier() for p in part.split("."))  # llama-server's speculative.n_max
        and part not in ("str", "int", "float", "bool")
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


# llama-server's; the server warms up its executables for it and for greedy
DEFAULT_TEMPERATURE = 0.8
SEED_MAX = 2**64 - 1  # OpenAI's seed is an integer; llama-server's a uint32: 64 bits hold both


class _Generation(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (llama-server's defaults)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=-1)  # -1 or past the context: until the context is full
    n_predict: int | None = Field(None, ge=-1)  # llama-server's name of max_tokens
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)  # 0: greedy
    top_k: int = Field(40, ge=0)  # past the vocabulary: all of it
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=-1)  # -1 or past the context: the context
    seed: int | None = Field(
        None, ge=-1, le=SEED_MAX
    )  # None or -1: a random seed; passed on whole (64 bits)
    stop: StopString | StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # llama-server's: end-of-sequence tokens are never sampled
    n: int = Field(1, ge=1, le=MAX_SEQS)  # choices, sharing one prefill (engine/sharing.py)
    # llama-server's constrained output: a JSON Schema, or a GBNF grammar
    json_schema: dict[str, Any] | bool | None = None
    grammar: Text | None = None
    # llama-server's speculative decoding per request (server/speculation.py)
    spec_n_max: int | None = Field(None, ge=0, alias="speculative.n_max")
    spec_n_min: int | None = Field(None, ge=0, alias="speculative.n_min")
    spec_p_min: float | None = Field(None, ge=0.0, le=1.0, alias="speculative.p_min")

    @model_validator(mode="after")
    def _llama_server_fields(self):
        if self.max_tokens is None and self.n_predict is not None:
            self.max_tokens = self.n_predict
        asked = [field for field, _ in self.output_constraint()]
        if len(asked) > 1:
            raise ValueError(f"give one of {' and '.join(asked)}, not both")
        return self

    def output_constraint(self) -> list[tuple[str, dict]]:
        """What constrains the reply, with the field that asked: [(field, keywords of
        Model.constraint)], empty for free text."""
        fmt = getattr(self, "response_format", None)
        fmt_schema = None if fmt is None else fmt.schema_of()
        asked = [
            ("json_schema", {"json_schema": self.json_schema}),
            ("grammar", {"grammar": self.grammar}),
            ("response_format", {"json_schema": fmt_schema}),
        ]
        return [(field, kw) for field, kw in asked if next(iter(kw.values())) is not None]

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_alternatives(self) -> int | None:
        """Alternatives each token reports with its logprob (None: no logprobs)."""
        return None


class CompletionRequest(_Generation):
    """POST /v1/completions: one prompt, as text or as token ids."""

    prompt: Text | Annotated[list[int], Field(min_length=1)]
    # each token's logprob and this many alternatives (OpenAI's bound is 5, llama-server's none)
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)

    @property
    def top_alternatives(self) -> int | None:
        return self.logprobs


def text_only(data: Any) -> Any:
    """A content part or block of another type (an image, audio, a file) refused by its type,
    not by the fields it carries."""
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str) and kind != "text":
        raise ValueError(
            f"content of type {_shown(kind)} is not supported: minfer_jax serves text-only models"
        )
    return data


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: Text

    _text_only = model_validator(mode="before")(text_only)


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Text
    arguments: Text  # JSON text


class MessageToolCall(BaseModel):
    """A call an assistant message made (the history of a tool-using conversation)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_call(self) -> dict[str, Any]:
        """As HF chat templates read a call: arguments as an object (tojson renders it)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # a client's "[[[[...": its text, not a 500
            arguments = self.function.arguments
        fn = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": fn}


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None  # passed to the template (some render it)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool result's call
    # an assistant's reasoning, as llama-server takes it back (templates that keep it render it)
    reasoning_content: Text | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as a chat template expects it: text content, calls with their arguments
        as objects."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_call() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    # a forced call's arguments are always held to it; under auto, strict asks for that too
    # (server/tools.py strict_calls: a lazy grammar; a logged warning where the format has none)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _readable_parameters(cls, value):
        """The keys the call formats read from the schema (server/tools.py, tool_formats.py) in
        the shapes they read: anything else is a 400 here, not a crash where a grammar is made."""
        props, required = (value or {}).get("properties") or {}, (value or {}).get("required") or []
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError("parameters.properties must be an object of JSON Schema objects")
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError("parameters.required must be a list of property names")
        return value


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema (strict or not, the schema is always
    enforced token by token)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: Text
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (llama-server: with an optional schema),
    json_schema."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _complete(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs its json_schema: {name, schema, strict}")
        return self

    def schema_of(self) -> dict[str, Any] | bool | None:
        """The JSON Schema it asks for (None: free text)."""
        if self.type == "text":
            return None
        schema = self.schema_ if self.json_schema is None else self.json_schema.schema_
        return {"type": "object"} if schema is None else schema


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=-1)  # OpenAI's newer name
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # extra variables for the chat template (e.g. enable_thinking), as llama-server takes them
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False  # each content token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)  # and this many alternatives

    @field_validator("tool_choice")
    @classmethod
    def _calls_need_tools(cls, value, info):
        if value not in (None, "auto", "none") and not info.data.get("tools"):
            raise ValueError("it asks for a call, but no tools are given")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def top_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self
