"""Regressions found by the agent load test (minfer_bench/agent_load.py: concurrent chat, schema,
tool-call, Anthropic and speculating requests against one server), each pinned cheaply here."""

from __future__ import annotations

import pytest

from minfer_jax.engine.steps import StopReason
from minfer_jax.server.openai_format import Reply
from minfer_jax.server.tools import ToolCall


@pytest.mark.parametrize(
    "reason, want",
    [(StopReason.LENGTH, "length"), (StopReason.CONTEXT, "length"), (StopReason.EOS, "tool_calls")],
)
def test_a_turn_cut_at_max_tokens_finishes_length_even_with_calls(reason, want):
    """A forced call grammar with parallel calls keeps calling until max_tokens: the complete
    calls are returned, but finish_reason says the turn was cut (llama-server's rule; the Messages
    API says max_tokens), so an agent does not take it for a finished turn of calls."""
    call = ToolCall("add", '{"a": 1, "b": 2}')
    whole = Reply("chat", "m").full("", reason, 5, 9, tool_calls=[call])
    assert whole["choices"][0]["finish_reason"] == want
    last = Reply("chat", "m").chunk(reason=reason, called=True)
    assert last["choices"][0]["finish_reason"] == want


@pytest.mark.real_model
def test_the_stop_sequence_that_ended_a_reply_is_named(real_model):
    """Anthropic's stop_sequence names the custom stop sequence behind stop_reason
    "stop_sequence" (it was always null): the text stream keeps which stop string ended it (the
    earliest of those found), and the Messages reply, whole or streamed, reports it."""
    import json

    from minfer_jax.engine.text_stream import TextStream
    from minfer_jax.files.tokenizer import Tokenizer
    from minfer_jax.server.anthropic_reply import BlockSplit, EventStream, matched

    tok = Tokenizer.from_model(real_model)
    ids = tok.encode("def fibonacci(n):\n    if n <= 1:\n        return n", add_special=False)
    stream = TextStream(tok, max_new_tokens=100, limit=100, stop=["return", "<= 1", "if"])
    for t in ids:
        stream.push(t)
    assert stream.reason == StopReason.STOP and stream.stop_string == "if"
    assert matched("stop_sequence", "if") == "if" and matched("tool_use", "if") is None
    split = BlockSplit(None, None, False, show_thinking=False)
    events = EventStream(split, {"id": "msg_1"}).end(stream.text, stream.reason, 4, 9, 0, "if")
    (delta,) = [json.loads(e.split("data: ")[1]) for e in events if "message_delta" in e]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "if"}


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"stop_sequences": ["a"] * 100}, "stop_sequences"),
        ({"stop_sequences": ["a" * 5000]}, "stop_sequences.0"),
        ({"tools": [{"name": "a<|im_end|>b", "input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [{"name": "x" * 65, "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ],
)
def test_messages_fields_the_chat_path_refuses_are_a_400_naming_them(extra, field):
    """A Messages body is checked as Anthropic's fields before it becomes a chat body: 100 stop
    sequences or a tool name the chat path refuses were a 500 (the chat body's ValidationError
    escaped to_chat)."""
    import json

    from minfer_jax.server.anthropic import MessagesRequest, to_chat
    from minfer_jax.server.schemas import BadRequest, parse

    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(BadRequest) as refused:
        to_chat(parse(MessagesRequest, json.dumps({**body, **extra}).encode()))
    assert str(refused.value).startswith(f"{field}:"), refused.value


def test_a_template_render_starved_of_the_gil_is_not_refused(monkeypatch):
    """Under 16 concurrent chat requests on 2 busy cores, gpt-oss's template (a few ms of work)
    was refused as "ran longer than 1 s": its wall clock was mostly waiting for the GIL. The
    budget is the render's own CPU time (wall clock only as a 10 s backstop)."""
    import sys
    import threading
    from pathlib import Path

    from minfer_jax.files import template_budget
    from minfer_jax.files.chat_template import render_chat_template

    template = (Path(__file__).parent / "data" / "gpt-oss-chat-template.jinja").read_text("utf-8")
    fn = {"name": "f", "description": "d",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}  # fmt: skip
    tools = [{"type": "function", "function": {**fn, "name": f"f{i}"}} for i in range(600)]
    messages = [{"role": "user", "content": "hi"}]
    render_chat_template(template, messages, tools=tools[:1])  # compiled before the clock runs
    monkeypatch.setattr(template_budget, "MAX_SECONDS", 0.25)
    done = threading.Event()

    def hog():  # pure Python: holds the GIL for whole switch intervals
        while not done.is_set():
            sum(range(10_000))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    hogs = [threading.Thread(target=hog) for _ in range(6)]
    try:
        for t in hogs:
            t.start()
        out = render_chat_template(template, messages, tools=tools)
    finally:
        done.set()
        for t in hogs:
            t.join()
        sys.setswitchinterval(interval)
    assert out.count("type f") == len(tools)
