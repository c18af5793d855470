"""No request field is dropped without a word (issue 54). Every field of the official clients'
request types (the installed `openai` and `anthropic` packages' TypedDicts, nested ones too) is
honoured (a field of the server's body, which reads it: a wrong type is a 400 naming it), refused
past its no-op value or outright with a 400 naming it, or listed as describing only the caller
(accepted, changing nothing). A field a new client version adds fails here until the server
decides which."""

from __future__ import annotations

import copy
import json
import typing

import pytest
from anthropic import types as anthropic_types
from anthropic.types import message_create_params
from openai.types import completion_create_params, shared_params
from openai.types.chat import chat_completion_message_function_tool_call_param as tool_call_param
from openai.types.chat import chat_completion_named_tool_choice_param as named_choice_param
from openai.types.chat import completion_create_params as chat_params
from openai.types.shared_params import response_format_json_schema
from pydantic import BaseModel

from minfer_jax.server import anthropic as anthropic_server
from minfer_jax.server import schemas
from minfer_jax.server.schemas import BadRequest, parse

import openai.types.chat as chat_types  # isort: skip

WRONG_TYPE = [[[{"~": 1}]]]  # a value no field of either API takes
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f"}}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _with(body: dict, where: str, key: str, value) -> dict:
    """body with value set at key of the object at `where` (a dotted path; "" is the top)."""
    out = copy.deepcopy(body)
    obj = out
    for part in filter(None, where.split(".")):
        obj = obj[int(part)] if part.isdigit() else obj[part]
    obj[key] = value
    return out


def _message(role: str, **extra) -> dict:
    return {"messages": [{"role": role, "content": "hi", **extra}]}


def _blocks(role: str, block: dict) -> dict:
    return {**MESSAGES, "messages": [{"role": role, "content": [block]}]}


# (client TypedDicts, the server's body kind, a valid body, where the TypedDict's object sits in it)
Walk = tuple[list, type[BaseModel], dict, str]
OPENAI_WALKS: list[Walk] = [
    ([chat_params.CompletionCreateParamsStreaming], schemas.ChatCompletionRequest, CHAT, ""),
    (
        [completion_create_params.CompletionCreateParamsStreaming],
        schemas.CompletionRequest,
        {"prompt": "hi"},
        "",
    ),
    *(
        ([getattr(chat_types, f"ChatCompletion{name}MessageParam")], schemas.ChatCompletionRequest,
         _message(name.lower()), "messages.0")
        for name in ("System", "Developer", "User", "Assistant", "Tool")
    ),
    (
        [chat_types.ChatCompletionContentPartTextParam],
        schemas.ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        "messages.0.content.0",
    ),
    (
        [chat_types.ChatCompletionMessageFunctionToolCallParam],
        schemas.ChatCompletionRequest,
        _message("assistant", tool_calls=[CALL]),
        "messages.0.tool_calls.0",
    ),
    (
        [tool_call_param.Function],
        schemas.ChatCompletionRequest,
        _message("assistant", tool_calls=[CALL]),
        "messages.0.tool_calls.0.function",
    ),
    ([chat_types.ChatCompletionFunctionToolParam], schemas.ChatCompletionRequest,
     {**CHAT, "tools": [TOOL]}, "tools.0"),
    ([shared_params.FunctionDefinition], schemas.ChatCompletionRequest,
     {**CHAT, "tools": [TOOL]}, "tools.0.function"),
    (
        [chat_types.ChatCompletionNamedToolChoiceParam],
        schemas.ChatCompletionRequest,
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
    ),
    (
        [named_choice_param.Function],
        schemas.ChatCompletionRequest,
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice.function",
    ),
    (
        [shared_params.ResponseFormatJSONSchema, shared_params.ResponseFormatJSONObject,
         shared_params.ResponseFormatText],
        schemas.ChatCompletionRequest,
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    (
        [response_format_json_schema.JSONSchema],
        schemas.ChatCompletionRequest,
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema",
    ),
    ([chat_types.ChatCompletionStreamOptionsParam], schemas.ChatCompletionRequest,
     {**CHAT, "stream_options": {}}, "stream_options"),
]  # fmt: skip
TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
ANTHROPIC_WALKS: list[Walk] = [
    ([message_create_params.MessageCreateParamsStreaming], anthropic_server.MessagesRequest,
     MESSAGES, ""),
    ([anthropic_types.MessageParam], anthropic_server.MessagesRequest, MESSAGES, "messages.0"),
    ([anthropic_types.TextBlockParam], anthropic_server.MessagesRequest,
     _blocks("user", {"type": "text", "text": "hi"}), "messages.0.content.0"),
    ([anthropic_types.ToolUseBlockParam], anthropic_server.MessagesRequest,
     _blocks("assistant", TOOL_USE), "messages.0.content.0"),
    ([anthropic_types.ToolResultBlockParam], anthropic_server.MessagesRequest,
     _blocks("user", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
     "messages.0.content.0"),
    ([anthropic_types.ThinkingBlockParam], anthropic_server.MessagesRequest,
     _blocks("assistant", {"type": "thinking", "thinking": "x", "signature": "s"}),
     "messages.0.content.0"),
    ([anthropic_types.ToolParam], anthropic_server.MessagesRequest,
     {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}]}, "tools.0"),
    ([anthropic_types.ToolChoiceToolParam, anthropic_types.ToolChoiceAutoParam,
      anthropic_types.ToolChoiceAnyParam, anthropic_types.ToolChoiceNoneParam],
     anthropic_server.MessagesRequest, {**MESSAGES, "tool_choice": {"type": "auto"}},
     "tool_choice"),
    ([anthropic_types.ThinkingConfigEnabledParam, anthropic_types.ThinkingConfigDisabledParam],
     anthropic_server.MessagesRequest, {**MESSAGES, "thinking": {"type": "disabled"}},
     "thinking"),
]  # fmt: skip


def client_fields(types: list) -> set[str]:
    """The keys of these TypedDicts (a Union's members' too)."""
    keys: set[str] = set()
    for t in types:
        members = typing.get_args(t) if typing.get_origin(t) is typing.Union else (t,)
        for member in members:
            keys |= set(typing.get_type_hints(member))
    return keys


def _models_at(kind: type[BaseModel], where: str) -> list[type[BaseModel]]:
    """The server's model classes of the object at `where` (a union's members: several)."""
    models: list[type[BaseModel]] = [kind]
    for part in [p for p in where.split(".") if p and not p.isdigit()]:
        fields = {f.alias or n: f for m in models for n, f in m.model_fields.items()}
        models = [
            c
            for c in _classes(fields[part].annotation)
            if isinstance(c, type) and issubclass(c, BaseModel)
        ]
    return models


def _classes(annotation) -> list:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [c for a in args for c in _classes(a)]


def _refusal(kind, body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        parse(kind, json.dumps(body).encode())
    return e.value


def _names(param: str | None, where: str, key: str) -> bool:
    """A 400's param names the field: its path, digits (list indices) aside, with a union's
    member or tag allowed in between; for `type`, the tagged object itself may be named."""
    if param is None:
        return False
    got = [p for p in param.split(".") if not p.isdigit()]
    want = [p for p in where.split(".") if p and not p.isdigit()]
    if key == "type" and got == want:
        return True
    rest = iter(got)
    return all(any(part == w for part in rest) for w in [*want, key])


def _walk(walk: Walk) -> dict[str, str]:
    """{client field: how the server takes it}, each checked against a request."""
    types, kind, body, where = walk
    parse(kind, json.dumps(body).encode())  # the base body is valid
    known = {f.alias or n for m in _models_at(kind, where) for n, f in m.model_fields.items()}
    top = where == ""
    caller = getattr(kind, "caller_fields", schemas.CALLER_FIELDS) if top else ()
    unsupported = getattr(kind, "unsupported", schemas.UNSUPPORTED) if top else {}
    verdicts = {}
    for key in sorted(client_fields(types)):
        if key in caller:
            parse(kind, json.dumps(_with(body, where, key, {"anything": 1})).encode())
            verdicts[key] = "caller"
            continue
        value = "x" if key in unsupported or key not in known else WRONG_TYPE
        error = _refusal(kind, _with(body, where, key, value))
        assert _names(error.param, where, key), (where, key, error.param, str(error))
        verdicts[key] = "honoured" if key in known else "refused"
    return verdicts


@pytest.mark.parametrize(
    "walk",
    OPENAI_WALKS + ANTHROPIC_WALKS,
    ids=[f"{w[1].__name__}:{w[3] or 'top'}" for w in OPENAI_WALKS + ANTHROPIC_WALKS],
)
def test_every_client_field_is_honoured_refused_or_describes_the_caller(walk):
    verdicts = _walk(walk)
    assert verdicts, walk
    print(walk[3] or "(top)", json.dumps(verdicts))


def test_the_walk_covers_the_top_level_request_types():
    openai_top = client_fields([chat_params.CompletionCreateParamsStreaming])
    assert {"messages", "tools", "response_format", "logprobs", "n", "user", "stream"} <= openai_top
    verdicts = _walk(ANTHROPIC_WALKS[0])
    assert verdicts["messages"] == "honoured" and verdicts["stream"] == "honoured"
    assert verdicts["metadata"] == "honoured" and verdicts["workspace_id"] == "caller"
    assert verdicts["container"] == "refused"


def test_an_unknown_field_anywhere_is_refused_by_name():
    for kind, body, where in (
        (schemas.ChatCompletionRequest, CHAT, ""),
        (schemas.ChatCompletionRequest, CHAT, "messages.0"),
        (anthropic_server.MessagesRequest, MESSAGES, ""),
        (anthropic_server.MessagesRequest, MESSAGES, "messages.0"),
    ):
        error = _refusal(kind, _with(body, where, "frobnicate", 1))
        assert _names(error.param, where, "frobnicate"), error.param
    # the Messages API does not take the OpenAI bodies' own lists
    assert _refusal(anthropic_server.MessagesRequest, {**MESSAGES, "n": 1}).param == "n"
    speed = _refusal(anthropic_server.MessagesRequest, {**MESSAGES, "speed": "fast"})
    assert speed.param == "speed"
    parse(anthropic_server.MessagesRequest, json.dumps({**MESSAGES, "speed": "standard"}).encode())
