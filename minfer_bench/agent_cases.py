"""The requests of the agent load test (agent_load.py) and the contract each reply is checked
against: chat and completions (streamed or not, speculation asked or not, stop strings, n > 1,
logprobs), JSON-schema output (strict and not), tool calls (tool_choice required / auto / named),
Anthropic's /v1/messages (streamed or not, tool_use), cancelled streams and hostile fields.

A case is one request and what its reply must satisfy; `greedy` cases also carry a key: under load
their generated text (and calls) must equal what the same request gave alone with speculation off.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable
from typing import Any

SPEC = "speculative.n_max"
PROMPTS = [
    "Write a Python function that reverses a string.",
    "Copy this code exactly:\n```python\ndef area(w, h):\n    return w * h\n\n\n"
    "def perimeter(w, h):\n    return 2 * (w + h)\n```",
    "List three colors, one per line.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CODE = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "code"],
}
SCHEMAS = {"person": PERSON, "code": CODE}
FUNCTIONS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["c", "f"]},
        },
        "required": ["city"],
    },
    "add": {
        "type": "object",
        # bounded, so that a random-weight model's forced call ends before max_tokens
        "properties": {
            "a": {"type": "integer", "minimum": -999, "maximum": 999},
            "b": {"type": "integer", "minimum": -999, "maximum": 999},
        },
        "required": ["a", "b"],
    },
}
# room for a whole call where every character is a token (gpt-oss's harmony header on a
# synthetic byte vocabulary takes ~50)
CALL_TOKENS = 96
TOOL_PROMPTS = ["What is the weather in Paris?", "Add 2 and 40 with the tool.", "Hello!"]


def schema_errors(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Where `value` breaks `schema` (the JSON Schema keywords the cases use; no jsonschema
    dependency: the GPU machine installs nothing)."""
    errs: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in enum"]
    kinds: dict[str, type | tuple[type, ...]] = {
        "string": str, "integer": int, "number": (int, float), "boolean": bool,
        "object": dict, "array": list,
    }  # fmt: skip
    want = schema.get("type")
    if want is not None:
        ok = isinstance(value, kinds[want]) and not (want != "boolean" and isinstance(value, bool))
        if not ok:
            return [f"{path}: {value!r} is not {want}"]
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            errs.append(f"{path}: longer than maxLength")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not schema.get("minimum", value) <= value <= schema.get("maximum", value):
            errs.append(f"{path}: {value} out of range")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errs.append(f"{path}: {len(value)} items")
        for i, item in enumerate(value):
            errs += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: {k!r} missing" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: {k!r} not allowed")
    return errs


@dataclasses.dataclass
class Choice:
    text: str = ""
    reasoning: str = ""
    calls: list = dataclasses.field(default_factory=list)  # [name, arguments text]
    finish: str | None = None
    logprobs: list | None = None  # chat: content entries; completions: token_logprobs
    stop_sequence: str | None = None  # Anthropic's: the stop sequence that ended the reply


@dataclasses.dataclass
class Outcome:
    """One reply as the client saw it, whichever endpoint and whether streamed."""

    status: int
    choices: list[Choice] = dataclasses.field(default_factory=list)
    usage: dict | None = None
    timings: dict | None = None
    problems: list[str] = dataclasses.field(default_factory=list)  # broken wire contract
    body: str = ""  # an error reply's text

    def signature(self) -> list:
        """What a greedy reply must repeat: each choice's text and calls (as JSON reads them back,
        so that a kept reference compares equal)."""
        return json.loads(json.dumps([[c.text, c.reasoning, c.calls] for c in self.choices]))


@dataclasses.dataclass
class Case:
    kind: str
    endpoint: str  # "chat/completions", "completions" or "messages"
    body: dict
    expect: frozenset = frozenset({200})
    check: Callable[[Case, Outcome], list[str]] | None = None
    greedy_key: str | None = None  # replies of the same key must be equal
    cancel_after: int | None = None  # close the stream after this many events (0: abandon)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _spec(rng: random.Random, body: dict) -> dict:
    """Speculation as a request may ask for it: the server's default, off, or a bound."""
    choice = rng.choice([None, 0, 2, 7, 99])
    return body if choice is None else {**body, SPEC: choice}


def _stream(rng: random.Random, body: dict) -> dict:
    if rng.random() < 0.5:
        return body
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def chat_case(rng: random.Random) -> Case:
    i = rng.randrange(len(PROMPTS))
    base = {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 24,
            "temperature": 0}  # fmt: skip
    if rng.random() < 0.3:
        base["stop"] = ["\n\n", "return"]
    key = f"chat/{i}/{'stop' if 'stop' in base else ''}"
    return Case("chat", "chat/completions", _stream(rng, _spec(rng, base)), check=check_stops,
                greedy_key=key)  # fmt: skip


def completion_case(rng: random.Random) -> Case:
    i = rng.randrange(len(PROMPTS))
    base: dict = {"prompt": PROMPTS[i], "max_tokens": 20, "temperature": 0, "stop": ["\n\n\n"]}
    if rng.random() < 0.3:
        base["logprobs"] = rng.randrange(0, 6)
        return Case("logprobs", "completions", _stream(rng, base), check=check_logprobs,
                    greedy_key=f"text/{i}/lp")  # fmt: skip
    return Case("completion", "completions", _stream(rng, _spec(rng, base)), check=check_stops,
                greedy_key=f"text/{i}")  # fmt: skip


def sampled_n_case(rng: random.Random) -> Case:
    """n > 1 seeded sampling: each choice reproducible, choice i seeded seed + i."""
    i, n = rng.randrange(len(PROMPTS)), rng.choice([2, 3])
    base = {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 12,
            "temperature": 0.8, "seed": 7 + i, "n": n}  # fmt: skip
    return Case("n>1", "chat/completions", _stream(rng, _spec(rng, base)), check=check_n,
                greedy_key=f"n/{i}/{n}")  # fmt: skip


def logprobs_case(rng: random.Random) -> Case:
    i, k = rng.randrange(len(PROMPTS)), rng.randrange(0, 6)
    base = {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": k}  # fmt: skip
    return Case("logprobs", "chat/completions", _stream(rng, base), check=check_logprobs,
                greedy_key=f"lp/{i}/{k}")  # fmt: skip


def schema_case(rng: random.Random) -> Case:
    name = rng.choice(sorted(SCHEMAS))
    strict = rng.random() < 0.5
    fmt = {"type": "json_schema",
           "json_schema": {"name": name, "strict": strict, "schema": SCHEMAS[name]}}  # fmt: skip
    if rng.random() < 0.15:
        fmt, name = {"type": "json_object"}, "object"
    body = {"messages": [{"role": "user", "content": f"Give me a {name} as JSON."}],
            "max_tokens": 64, "temperature": 0, "response_format": fmt}  # fmt: skip
    if rng.random() < 0.2:
        body[SPEC] = 0
    return Case("schema", "chat/completions", _stream(rng, body), check=check_schema,
                greedy_key=f"schema/{name}/{strict}")  # fmt: skip


def tools_of(names: list[str]) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": f"the {n} tool",
             "parameters": FUNCTIONS[n]}} for n in names]  # fmt: skip


def tools_case(rng: random.Random) -> Case:
    i = rng.randrange(len(TOOL_PROMPTS))
    choice: Any = rng.choice(["required", "auto", "named"])
    if choice == "named":
        choice = {"type": "function", "function": {"name": rng.choice(sorted(FUNCTIONS))}}
    parallel = rng.random() < 0.5
    body = {"messages": [{"role": "user", "content": TOOL_PROMPTS[i]}], "max_tokens": CALL_TOKENS,
            "temperature": 0, "tools": tools_of(sorted(FUNCTIONS)), "tool_choice": choice,
            "parallel_tool_calls": parallel}  # fmt: skip
    key = f"tools/{i}/{json.dumps(choice)}/{parallel}"
    return Case("tools", "chat/completions", _stream(rng, body), check=check_tools,
                greedy_key=key)  # fmt: skip


def anthropic_case(rng: random.Random) -> Case:
    i = rng.randrange(len(TOOL_PROMPTS))
    body: dict = {"model": "any", "max_tokens": CALL_TOKENS, "temperature": 0,
                  "system": "Be brief.",
                  "messages": [{"role": "user", "content": TOOL_PROMPTS[i]}]}  # fmt: skip
    choice: Any = None
    if rng.random() < 0.6:
        body["tools"] = [{"name": n, "description": f"the {n} tool", "input_schema": s}
                         for n, s in sorted(FUNCTIONS.items())]  # fmt: skip
        choice = rng.choice([{"type": "any"}, {"type": "auto"},
                             {"type": "tool", "name": "add"}])  # fmt: skip
        body["tool_choice"] = choice
    elif rng.random() < 0.5:
        body["stop_sequences"] = ["\n"]
    if rng.random() < 0.5:
        body["stream"] = True
    key = f"messages/{i}/{json.dumps(choice)}/{body.get('stop_sequences')}"
    return Case("anthropic", "messages", body, check=check_anthropic, greedy_key=key)


def cancel_case(rng: random.Random) -> Case:
    """A stream closed after a few events, or a request abandoned before its reply."""
    case = rng.choice([chat_case, completion_case, anthropic_case, tools_case, sampled_n_case,
                       logprobs_case, schema_case])(rng)  # fmt: skip
    body = {**case.body, "max_tokens": 200}
    if rng.random() < 0.7:
        body = {**body, "stream": True}
        after = rng.randrange(1, 6)
    else:
        body.pop("stream", None)
        after = 0
    return Case("cancel", case.endpoint, body, expect=frozenset({200}), cancel_after=after)


def check_any_reply(case: Case, out: Outcome) -> list[str]:
    return []


def check_stops(case: Case, out: Outcome) -> list[str]:
    stops = case.body.get("stop") or []
    return [f"choice {i} holds stop string {s!r}: {c.text!r}"
            for i, c in enumerate(out.choices) for s in stops if s in c.text]  # fmt: skip


def check_n(case: Case, out: Outcome) -> list[str]:
    n = case.body["n"]
    errs = [] if len(out.choices) == n else [f"{len(out.choices)} choices for n={n}"]
    return errs + [f"choice {i} has no finish_reason" for i, c in enumerate(out.choices)
                   if c.finish is None]  # fmt: skip


def check_logprobs(case: Case, out: Outcome) -> list[str]:
    errs = []
    for i, c in enumerate(out.choices):
        if c.logprobs is None:  # a reply of no tokens may stream none
            if (out.usage or {}).get("completion_tokens") != 0:
                errs.append(f"choice {i} has no logprobs")
            continue
        if (
            out.usage
            and len(out.choices) == 1
            and len(c.logprobs) != out.usage["completion_tokens"]
        ):
            errs.append(f"{len(c.logprobs)} logprobs for {out.usage['completion_tokens']} tokens")
        k = case.body.get("top_logprobs", case.body.get("logprobs"))
        for e in c.logprobs:
            lp = e["logprob"] if isinstance(e, dict) else e
            if not lp <= 0.0:
                errs.append(f"logprob {lp} > 0")
            top = e.get("top_logprobs") if isinstance(e, dict) else None
            if top is not None and len(top) != k:
                errs.append(f"{len(top)} top_logprobs, asked {k}")
    return errs[:3]


def check_schema(case: Case, out: Outcome) -> list[str]:
    fmt = case.body["response_format"]
    errs = []
    for i, c in enumerate(out.choices):
        if c.finish == "length":  # a JSON value cut short: counted as "cut", not checked
            continue
        try:
            value = json.loads(c.text)
        except ValueError as e:
            errs.append(f"choice {i} is not JSON ({e}): {c.text!r}")
            continue
        schema = (
            fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
        )
        errs += [f"choice {i}: {e}" for e in schema_errors(value, schema)]
    return errs


def _call_errors(calls: list, choice: Any) -> list[str]:
    errs = []
    for name, arguments in calls:
        if name not in FUNCTIONS:
            errs.append(f"call of unknown {name!r}")
            continue
        named = (choice.get("function") or choice).get("name") if isinstance(choice, dict) else None
        if named is not None and name != named:
            errs.append(f"call of {name!r}, tool_choice named {named!r}")
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as e:
            errs.append(f"{name} arguments not JSON ({e}): {arguments!r}")
            continue
        errs += [f"{name}: {e}" for e in schema_errors(args, FUNCTIONS[name])]
    return errs


def check_tools(case: Case, out: Outcome) -> list[str]:
    choice = case.body["tool_choice"]
    errs = []
    for c in out.choices:
        forced = choice != "auto"
        if forced and not c.calls and c.finish != "length":
            errs.append(f"tool_choice {choice} but no call: {c.text!r}")
        if c.calls and c.finish not in ("tool_calls", "length"):
            errs.append(f"calls with finish_reason {c.finish}")
        if not case.body["parallel_tool_calls"] and len(c.calls) > 1:
            errs.append(f"{len(c.calls)} calls with parallel_tool_calls false")
        if c.finish != "length":  # a cut-off call's arguments may be cut short too
            errs += _call_errors(c.calls, choice)
    return errs


def check_anthropic(case: Case, out: Outcome) -> list[str]:
    choice = case.body.get("tool_choice")
    errs = []
    for c in out.choices:
        if choice and choice["type"] != "auto" and not c.calls and c.finish != "max_tokens":
            errs.append(f"tool_choice {choice} but no tool_use: {c.text!r}")
        want = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
        if c.finish not in want:
            errs.append(f"stop_reason {c.finish!r}")
        if c.calls and c.finish not in ("tool_use", "max_tokens"):
            errs.append(f"tool_use blocks with stop_reason {c.finish}")
        if c.finish == "tool_use" and not c.calls:
            errs.append("stop_reason tool_use without a tool_use block")
        stops = case.body.get("stop_sequences") or []
        errs += [f"text holds stop sequence {s!r}" for s in stops if s in c.text]
        if (c.finish == "stop_sequence") != (c.stop_sequence in stops):
            errs.append(f"stop_reason {c.finish} with stop_sequence {c.stop_sequence!r}")
        errs += _call_errors(c.calls, choice)
    return errs
