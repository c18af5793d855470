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
