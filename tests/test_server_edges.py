"""The agent server's edges (server/*) found by probing it as coding agents do: requests whose
meaning the server used to drop or misread in silence, each now a clear 400 or honoured. Pure
request parsing where that shows it (no model); the replies' invariants on real generation are in
test_harmony_tools.py (gpt-oss-tiny) and test_server*.py (the tiny Qwen2)."""

from __future__ import annotations

import json

import pytest

from minfer_jax.server import schemas
from minfer_jax.server.anthropic import MessagesRequest, to_chat

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat(body: dict) -> schemas.ChatCompletionRequest:
    return schemas.parse(schemas.ChatCompletionRequest, json.dumps(body).encode())


def _messages(body: dict) -> schemas.ChatCompletionRequest:
    base = {"model": "m", "max_tokens": 8, "messages": USER}
    raw = json.dumps({**base, **body}).encode()
    return to_chat(schemas.parse(MessagesRequest, raw))


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"tools": [], "tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    ],
)
def test_a_forced_call_without_tools_is_a_400_naming_tool_choice(extra):
    """It was a 200 of free text: the call the client asked for silently not made."""
    with pytest.raises(schemas.BadRequest) as e:
        _chat({"messages": USER, **extra})
    assert e.value.param == "tool_choice" and "no tools" in str(e.value)
    for choice in ("auto", "none"):  # asking for no call needs no tools
        assert _chat({"messages": USER, "tools": [], "tool_choice": choice}).tool_choice == choice
    assert _chat({"messages": USER, **extra, "tools": [TOOL]}).tool_choice is not None


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "f"}])
def test_an_anthropic_forced_call_without_tools_is_a_400(choice):
    with pytest.raises(schemas.BadRequest) as e:
        _messages({"tool_choice": choice})
    assert e.value.param == "tool_choice"
    assert _messages({"tool_choice": {"type": "auto"}}).tool_choice == "auto"
    tool = {"name": "f", "input_schema": {"type": "object"}}
    assert _messages({"tools": [tool], "tool_choice": choice}).tool_choice is not None


def test_a_tool_result_with_is_error_tells_the_model():
    """is_error was accepted and dropped: the model saw a failed call's message as its result."""
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    results = [
        {"type": "tool_result", "tool_use_id": "t1", "content": "no such file", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "ok"}],
         "is_error": False},
    ]  # fmt: skip
    tool = {"name": "f", "input_schema": {"type": "object"}}
    history = [*USER, {"role": "assistant", "content": [use, {**use, "id": "t2"}]},
               {"role": "user", "content": results}]  # fmt: skip
    chat = _messages({"messages": history, "tools": [tool]})
    told = [m.as_template_message() for m in chat.messages if m.role == "tool"]
    assert [m["content"] for m in told] == ["Error: no such file", "ok"]
