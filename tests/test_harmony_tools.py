"""gpt-oss tool calls in harmony (issue 54): `<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{...}<|call|>` parsed into OpenAI tool_calls (whole and streamed), kept
out of the content, forced by a grammar when tool_choice asks, and the results rendered back through
the harmony template; end to end on the synthetic gpt-oss-tiny with a harmony vocabulary, through
the server and the official openai client."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

from minfer_jax.engine.steps import StopReason
from minfer_jax.files.chat_template import render_chat_template
from minfer_jax.files.harmony import HarmonyStream, split_channels
from minfer_jax.server.openai_format import Reply
from minfer_jax.server.tools import HarmonyCalls, call_format, forced_grammar

TEMPLATE = (Path(__file__).parent / "data" / "gpt-oss-chat-template.jinja").read_text("utf-8")
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
CALL_TEXT = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "c"}'
)
RECIPIENT_FIRST = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'


def test_the_template_is_harmonys_call_format():
    assert isinstance(call_format(TEMPLATE), HarmonyCalls)


@pytest.mark.parametrize(
    "text, name, arguments, rest",
    [
        (CALL_TEXT, "get_weather", {"city": "Paris", "unit": "c"}, "Need the weather."),
        (RECIPIENT_FIRST, "get_weather", {"city": "Oslo"}, ""),
        (RECIPIENT_FIRST + "<|call|>", "get_weather", {"city": "Oslo"}, ""),
    ],
)
def test_a_call_parses_and_leaves_the_reasoning(text, name, arguments, rest):
    remaining, calls = HarmonyCalls().parse(text)
    assert [c.name for c in calls] == [name]
    assert json.loads(calls[0].arguments) == arguments
    assert split_channels(remaining).get("reasoning_content", "") == rest
    assert split_channels(remaining)["content"] == ""
    answer = "<|channel|>final<|message|>Sunny."
    assert HarmonyCalls().parse(answer) == (answer, [])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_streamed_call_is_never_content(size):
    stream = HarmonyStream()
    pieces = []
    for text in (CALL_TEXT, RECIPIENT_FIRST):
        stream = HarmonyStream()
        pieces = []
        for i in range(0, len(text), size):
            pieces += stream.feed(text[i : i + size])
        pieces += stream.finish()
        assert all(field != "content" for field, _ in pieces), pieces
    assert "".join(t for f, t in pieces if f == "reasoning_content") == ""


def test_reply_shapes_of_a_call():
    text, calls = HarmonyCalls().parse(CALL_TEXT)
    whole = Reply("chat", "m", harmony=True).full(text, StopReason.EOS, 5, 9, tool_calls=calls)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "Need the weather."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"


def test_tool_results_render_back_through_the_harmony_template():
    """As the server hands them to the template (schemas.ChatMessage.as_template_message): the
    call with its arguments as an object, then the result as the function's message."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    tools = [{"type": "function", "function": WEATHER}]
    text = render_chat_template(TEMPLATE, messages, add_generation_prompt=True, tools=tools)
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": '
        '"Paris"}<|call|>' in text
    )
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"temp\\": 21}"<|end|><|start|>assistant'
    ) in text


# -- end to end: the synthetic gpt-oss-tiny with a harmony vocabulary -----------------------------
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                    "<|constrain|>"]  # fmt: skip


@pytest.fixture(scope="module")
def gptoss():
    """gpt-oss-tiny (random weights) whose vocabulary is the byte alphabet, harmony's framing
    tokens and fillers, with the gpt-oss chat template."""
    import minfer_jax
    from tests.test_tokenizer import _byte_level_alphabet

    from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model_from_config

    cfg = SYNTHETIC_CONFIGS["gpt-oss-tiny"]
    alphabet = _byte_level_alphabet()
    fillers = [f"<|filler_{i}|>" for i in range(cfg.vocab_size - len(alphabet) - 7)]
    tokens = [*alphabet, *HARMONY_SPECIALS, *fillers]
    gm = synthetic_model_from_config(cfg, "q8_0", seed=2)
    gm.metadata.update(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-4o",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(alphabet) + [3] * (len(tokens) - len(alphabet)),
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
            "tokenizer.ggml.eot_token_id": tokens.index("<|end|>"),
            "tokenizer.chat_template": TEMPLATE,
        }
    )
    return minfer_jax.load(gguf_model=gm, kernels="xla", ctx_size=1024, progress=False)


SERVER_SEED = 11  # the servers' -s/--seed: every request without a seed samples reproducibly


@contextlib.contextmanager
def _served(model, seed: int = SERVER_SEED):
    """A test client of a server on `model`, once loaded (-s seed: the requests that give no
    seed sample one fixed draw; the Anthropic API has no seed field)."""
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    app = create_app(ServerSettings(warmup=False, seed=seed), loader=lambda *a, **k: model)
    with TestClient(app, base_url="http://localhost") as http:
        while app.state.backend.status == "loading":
            time.sleep(0.01)
        yield http


def _streamed_choices(http, body: dict):
    """The choices of every chunk of `body`'s streamed chat reply, in order."""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield from json.loads(line[6:])["choices"]


def test_the_server_seed_is_the_seed_of_requests_that_give_none(gptoss):
    """-s/--seed (llama-server's): a request without a seed draws what one with seed=-s draws;
    an explicit seed still wins."""
    import anthropic
    import openai

    with _served(gptoss, seed=3) as http:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        ask = dict(model="m", prompt="Once upon", max_tokens=8, temperature=1.5)

        def text(**extra) -> str:
            body = {"top_k": 0, **extra}  # the whole vocabulary: two seeds' draws part at once
            return client.completions.create(**ask, extra_body=body).choices[0].text

        unseeded, three, four = text(), text(seed=3), text(seed=4)
        assert unseeded == three != four, (unseeded, three, four)
        assert text(seed=-1) == three  # -1 is "none given", as in llama-server

        # the Anthropic API has no seed field: -s is what makes its samples repeat (with a random
        # seed each these two 8-token replies at temperature 1 differ)
        claude = anthropic.Anthropic(base_url="http://localhost", api_key="x", http_client=http)

        def reply() -> list:
            out = claude.messages.create(
                model="m", messages=[{"role": "user", "content": "Once upon"}], max_tokens=8,
                extra_body={"temperature": 1.0}, thinking={"type": "enabled", "budget_tokens": 64},
            )  # fmt: skip
            return [b.model_dump(exclude_none=True) for b in out.content]

        first = reply()
        assert first and reply() == first


def test_a_forced_call_compiles_and_its_arguments_validate(gptoss):
    import minfer_jax

    assert gptoss.tokenizer.harmony
    grammar = forced_grammar(HarmonyCalls(), [WEATHER], parallel=False)
    out = minfer_jax.generate(gptoss, "call", grammar=grammar, max_new_tokens=160, temperature=1.0)
    _, calls = HarmonyCalls().parse(out.text)
    assert out.stop_reason == "eos" and [c.name for c in calls] == ["get_weather"], out.text
    _valid(calls[0].arguments)


def _valid(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f"), args
    assert isinstance(args["city"], str) and len(args["city"]) <= 6


def test_harmony_calls_through_the_server_and_the_openai_client(gptoss):
    import openai

    # -s: a fixed sample for the requests that give no seed (a random one each made this a lottery)
    with _served(gptoss) as http:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        tools = [{"type": "function", "function": WEATHER}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        full = client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice=named, max_tokens=160
        )
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        _valid(call.function.arguments)

        stream = client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice="required", max_tokens=160,
            stream=True, seed=5,
        )  # fmt: skip
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                got = calls.setdefault(c.index, {"name": "", "arguments": ""})
                got["name"] += c.function.name or ""
                got["arguments"] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and list(calls) == [0] and content == "", (calls, content)
        assert calls[0]["name"] == "get_weather"
        _valid(calls[0]["arguments"])

        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ]
        again = client.chat.completions.create(
            model="m", messages=history, tools=tools, max_tokens=4
        )
        assert again.usage.prompt_tokens > full.usage.prompt_tokens + 20  # the call and result


# -- the Anthropic Messages API on harmony -------------------------------------------------------
ANALYSIS_AND_FINAL = (
    "<|channel|>analysis<|message|>Think it over.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny, 21 C."
)


def _split(show_thinking: bool, calls=True):
    from minfer_jax.server.anthropic_reply import BlockSplit

    return BlockSplit(HarmonyCalls() if calls else None, None, True, show_thinking)


@pytest.mark.parametrize("show", [True, False])
@pytest.mark.parametrize(
    "text, reason, thinking, answer, call, stop",
    [
        (ANALYSIS_AND_FINAL, StopReason.EOS, "Think it over.", "Sunny, 21 C.", None, "end_turn"),
        (CALL_TEXT, StopReason.EOS, "Need the weather.", "", {"city": "Paris", "unit": "c"},
         "tool_use"),
        (CALL_TEXT[:-8], StopReason.LENGTH, "Need the weather.", "", None, "max_tokens"),
        (ANALYSIS_AND_FINAL[:-6], StopReason.LENGTH, "Think it over.", "Sunny,", None,
         "max_tokens"),
    ],
)  # fmt: skip
def test_messages_blocks_of_harmony_text(text, reason, thinking, answer, call, stop, show):
    """Whole: thinking (only where the request enables it), text, tool_use; a call cut off by
    max_tokens is none. Streamed in pieces of every size: the official client's accumulator
    rebuilds the same message from the events."""
    from anthropic.lib.streaming._messages import accumulate_event

    from minfer_jax.server.anthropic_reply import EventStream, stop_reason, whole_content

    blocks, uses = whole_content(_split(show), text, reason)
    want = [{"type": "thinking", "thinking": thinking, "signature": ""}] if show else []
    want += [{"type": "text", "text": answer}] if answer else []
    assert [{k: v for k, v in b.items() if k not in ("id", "input")} for b in blocks] == [
        *want, *([{"type": "tool_use", "name": "get_weather"}] if call else [])
    ]  # fmt: skip
    assert [u[1] for u in uses] == ([call] if call else []) and stop_reason(reason, uses) == stop
    for size in (1, 5, 1000):
        events = EventStream(_split(show), {"id": "msg_1", "type": "message",
                                           "role": "assistant", "model": "m"})  # fmt: skip
        sse = events.start(40)
        for i in range(0, len(text), size):
            sse += events.piece(text[i : i + size])
        sse += events.end(text, reason, 40, 9, 30)
        message = None
        for event in sse:
            data = json.loads(event.split("data: ", 1)[1])
            message = accumulate_event(event=data, current_snapshot=message, json_bufs={})
        assert message is not None and message.stop_reason == stop
        got = [b.model_dump(exclude_none=True) for b in message.content]
        assert [{k: v for k, v in b.items() if k not in ("id", "citations")} for b in got] == [
            *want, *([{"type": "tool_use", "name": "get_weather", "input": call}] if call else [])
        ], size  # fmt: skip
        assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (10, 30)


def test_anthropic_history_renders_through_the_harmony_template():
    """System prompt as the developer message, tools as harmony's declarations, an assistant's
    thinking before its call, each call of a parallel turn followed by its own result."""
    from minfer_jax.files.harmony import template_messages
    from minfer_jax.server.anthropic import MessagesRequest, to_chat

    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["parameters"]}  # fmt: skip
    uses = [{"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": c}}
            for i, c in enumerate(["Paris", "Oslo"])]  # fmt: skip
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "system": "You are terse.", "tools": [tool],
         "messages": [
             {"role": "user", "content": "Weather in Paris and Oslo?"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Two cities.", "signature": ""}, *uses]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "t1", "content": "5 C"},
                 {"type": "tool_result", "tool_use_id": "t0", "content": [
                     {"type": "text", "text": "21 C"}]}]},
         ]}
    )  # fmt: skip
    chat = to_chat(body)
    messages = template_messages([m.as_template_message() for m in chat.messages])
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
    text = render_chat_template(TEMPLATE, messages, add_generation_prompt=True, tools=tools)
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n# Tools" in text
    assert "type get_weather = (_: {" in text and "// The weather in a city" in text
    call = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Two cities.<|end|>"
        f'{call}{{"city": "Paris"}}<|call|>{result}"21 C"<|end|>'
        f'{call}{{"city": "Oslo"}}<|call|>{result}"5 C"<|end|><|start|>assistant'
    ) in text, text


def test_anthropic_messages_on_gpt_oss_with_the_official_client(gptoss):
    """The anthropic client against the server on gpt-oss-tiny (harmony): a forced tool call whole
    and streamed (tool_use blocks whose input validates, stop_reason tool_use, no harmony framing
    in any text), its result fed back (the prompt grows by the call and the result), and a free
    reply cut at max_tokens."""
    import anthropic

    from minfer_jax.files.harmony import MARKERS

    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["parameters"]}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    # the Anthropic API has no seed field: the server's -s makes its sampled replies one fixed draw
    with _served(gptoss) as http:
        client = anthropic.Anthropic(base_url="http://localhost", api_key="x", http_client=http)
        forced = client.messages.create(
            model="m", system="You are terse.", messages=messages, tools=[tool], max_tokens=160,
            tool_choice={"type": "tool", "name": "get_weather"},
        )  # fmt: skip
        assert forced.stop_reason == "tool_use", forced
        (use,) = forced.content
        assert use.type == "tool_use" and use.name == "get_weather"
        _valid(json.dumps(use.input))
        assert forced.usage.input_tokens > 50 and forced.usage.output_tokens > 5

        with client.messages.stream(
            model="m", messages=messages, tools=[tool], max_tokens=160,
            tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024},
        ) as stream:  # fmt: skip
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
        _valid(json.dumps(final.content[0].input))

        history = messages + [
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]},
        ]  # fmt: skip
        count = client.messages.count_tokens(model="m", messages=history, tools=[tool])
        assert count.input_tokens > forced.usage.input_tokens + 15  # the call and its result
        free = client.messages.create(model="m", messages=history, tools=[tool], max_tokens=3)
        assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 3, free
        texts = [b.text for b in free.content if b.type == "text"]
        assert not any(m in t for t in texts for m in MARKERS), texts
        assert all(b.type == "text" for b in free.content)  # no thinking: not enabled


def test_tools_without_a_description_on_gpt_oss(gptoss):
    """A description is optional in both APIs, but the gpt-oss template writes "// " +
    description unguarded: a tool without one was a 400 "chat template failed"."""
    import anthropic
    import openai

    bare = {k: v for k, v in WEATHER.items() if k != "description"}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with _served(gptoss) as http:
        client = anthropic.Anthropic(base_url="http://localhost", api_key="x", http_client=http)
        tool = {"name": bare["name"], "input_schema": bare["parameters"]}
        count = client.messages.count_tokens(model="m", messages=messages, tools=[tool])
        assert count.input_tokens > 40
        chat = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        reply = chat.chat.completions.create(
            model="m", messages=messages, tools=[{"type": "function", "function": bare}],
            max_tokens=1, temperature=0,
        )  # fmt: skip
        assert reply.usage.prompt_tokens == count.input_tokens


ANSWER = {
    "type": "object",
    "properties": {"temp": {"type": "integer", "minimum": -50, "maximum": 50}},
    "required": ["temp"],
    "additionalProperties": False,
}


def _call_or_answer(choice) -> str:
    """'call' or 'answer' for a reply of tool_choice auto with a schema: a valid call of
    get_weather, or content valid against ANSWER (anything else fails)."""
    if choice["tool_calls"]:
        ((name, arguments),) = choice["tool_calls"]
        assert name == "get_weather" and not choice["content"], choice
        _valid(arguments)
        return "call"
    value = json.loads(choice["content"])
    assert set(value) == {"temp"} and -50 <= value["temp"] <= 50, value
    return "answer"


def _shown(choice: dict) -> tuple:
    """A chat choice's content and calls (names and arguments; their ids are fresh each time)."""
    calls = choice["message"].get("tool_calls") or []
    return choice["message"]["content"], [(t["function"]["name"], t["function"]["arguments"])
                                          for t in calls]  # fmt: skip


def test_tools_with_a_response_schema_call_or_answer_in_it_whole_and_streamed(gptoss):
    """tool_choice auto with response_format: the schema's grammar alone made a call impossible
    (silently); now the reply is a valid call or a valid answer, as OpenAI allows both. A
    grammar beside tools is a 400 naming it (llama-server refuses it too)."""
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": ANSWER}}
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": WEATHER}],
        "response_format": schema, "max_tokens": 120, "temperature": 1.0, "n": 2, "seed": 1,
    }  # fmt: skip
    with _served(gptoss) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        kinds = []
        for c in whole["choices"]:
            content, calls = _shown(c)
            kinds.append(_call_or_answer({"tool_calls": calls, "content": content}))
        assert set(kinds) == {"call", "answer"}, whole

        streamed: dict[int, dict] = {}
        for c in _streamed_choices(http, body):
            got = streamed.setdefault(c["index"], {"content": "", "calls": {}})
            got["content"] += c["delta"].get("content") or ""
            for t in c["delta"].get("tool_calls") or []:
                call = got["calls"].setdefault(t["index"], ["", ""])
                call[0] += t["function"].get("name") or ""
                call[1] += t["function"].get("arguments") or ""
        kinds_streamed = [
            _call_or_answer({"tool_calls": [tuple(v) for v in s["calls"].values()],
                             "content": s["content"]})
            for _, s in sorted(streamed.items())
        ]  # fmt: skip
        assert kinds_streamed == kinds  # the same seeds: the same replies

        # llama-server's json_schema field is the same schema
        same = {**body, "response_format": None, "json_schema": ANSWER}
        again = http.post("/v1/chat/completions", json=same).json()["choices"]
        assert [_shown(c) for c in again] == [_shown(c) for c in whole["choices"]]
        grammar = {**body, "response_format": None, "grammar": 'root ::= "x"'}
        r = http.post("/v1/chat/completions", json=grammar)
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
        r = http.post("/v1/chat/completions", json={**grammar, "tool_choice": "none", "n": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "x"


# -- logprobs of a harmony chat follow its fields -------------------------------------------------
def _tokens(text: str, size: int) -> list[str]:
    """text as a model emits it: each marker one token, the rest in pieces of `size` chars."""
    import re

    from minfer_jax.files.harmony import MARKERS

    out = []
    for part in re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text):
        out += (
            [part] if part in MARKERS else [part[i : i + size] for i in range(0, len(part), size)]
        )
    return out


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize(
    "text",
    [CALL_TEXT, RECIPIENT_FIRST, ANALYSIS_AND_FINAL, ANALYSIS_AND_FINAL[:-6], " to", " tomorrow",
     "plain text", "<|channel|>final<|message|>a<|channel|>analysis<|message|>b",
     " to=functions.f"],
)  # fmt: skip
def test_each_tokens_field_is_the_field_its_text_goes_to(text, size):
    from minfer_jax.files.harmony import TokenChannels

    channels, pieces = TokenChannels(), _tokens(text, size)
    fields = [f for p in pieces for f in channels.feed(p)] + channels.finish()
    assert len(fields) == len(pieces)
    joined = {"content": ""}
    for field, piece in zip(fields, pieces, strict=True):
        if field in ("content", "reasoning_content"):
            joined[field] = joined.get(field, "") + piece
    assert joined == split_channels(text)


def _spelled(entries: list[dict]) -> str:
    """The text of these tokens as the reply renders it (the tiny vocabulary's control fillers
    render as nothing)."""
    kept = [bytes(e["bytes"]) for e in entries if not e["token"].startswith("<|filler_")]
    return b"".join(kept).decode("utf-8", errors="replace")


# an analysis message then the final answer, in harmony's framing (random weights rarely write it)
HARMONY_REPLY = (
    '%llguidance {}\nstart: <|channel|> "analysis" <|message|> /[a-z]{1,6}/ <|end|> <|start|> '
    '"assistant" <|channel|> "final" <|message|> /[a-z ]{1,6}/'
)


def test_harmony_logprobs_cover_the_content_and_reasoning_they_go_with(gptoss):
    """logprobs.content held every generated token (the framing <|channel|>, the analysis
    channel, headers) while content hides them: now content's tokens spell content, the analysis
    channel's go to logprobs.reasoning_content, framing and calls have none; whole and streamed."""
    body = {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 1.0,
        "n": 3, "seed": 2, "logprobs": True, "top_logprobs": 1, "grammar": HARMONY_REPLY,
    }  # fmt: skip
    with _served(gptoss) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        spelled = []
        for c in whole["choices"]:
            lp, message = c["logprobs"], c["message"]
            got = {k: _spelled(lp.get(k, [])) for k in ("content", "reasoning_content")}
            assert got["content"] == (message["content"] or ""), (lp, message)
            assert got["reasoning_content"] == message.get("reasoning_content", ""), (lp, message)
            spelled.append(got)
        assert all(g["reasoning_content"] and g["content"] for g in spelled), spelled

        streamed: dict[int, dict] = {}
        for c in _streamed_choices(http, body):
            got = streamed.setdefault(c["index"], {"content": "", "reasoning_content": ""})
            for k in got:
                got[k] += _spelled((c["logprobs"] or {}).get(k, []))
        assert [streamed[i] for i in range(3)] == spelled
