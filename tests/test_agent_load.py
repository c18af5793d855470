"""The agent load test's checks (minfer_bench/agent_load.py, agent_cases.py, agent_wire.py): each
catches the breach it is there for, on hand-made replies (no server)."""

from __future__ import annotations

import collections
import json

from minfer_bench import agent_cases as cases
from minfer_bench import agent_load, agent_wire


def _chunk(i: int, delta: dict, finish=None, id_="c1") -> str:
    choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
    return json.dumps({"id": id_, "object": "chat.completion.chunk", "choices": [choice]})


USAGE = json.dumps({"id": "c1", "choices": [], "usage": {"prompt_tokens": 3,
                    "completion_tokens": 2, "total_tokens": 5}})  # fmt: skip


def test_schema_errors_name_each_breach():
    good = {"name": "ann", "age": 3, "tags": ["a"]}
    assert cases.schema_errors(good, cases.PERSON) == []
    bad = {"name": "x" * 17, "age": -1, "tags": [], "extra": 1}
    errs = cases.schema_errors(bad, cases.PERSON)
    assert len(errs) == 4, errs
    assert cases.schema_errors({"color": "red", "code": "abc"}, cases.CODE) != []
    assert cases.schema_errors(True, {"type": "integer"}) != []


def test_an_openai_stream_is_reassembled_and_its_breaches_noted():
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    events = [_chunk(0, {"role": "assistant", "content": ""}), _chunk(0, {"tool_calls": [call]}),
              _chunk(0, {}, "tool_calls"), USAGE, "[DONE]"]  # fmt: skip
    out = agent_wire.openai_stream(events, "chat/completions")
    assert out.problems == [] and out.choices[0].calls == [["add", '{"a": 1, "b": 2}']]
    case = cases.Case("tools", "chat/completions", {"tool_choice": "required",
                      "parallel_tool_calls": True})  # fmt: skip
    assert cases.check_tools(case, out) == []
    broken = [events[0], _chunk(0, {"content": "x"}, "stop"), _chunk(0, {"content": "y"}),
              _chunk(1, {}, id_="c2"), USAGE]  # fmt: skip
    problems = agent_wire.openai_stream(broken, "chat/completions").problems
    assert len(problems) == 4, problems  # no [DONE], a chunk after finish, two ids, 1 unfinished


def test_an_anthropic_stream_out_of_order_is_noted():
    def ev(kind, **data):
        return json.dumps({"type": kind, **data})

    start = ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
    delta = ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"})
    end = ev("message_delta", delta={"stop_reason": "stop_sequence", "stop_sequence": "\n"},
             usage={"output_tokens": 2})  # fmt: skip
    good = [ev("message_start", message={}), start, delta,
            ev("content_block_stop", index=0), end, ev("message_stop")]  # fmt: skip
    out = agent_wire.anthropic_stream(good)
    assert out.problems == [] and out.choices[0].text == "hi"
    case = cases.Case("anthropic", "messages", {"stop_sequences": ["\n"]})
    assert cases.check_anthropic(case, out) == []
    out.choices[0].stop_sequence = None
    assert cases.check_anthropic(case, out) != []
    assert len(agent_wire.anthropic_stream([good[0], delta, end]).problems) == 2


def test_the_mix_is_seeded_and_holds_every_kind():
    kinds = list(agent_load.KINDS)
    first, again = agent_load.plan(kinds, 300, 5), agent_load.plan(kinds, 300, 5)
    assert [c.body for c in first] == [c.body for c in again]
    assert set(collections.Counter(c.kind for c in first)) == set(kinds)
