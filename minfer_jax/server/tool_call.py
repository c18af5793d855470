"""A tool call as the server returns it, and the JSON pieces every call format shares."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any


@dataclasses.dataclass(frozen=True)
class CallsBase:
    """What every tool-call format holds beside its own parsing: how many calls a reply keeps."""

    # 1: parallel_tool_calls false (a model that calls twice anyway: its first call is kept)
    most_calls: int | None = dataclasses.field(default=None, kw_only=True)
    # the opener's token id in the model's vocabulary (None: it is no single token), which a
    # strict function's grammar under tool_choice auto waits for
    opener_id: int | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def object_params(fn: dict) -> dict:
    """A function's parameters schema as a grammar holds arguments to it: an object's declared
    properties only, as OpenAI's strict mode (no schema: any object)."""
    params = fn.get("parameters") or {"type": "object"}
    return {"additionalProperties": False, **params} if params.get("type") == "object" else params


def json_value(schema: dict) -> str:
    """llguidance Lark for JSON valid against schema, compact: no whitespace the model could run
    on in."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def call_schema(fn: dict, args_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: object_params(fn)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def json_call(fn_schemas: list[dict]) -> str:
    return json_value(fn_schemas[0] if len(fn_schemas) == 1 else {"anyOf": fn_schemas})


def loaded(text: str) -> Any:
    """text's JSON value, None where it is no JSON (or nests past the parser's recursion: a
    model that ran on with "[[[[..." is text, not a crash)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def arguments_text(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text; a model that wrote them as a JSON string
    (`"arguments": "{...}"`) has them taken as that text, not encoded twice (a string that is no
    JSON object is encoded: the text sent is always JSON)."""
    if isinstance(value, str) and isinstance(loaded(value), dict):
        return value
    return json.dumps(value, ensure_ascii=False)
