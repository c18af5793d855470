"""Constrained decoding (engine/constraint.py, engine/grammar.py): JSON Schemas and grammars
through llguidance, ignore_eos, on a tiny random Qwen2 that carries the real 0.5B's tokenizer (its
free text is gibberish, so a reply that parses is the constraint's doing)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import minfer_jax
from minfer_jax.engine.constraint import ConstraintError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    },
    "required": ["name", "tags", "point", "code"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(real_model):
    from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model_from_config

    cfg = dataclasses.replace(
        SYNTHETIC_CONFIGS["qwen2.5-0.5b"],
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        head_dim=0,
    )
    gm = synthetic_model_from_config(cfg, "q8_0", seed=1)
    gm.metadata.update({k: v for k, v in real_model.metadata.items() if k.startswith("tokenizer.")})
    return minfer_jax.load(gguf_model=gm, kernels="xla", ctx_size=512, progress=False)


def validate(value, schema) -> None:
    """The few JSON Schema rules SCHEMA uses (no jsonschema dependency)."""
    assert isinstance(value, dict) and set(value) == set(schema["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert 1 <= len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b", "c"}
    point = value["point"]
    assert set(point) == {"x", "y"} and all(type(v) is int for v in point.values())
    assert -99 <= point["x"] <= 99 and 0 <= point["y"] <= 9
    assert re.fullmatch("[A-Z]{3}", value["code"])


@pytest.mark.real_model
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_reply_parses_and_validates(tiny, temperature):
    out = minfer_jax.generate(
        tiny,
        "Reply in JSON:",
        json_schema=SCHEMA,
        max_new_tokens=120,
        temperature=temperature,
        seed=3,
        decode_steps=4,
    )
    assert out.stop_reason == "eos", out.text
    validate(json.loads(out.text), SCHEMA)


@pytest.mark.real_model
def test_a_gbnf_grammar_and_a_lark_grammar_constrain_the_text(tiny):
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    out = minfer_jax.generate(tiny, "Answer:", grammar=gbnf, max_new_tokens=10, temperature=1.0)
    assert re.fullmatch("yes|no|maybe [0-9]", out.text), out.text
    lark = '%llguidance {}\nstart: "A" /[b-d]{2}/'
    out = minfer_jax.generate(tiny, "Answer:", grammar=lark, max_new_tokens=10)
    assert re.fullmatch("A[b-d]{2}", out.text), out.text


@pytest.mark.real_model
def test_ignore_eos_runs_to_max_tokens(tiny):
    eos = sorted(tiny.tokenizer.eos_ids)
    free = minfer_jax.generate(tiny, "hi", max_new_tokens=24, temperature=0)
    # a prompt whose greedy continuation ends at once: the EOS logit made the largest
    banned = minfer_jax.generate(tiny, "hi", max_new_tokens=24, temperature=0, ignore_eos=True)
    assert len(banned.tokens) == 24 and banned.stop_reason == "length"
    assert not set(banned.tokens) & set(eos)
    assert free.tokens == banned.tokens[: len(free.tokens)] or free.stop_reason == "eos"


@pytest.mark.real_model
@pytest.mark.parametrize(
    "kwargs",
    [
        {"grammar": 'root ::= "a'},
        {"grammar": "root ::= missing"},
        {"json_schema": {"type": "nope"}},
        {"json_schema": {"$ref": "#/definitions/x"}},
        {"json_schema": "not a schema"},
    ],
)
def test_bad_grammars_are_constraint_errors(tiny, kwargs):
    with pytest.raises(ConstraintError):
        minfer_jax.generate(tiny, "x", max_new_tokens=2, **kwargs)


def test_every_openai_request_field_is_known():
    """The official client's request fields (its TypedDicts) are each a field of the body, a
    setting refused past its no-op value, or one that only describes the caller: none is dropped
    without a word."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    from minfer_jax.server.schemas import (
        CALLER_FIELDS,
        UNSUPPORTED,
        ChatCompletionRequest,
        CompletionRequest,
    )

    for kind, params in (
        (CompletionRequest, completion_create_params.CompletionCreateParamsBase),
        (ChatCompletionRequest, chat_params.CompletionCreateParamsBase),
    ):
        known = set(kind.model_fields) | set(UNSUPPORTED) | set(CALLER_FIELDS)
        fields = set(params.__annotations__)
        assert len(fields) > 15 and fields <= known, sorted(fields - known)


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
    {"name": "clock", "parameters": {"type": "object", "properties": {}}},
]


@pytest.mark.parametrize("fmt_name", ["QwenJsonCalls", "XmlCalls", "Llama3JsonCalls"])
def test_each_call_format_parses_its_calls_and_streams_content_around_them(fmt_name):
    from minfer_jax.server import tools

    fmt = getattr(tools, fmt_name)()
    reply = {
        "QwenJsonCalls": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "clock", '
        '"arguments": {}}\n</tool_call>',
        "XmlCalls": "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=clock>\n</function>\n</tool_call>",
        "Llama3JsonCalls": '<|python_tag|>{"name": "get_weather", "parameters": '
        '{"city": "Paris", "days": 2}}',
    }[fmt_name]
    content, calls = fmt.parse(reply)
    assert content == ("" if fmt_name == "Llama3JsonCalls" else "Sure.\n")
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert [c.name for c in calls] == ["get_weather", "clock"][: len(calls)]
    stream = tools.CallStream(fmt)
    sent = "".join(stream.feed(reply[i : i + 3]) for i in range(0, len(reply), 3))
    rest, streamed = stream.finish()
    assert sent + rest == content and [c.name for c in streamed] == [c.name for c in calls]
    assert fmt.parse("no call here") == ("no call here", [])


@pytest.mark.real_model
@pytest.mark.parametrize(
    "fmt_name",
    [
        "QwenJsonCalls",
        "XmlCalls",
        "Llama3JsonCalls",
        "MistralCalls",
        "Gemma4Calls",
        "DeepSeekCalls",
    ],
)
def test_forced_call_grammars_compile_and_constrain(tiny, fmt_name):
    from minfer_jax.server import tools

    fmt = getattr(tools, fmt_name)()
    grammar = tools.forced_grammar(fmt, TOOLS[:1], parallel=False)
    out = minfer_jax.generate(tiny, "call", grammar=grammar, max_new_tokens=160, temperature=0)
    _, calls = fmt.parse(out.text)
    assert out.stop_reason == "eos" and [c.name for c in calls] == ["get_weather"], out.text
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "days"} and type(args["days"]) is int, args
    # tool_choice auto with a response schema: this format's calls or the schema (compiles)
    either = tools.call_or_answer_grammar(fmt, TOOLS[:1], True, {"type": "object"})
    assert tiny.constraint(grammar=either) is not None
    assert tools.call_format("... <function=x> ...").__class__ is tools.XmlCalls
    assert tools.call_format("{{ '<tool_call>' }}").__class__ is tools.QwenJsonCalls
    assert tools.call_format("<|python_tag|>").__class__ is tools.Llama3JsonCalls
    assert tools.call_format("{{ messages }}") is None


@pytest.mark.parametrize(
    "reply, inside, reasoning, content",
    [
        ("<think>\nplan it\n</think>\n\nthe answer", False, "plan it", "the answer"),
        ("plan it\n</think>\n\nthe answer", True, "plan it", "the answer"),  # R1: opened by prompt
        ("just the answer", False, None, "just the answer"),
        ("<think>cut off while thinking", False, "cut off while thinking", ""),
        ("a </think> in an answer", False, None, "a </think> in an answer"),
    ],
)
def test_reasoning_is_split_from_content_whole_and_streamed(reply, inside, reasoning, content):
    from minfer_jax.server.reasoning import ReasoningStream, prompt_opens_think, split_reasoning

    assert split_reasoning(reply, inside) == (reasoning, content)
    for size in (1, 2, 5):
        stream, parts = ReasoningStream(inside), [("", "")]
        parts += [stream.feed(reply[i : i + size]) for i in range(0, len(reply), size)]
        parts.append(stream.finish())
        assert "".join(c for _, c in parts) == content
        assert "".join(r for r, _ in parts).strip() == (reasoning or "")
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<think>\n\n</think>\n\n")


@pytest.mark.real_model
def test_a_strict_function_under_auto_holds_a_call_once_its_opener_comes(tiny):
    """strict: true under tool_choice auto was not enforced (the arguments parsed as generated):
    now llama.cpp's lazy grammar, free text until the opener token, then a call valid against
    the schema."""
    from minfer_jax.server import tools

    opener = tiny.tokenizer.token_to_id("<tool_call>")
    grammar = tools.lazy_call_grammar(tools.QwenJsonCalls(opener_id=opener), TOOLS[:1], False)

    def refused_at(text: str) -> int | None:
        return first_refused(tiny.constraint(grammar=grammar), tiny.tokenizer.encode(text))

    call = (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":DAYS}}\n</tool_call>'
    )
    assert refused_at("Free text, <think>any</think> tokens {not JSON: 'x'}.\n") is None
    assert refused_at("Sure.\n" + call.replace("DAYS", "3")) is None
    bad = "Sure.\n" + call.replace("DAYS", '"many"')  # refused inside the call, not before
    at = refused_at(bad)
    assert at is not None and at > tiny.tokenizer.encode(bad).index(opener), at


def first_refused(constraint, ids: list[int]) -> int | None:
    """The index of the first of ids the constraint refuses (None: all taken)."""
    for i, token in enumerate(ids):
        try:
            constraint.advance(token)
        except ConstraintError:
            return i
    return None
