"""The hostile requests of the agent load test (agent_load.py): fields out of bounds, speculation
asked where it cannot run, tool and schema definitions that are huge, deep, recursive-looking or
invalid, Anthropic bodies the chat path refuses. Each may get only the statuses listed (never a
5xx); a 200 reply is read and its wire contract checked like any other."""

from __future__ import annotations

import json
import random

from minfer_bench.agent_cases import FUNCTIONS, PERSON, SPEC, Case, check_any_reply, tools_of

HOSTILE: list[tuple[str, dict, frozenset]] = [  # endpoint, body, statuses allowed
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            },
            SPEC: 4,
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, SPEC: 3},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], SPEC: -1},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], SPEC: "3"},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            SPEC: 10**12,
            "speculative.n_min": 10**12,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools_of(["add"]),
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "x" * 5000, "parameters": PERSON}}],
            "tool_choice": "required",
            "max_tokens": 4,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "deep",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "a": json.loads(
                                    '{"type": "array", "items": ' * 300
                                    + '{"type": "string"}'
                                    + "}" * 300
                                )
                            },
                        },
                    },
                }
            ],
            "tool_choice": "required",
            "max_tokens": 4,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "e",
                    "schema": {"enum": [f"v{i}" * 20 for i in range(20000)]},
                },
            },
        },
        frozenset({200, 400, 413}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": {"type": "string", "pattern": "(a+)+$"}},
            },
            "max_tokens": 4,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 10**6},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 65},
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools_of(["add"]),
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "add", "arguments": "{bad"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "max_tokens": 4,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "add", "input_schema": FUNCTIONS["add"]}],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "messages",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        frozenset({400}),
    ),  # fmt: skip
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "stop_sequences": ["a"] * 100,
        },
        frozenset({400}),
    ),  # fmt: skip
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            SPEC: 3,
            "stream": True,
        },
        frozenset({200, 400}),
    ),  # fmt: skip
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "any"},
        },
        frozenset({200, 400}),
    ),
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "a<|im_end|>b", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "stream": True,
        },
        frozenset({200, 400}),
    ),
    (
        "messages",
        {
            "model": "m",
            "max_tokens": 8,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "hi"}],
        },
        frozenset({200, 400}),
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "tools": [
                {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
            ],
            "tool_choice": "required",
            "stream": True,
        },
        frozenset({200, 400}),
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "any", "schema": {}},
            },
            "n": 2,
            "stream": True,
        },
        frozenset({200, 400}),
    ),
    (
        "chat/completions",
        {"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}], "max_tokens": 4},
        frozenset({200, 400}),
    ),
    (
        "completions",
        {
            "prompt": "hi",
            "max_tokens": 4,
            "n": 3,
            "logprobs": 5,
            "stream": True,
            "stop": ["\n", "a" * 1024],
        },
        frozenset({200}),
    ),
]


def hostile_case(rng: random.Random) -> Case:
    """One of HOSTILE, at random."""
    endpoint, body, expect = rng.choice(HOSTILE)
    return Case("hostile", endpoint, body, expect=expect, check=check_any_reply)
