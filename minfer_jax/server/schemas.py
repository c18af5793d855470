"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic before any work starts.

Strict types (no "0.5" for a number, no `true` for an int), finite numbers only, ranges as OpenAI
documents them. Only settings that map onto minfer_jax's Sampler (and llama-server's extensions
top_k, min_p, repeat_penalty, repeat_last_n) are accepted; a setting the engine cannot honour
(n > 1, logprobs, echo, penalties other than repeat_penalty, ...) is rejected rather than ignored.
Unknown fields are ignored, as OpenAI's own clients send a few (user, metadata, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from minfer_jax.errors import MinferError

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_TOKENS_LIMIT = 1 << 20
MAX_REPEAT_LAST_N = 4096  # history the device keeps per slot

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# OpenAI settings the engine does not implement: accepted only at their no-op values.
UNSUPPORTED = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "suffix": (None, ""), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class BadRequest(MinferError, ValueError):
    """A request body the server rejects with 400; `param` names the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Body = TypeVar("Body", bound=BaseModel)


def parse(kind: type[Body], raw: bytes) -> Body:
    """Validate a JSON request body as `kind`; every problem becomes one BadRequest."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    for key, allowed in UNSUPPORTED.items():
        if key in data and not any(type(data[key]) is type(a) and data[key] == a for a in allowed):
            ok = " or ".join(json.dumps(a) for a in allowed)
            raise BadRequest(f"{key}={json.dumps(data[key])[:80]} is not supported (only {ok})", key)
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        # of a union's alternatives: the deepest, then one that matched the type, then the last
        err = max(reversed(errs), key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        where = ".".join(str(p) for p in err["loc"] if p not in _UNION_TAGS) or None
        got = json.dumps(err.get("input"), default=str)[:80]
        raise BadRequest(f"{where or 'body'}: {err['msg']} (got {got})", where) from None


_UNION_TAGS = {"str", "list[int]", "list[str]", "list[ContentPart]", "constrained-str", "list[constrained-str]"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


DEFAULT_TEMPERATURE = 0.8  # llama-server's; the server warms up its executables for it and for greedy


class _Generation(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions (llama-server's defaults)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)  # -1: until the context is full
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)  # 0: greedy
    top_k: int = Field(40, ge=0, le=MAX_TOKENS_LIMIT)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(64, ge=0, le=MAX_REPEAT_LAST_N)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)  # None or -1: a random seed
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
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

    prompt: str | Annotated[list[int], Field(min_length=1)]


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

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
    max_completion_tokens: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)  # OpenAI's newer name

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self
