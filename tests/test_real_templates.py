"""Real chat templates of the models people run (tests/data/templates/, llama.cpp's copies):
they render in our sandbox exactly as the reference (transformers' apply_chat_template: a plain
ImmutableSandboxedEnvironment with its globals) renders them, in every shape of conversation the
server sends; and the tool calls each one teaches its model parse back into OpenAI calls."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jinja2
import jinja2.ext
import llguidance
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minfer_jax.errors import TemplateError
from minfer_jax.files.chat_template import render_chat_template
from minfer_jax.files.vocabulary import FORMAT_MARKERS
from minfer_jax.server import tool_call, tools
from minfer_jax.server.reasoning import (
    CLOSERS,
    ReasoningStream,
    prompt_opens_think,
    split_reasoning,
    thinks,
)
from minfer_jax.server.schemas import BadRequest

DATA = Path(__file__).parent / "data"
PATHS = {p.stem: p for p in sorted((DATA / "templates").glob("*.jinja"))}
PATHS["openai-gpt-oss-120b"] = DATA / "gpt-oss-chat-template.jinja"

# the tool-call format each template teaches (None: the template renders no calls)
FORMATS = {
    "Mistral-Small-3.2-24B-Instruct-2506": tools.MistralCalls("call_id"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": tools.QwenJsonCalls(),
    "Qwen-QwQ-32B": tools.QwenJsonCalls(),
    "Qwen-Qwen2.5-7B-Instruct": tools.QwenJsonCalls(),
    "Qwen-Qwen3-0.6B": tools.QwenJsonCalls(),
    "Qwen3-Coder": tools.XmlCalls(),
    "Qwen3.5-4B": tools.XmlCalls(),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": tools.DeepSeekCalls(),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": tools.DeepSeekCalls(),
    "google-gemma-3-it": None,
    "google-gemma-4-31B-it": tools.Gemma4Calls(),
    "google-gemma-4-31B-it-interleaved": tools.Gemma4Calls(),
    "meta-llama-Llama-3.1-8B-Instruct": tools.Llama3JsonCalls(),
    "meta-llama-Llama-3.2-3B-Instruct": tools.Llama3JsonCalls(),
    "meta-llama-Llama-3.3-70B-Instruct": tools.Llama3JsonCalls(),
    "microsoft-Phi-3.5-mini-instruct": None,
    "mistralai-Mistral-Nemo-Instruct-2407": tools.MistralCalls("json"),
    "unsloth-mistral-Devstral-Small-2507": tools.MistralCalls("args"),
    "openai-gpt-oss-120b": tools.HarmonyCalls(),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt <b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {  # a nested schema: enums, arrays of objects, nullable
    "type": "function",
    "function": {
        "name": "search",
        "description": "",  # the server fills in what a request leaves out, as llama-server
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "what to find"},
                "mode": {"type": "string", "enum": ["fast", "deep"]},
                "filters": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"field": {"type": "string"}, "value": {"type": "number"}},
                        "required": ["field"],
                    },
                },
                "limit": {"type": "integer", "nullable": True, "default": 10},
                "options": {"type": "object", "properties": {"safe": {"type": "boolean"}}},
            },
            "required": ["query", "mode"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
USER = {"role": "user", "content": "What is the weather in Köln?"}
SYSTEM = {"role": "system", "content": "You are terse."}
ANSWER = {"role": "assistant", "content": "Sunny."}
ARGS = {"city": "Köln", "days": 2}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "abc123def",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS},
        }
    ],
}
TWO_CALLS = {
    **CALL,
    "tool_calls": [
        *CALL["tool_calls"],
        {
            "id": "xyz987uvw",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {}},
        },
    ],
}
RESULT = {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "abc123def"}
RESULT2 = {**RESULT, "tool_call_id": "xyz987uvw"}
THOUGHT = {**ANSWER, "reasoning_content": "The user wants the weather."}
AGAIN = {"role": "user", "content": "And tomorrow?"}

# name: (messages, add_generation_prompt, template kwargs) as the server passes them
SCENARIOS: dict[str, tuple[list[dict], bool, dict[str, Any]]] = {
    "plain": ([USER], True, {}),
    "system": ([SYSTEM, USER], True, {}),
    "multi_turn": ([SYSTEM, USER, ANSWER, AGAIN], True, {}),
    "no_generation_prompt": ([USER, ANSWER], False, {}),
    "tools": ([SYSTEM, USER], True, {"tools": TOOLS}),
    "call_and_result": ([USER, CALL, RESULT], True, {"tools": TOOLS}),
    "parallel_calls": ([USER, TWO_CALLS, RESULT, RESULT2, ANSWER, AGAIN], True, {"tools": TOOLS}),
    "reasoning_kept": ([USER, THOUGHT, AGAIN], True, {}),
    "thinking_off": ([USER], True, {"enable_thinking": False}),
    "thinking_on": ([SYSTEM, USER], True, {"enable_thinking": True}),
    "reasoning_effort": ([USER], True, {"reasoning_effort": "high"}),
}
# the template itself refuses these, in both renderers alike: (template, scenario) -> its message
REFUSED = {
    ("google-gemma-3-it", "call_and_result"): "roles must alternate",  # no tool role
    ("google-gemma-3-it", "parallel_calls"): "roles must alternate",
    ("meta-llama-Llama-3.1-8B-Instruct", "parallel_calls"): "only supports single tool-calls",
    ("meta-llama-Llama-3.2-3B-Instruct", "parallel_calls"): "only supports single tool-calls",
    ("meta-llama-Llama-3.3-70B-Instruct", "parallel_calls"): "only supports single tool-calls",
}
# the template renders an assistant's calls only when its content is None, and the server
# sends '' (OpenAI's null content becomes text): the history loses the call
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "<|tool_response>", "</s>")
DROPS_CALLS = {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B"}


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.cache
def _reference(source: str) -> jinja2.Template:
    """transformers' chat-template environment (its _compile_jinja_template)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


@functools.cache
def _source(name: str) -> str:
    return PATHS[name].read_text("utf-8")


def _render(name: str, messages: list[dict], generation: bool, **kwargs: Any) -> str:
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    return render_chat_template(_source(name), messages, generation, **specials, **kwargs)


def test_every_stored_template_is_covered():
    assert set(PATHS) == set(FORMATS)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", sorted(PATHS))
def test_renders_as_the_reference_renderer(name, scenario):
    messages, generation, kwargs = SCENARIOS[scenario]
    context = {"bos_token": "<s>", "eos_token": "</s>", **kwargs}
    context |= {"messages": json.loads(json.dumps(messages)), "add_generation_prompt": generation}
    if (name, scenario) in REFUSED:
        with pytest.raises(jinja2.exceptions.TemplateError):
            _reference(_source(name)).render(**context)
        with pytest.raises(TemplateError, match=REFUSED[name, scenario]):
            _render(name, messages, generation, **kwargs)
        return
    expected = _reference(_source(name)).render(**context)
    assert _render(name, messages, generation, **kwargs) == expected
    assert USER["content"] in expected or scenario == "no_generation_prompt"


@pytest.mark.parametrize("name", sorted(PATHS))
def test_the_call_format_is_read_from_the_template(name):
    found, expected = tools.call_format(_source(name)), FORMATS[name]
    assert type(found) is type(expected)
    assert found == expected or not dataclasses.is_dataclass(found)  # Mistral's style too


@pytest.mark.parametrize(
    "name", sorted(n for n, f in FORMATS.items() if f and n not in DROPS_CALLS)
)
def test_a_call_the_template_renders_parses_back(name):
    """The assistant turn with a call, as the template writes it into the history (the format
    the model learnt), parses into the same call."""
    prompt = _render(name, [USER], True, tools=TOOLS)
    history = _render(name, [USER, CALL], False, tools=TOOLS)
    at = len(prompt)
    if not history.startswith(prompt):  # the history holds an (empty) think block instead
        at = next(i for i, (a, b) in enumerate(zip(prompt, history, strict=False)) if a != b)
        at = history.rfind("<", 0, at + 1)  # the marker both begin
    reply = history[at:]
    for end in END_OF_TURN:  # the engine stops at these: the reply the model gave holds none
        reply = reply.split(end)[0]
    content, calls = FORMATS[name].parse(reply)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)], reply
    assert "get_weather" not in content
    if isinstance(FORMATS[name], tools.MistralCalls) and FORMATS[name].style != "args":
        assert calls[0].id == "abc123def"  # the model's own id is kept


# llama.cpp's tests/test-chat.cpp: a model's replies in each format and the calls they hold
REPLIES = json.loads((DATA / "templates" / "llama_cpp_replies.json").read_text("utf-8"))


def _format(row: dict) -> Any:
    cls = getattr(tools, row["format"])
    return cls(row["style"]) if "style" in row else cls()


@pytest.mark.parametrize("row", REPLIES, ids=lambda row: row["format"])
def test_llama_cpp_replies_parse(row):
    fmt, reply, content = _format(row), row["reply"], row["content"]
    calls = [tuple(call) for call in row["calls"]]
    got_content, got = fmt.parse(reply)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got]) == (content, calls)
    stream = tools.CallStream(fmt)
    sent = "".join(stream.feed(reply[i : i + 3]) for i in range(0, len(reply), 3))
    rest, streamed = stream.finish()
    assert sent + rest == content and [c.name for c in streamed] == [c[0] for c in calls]
    assert fmt.parse("no call here") == ("no call here", [])


def test_mistral_ids_are_the_nine_characters_its_templates_take_back():
    _, calls = tools.MistralCalls("args").parse('[TOOL_CALLS]f[ARGS]{"a": 1}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    turn = {**CALL, "tool_calls": [calls[0].openai()]}
    turn["tool_calls"][0]["function"]["arguments"] = {"a": 1}
    result = {**RESULT, "tool_call_id": calls[0].id}
    text = _render("unsloth-mistral-Devstral-Small-2507", [USER, turn, result], True, tools=TOOLS)
    assert '[TOOL_CALLS]f[ARGS]{"a": 1}' in text


FUNCTIONS = [WEATHER["function"], SEARCH["function"]]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize(
    "fmt",
    [
        tools.MistralCalls("json"),
        tools.MistralCalls("call_id"),
        tools.MistralCalls("args", tools.Markers((("[TOOL_CALLS]", 9), ("[ARGS]", 32)))),
        tools.Gemma4Calls(),
        tools.Gemma4Calls(tools.Markers((("<|tool_call>", 9), ('<|"|>', 32)))),
        tools.DeepSeekCalls(),
    ],
    ids=repr,
)
def test_forced_call_grammars_compile(fmt, parallel):
    grammar = tools.forced_grammar(fmt, FUNCTIONS, parallel)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert "get_weather" in grammar and "search" in grammar
    if getattr(
        fmt, "marks", tools.Markers()
    ).control:  # a control token is matched as that token, never spelt out
        assert "<[9]>" in grammar and "<[32]>" in grammar
        assert '"[ARGS]"' not in grammar and '"<|\\"|>"' not in grammar


@pytest.mark.parametrize("fmt", [tools.Gemma4Calls(), tools.XmlCalls()], ids=repr)
def test_parameter_names_are_quoted_in_grammars(fmt):
    """A JSON Schema property may be named with any text: a quote or backslash in it stays text
    of the grammar's literal, not Lark syntax."""
    odd = {"type": "object", "properties": {'a"b\\c': {"type": "integer"}}, "required": ['a"b\\c']}
    grammar = tools.forced_grammar(fmt, [{"name": "f", "parameters": odd}], False)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_call_arguments_are_always_json_text():
    """A model's arguments written as a JSON string are taken as that text; a string that is no
    JSON object is encoded (the client's json.loads of arguments never fails)."""
    assert tool_call.arguments_text('{"a": 1}') == '{"a": 1}'
    assert tool_call.arguments_text("Paris") == '"Paris"'
    assert tool_call.arguments_text({"a": "é"}) == '{"a": "é"}'


def test_every_format_marker_survives_skipped_control_tokens():
    """The markers a reply is parsed by are decoded even where control tokens are skipped
    (files/vocabulary.py FORMAT_MARKERS): a format's marker missing there would reach the
    parser as nothing, and its calls the client as bare text."""
    kept = set(FORMAT_MARKERS)
    for fmt in (tools.QwenJsonCalls(), tools.XmlCalls(), tools.Llama3JsonCalls()):
        assert fmt.opener in kept
    for fmt in (tools.MistralCalls(), tools.Gemma4Calls(), tools.DeepSeekCalls()):
        assert set(fmt.marker_texts) <= kept
    assert {"<think>", "<|channel>", *CLOSERS} <= kept  # the think blocks' (reasoning.BLOCKS)


def _tool_request(template: str):
    tokenizer = SimpleNamespace(
        chat_template=template, token_to_id=lambda text: None, is_control=lambda i: False
    )
    tool = SimpleNamespace(
        model_dump=lambda **kwargs: {"type": "function", "function": {"name": "f"}}
    )
    body = SimpleNamespace(tools=[tool], tool_choice="auto", parallel_tool_calls=True)
    return SimpleNamespace(tokenizer=tokenizer), body


def test_tools_for_a_template_we_cannot_parse_are_refused_by_name():
    model, body = _tool_request("{% for t in tools %}{{ t | tojson }}{% endfor %}<|plugin|>")
    with pytest.raises(BadRequest, match="not one this server parses"):
        tools.tool_setup(model, body)
    model, body = _tool_request(_source("google-gemma-3-it"))
    with pytest.raises(BadRequest, match="renders no tools"):
        tools.tool_setup(model, body)
    model, body = _tool_request(_source("mistralai-Mistral-Nemo-Instruct-2407"))
    fmt, extra = tools.tool_setup(model, body)
    assert fmt == tools.MistralCalls("json")
    assert extra == {
        "tools": [
            {"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}
        ]
    }
    text = _render("openai-gpt-oss-120b", [USER], True, **extra)  # it needs the description
    assert "type f = () => any;" in text


# the Jinja the real templates use (and a little more), each against the reference renderer
DIALECT = json.loads((DATA / "templates" / "dialect_cases.json").read_text("utf-8"))
FEATURE_MESSAGES = [{"role": "user", "content": "  Hi /think\n", "meta": {"b": 2, "a": [1, "x"]}}]


@pytest.mark.parametrize("source", DIALECT)
def test_dialect_features_render_as_the_reference(source):
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    context = {**specials, "messages": FEATURE_MESSAGES, "add_generation_prompt": True}
    expected = _reference(source).render(**context)
    assert render_chat_template(source, FEATURE_MESSAGES, True, **specials) == expected
    with pytest.raises(TemplateError, match="nope"):
        render_chat_template(source + "{{ raise_exception('nope') }}", FEATURE_MESSAGES)


# llama.cpp's Gemma 4 replies: the thought channel is reasoning, as <think> is
GEMMA_THOUGHTS = [
    ("<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", "I'm\nthinking"),
    ("<|channel>thought<channel|>Hello, world!\nWhat's up?", ""),
    ("Hello, world!\nWhat's up?", None),
]


@pytest.mark.parametrize("reply, reasoning", GEMMA_THOUGHTS)
def test_gemma4_thought_channel_is_reasoning(reply, reasoning):
    template = _source("google-gemma-4-31B-it")
    assert thinks(template)
    for thinking in (False, True):
        prompt = _render("google-gemma-4-31B-it", [USER], True, enable_thinking=thinking)
        assert not prompt_opens_think(prompt[-40:])  # the reply opens the channel itself
    assert split_reasoning(reply, False) == (reasoning, "Hello, world!\nWhat's up?")
    for size in (1, 3, 7):
        stream, parts = ReasoningStream(False), []
        parts += [stream.feed(reply[i : i + size]) for i in range(0, len(reply), size)]
        parts.append(stream.finish())
        assert "".join(c for _, c in parts) == "Hello, world!\nWhat's up?"
        assert "".join(r for r, _ in parts).strip() == (reasoning or "")


def test_gemma4_reasoning_then_a_call():
    reply = (
        "<|channel>thought\nweather first<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Köln<|"|>}<tool_call|>'
    )
    reasoning, content = split_reasoning(reply, False)
    assert reasoning == "weather first"
    text, calls = tools.Gemma4Calls().parse(content)
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Köln"})
    ]
    assert not thinks(_source("google-gemma-3-it")) and not thinks(_source("openai-gpt-oss-120b"))


def test_qwen3_coder_string_parameters_stay_text():
    """A string parameter whose text reads as JSON (a file's content, "123") stays a string;
    the server learns which are strings from the request's tools (llama.cpp reads the schema)."""
    write = {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": ["string", "null"]}},
        },
    }
    model, body = _tool_request(_source("Qwen3-Coder"))
    body.tools = [
        SimpleNamespace(model_dump=lambda **kwargs: {"type": "function", "function": write})
    ]
    fmt, _ = tools.tool_setup(model, body)
    reply = (
        "<tool_call>\n<function=write>\n<parameter=path>\n123\n</parameter>\n"
        '<parameter=content>\n{"name": "pkg", "private": true}\n</parameter>\n'
        "<parameter=mode>\n644\n</parameter>\n</function>\n</tool_call>"
    )
    args = json.loads(fmt.parse(reply)[1][0].arguments)
    assert args == {"path": "123", "content": '{"name": "pkg", "private": true}', "mode": 644}
    assert json.loads(tools.XmlCalls().parse(reply)[1][0].arguments)["path"] == 123  # no schema


def test_qwen35_a_call_inside_the_reasoning_is_no_call():
    """llama.cpp's case: with thinking on (the prompt opens <think>), a call written while
    reasoning stays reasoning; the one after </think> is the call."""
    prompt = _render("Qwen3.5-4B", [USER], True, tools=TOOLS)
    assert prompt_opens_think(prompt[-20:])
    call = (
        "<tool_call>\n<function=python>\n<parameter=code>\nprint({})\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    reply = f"Let's call a tool: {call.format(0)}\n</think>\n\n{call.format(1)}"
    reasoning, content = split_reasoning(reply, True)
    assert reasoning == f"Let's call a tool: {call.format(0)}"
    assert tools.XmlCalls().parse(content)[1][0].arguments == '{"code": "print(1)"}'
