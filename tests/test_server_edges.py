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


@pytest.mark.parametrize(
    "params, said",
    [
        ({"type": "object", "properties": [1]}, "properties"),
        ({"type": "object", "properties": {"a": True}}, "properties"),
        ({"type": "object", "properties": {"a": {}}, "required": "a"}, "required"),
        ({"type": "object", "required": [1]}, "required"),
    ],
)
def test_parameters_the_call_formats_cannot_read_are_a_400(params, said):
    """Qwen3-Coder's format reads every tool's properties (its string parameters stay text): a
    list there was an AttributeError, a 500, on any request with tools; required as a string
    was read letter by letter."""
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(schemas.BadRequest) as e:
        _chat({"messages": USER, "tools": [tool]})
    assert e.value.param == "tools.0.function.parameters" and said in str(e.value), e.value
    with pytest.raises(schemas.BadRequest) as e:  # the Messages API's tools are the same
        _messages({"tools": [{"name": "f", "input_schema": params}]})
    assert said in str(e.value)
    fine = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert _chat(
        {"messages": USER, "tools": [{**tool, "function": {"name": "f", "parameters": fine}}]}
    )


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


def _metrics(http) -> dict[str, float]:
    from minfer_bench.load_test import server_metrics

    return server_metrics(http.get("/metrics").text)


@pytest.fixture(scope="module")
def llama_tiny():
    """A 2-layer random llama (a placeholder vocabulary, ChatML), which the tests here never
    decode with: their requests end before or at admission, so nothing compiles."""
    from minfer_jax.engine.options import Options

    from minfer_bench.serve import load_model

    return load_model("synthetic:llama-tiny:q8_0", Options(ctx_size=256, kernels="xla"))


def _served(model, **settings):
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    # -s: a request that gives no seed samples one fixed draw (the project's rule for tests)
    settings = {"warmup": False, "seed": 0, **settings}
    app = create_app(ServerSettings(**settings), loader=lambda *a, **k: model)
    return app, TestClient(app, base_url="http://localhost")


def _loaded(app) -> None:
    import time

    while app.state.backend.status == "loading":
        time.sleep(0.01)


def test_a_request_being_prepared_keeps_the_server_from_looking_idle(monkeypatch, llama_tiny):
    """A request whose grammar compiles (or whose prompt tokenizes) was in no gauge: /metrics
    showed an idle server, so a load run's baseline could be read with it unqueued, and it then
    counted as finished but never accepted (a gpt-oss load run: 129 accepted, 130 finished)."""
    import concurrent.futures
    import threading

    from minfer_jax.server import app as app_module

    entered, release = threading.Event(), threading.Event()
    compile_constraint = app_module._constraint

    def held(*args):
        entered.set()
        release.wait(60)
        return compile_constraint(*args)

    monkeypatch.setattr(app_module, "_constraint", held)
    app, client = _served(llama_tiny)
    body = {"prompt": [1, 2, 3], "max_tokens": 0}  # ends before its prefill: nothing compiles
    with client as http:
        _loaded(app)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(http.post, "/v1/completions", json=body)
            assert entered.wait(60)
            busy = _metrics(http)
            release.set()
            assert reply.result().status_code == 200
        idle = _metrics(http)
    assert busy["minfer_requests_preparing"] == 1 and busy["minfer_requests_total"] == 0, busy
    finished = sum(v for k, v in idle.items() if k.startswith("minfer_requests_finished"))
    assert idle["minfer_requests_preparing"] == 0 and idle["minfer_requests_total"] == finished == 1


CUT_CALLS = [
    ("QwenJsonCalls", 'Let me look.<tool_call>\n{"name": "run", "arguments": {"cmd'),
    ("XmlCalls", "Let me look.<tool_call>\n<function=run>\n<parameter=cmd>\nl"),
    ("Llama3JsonCalls", 'Let me look.<|python_tag|>{"name": "run", "parameters": {"c'),
]


@pytest.mark.parametrize("fmt, text", CUT_CALLS)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_call_cut_by_max_tokens_is_no_content(fmt, text, size):
    """A reply cut inside a call (a forced call at a small max_tokens, or a stop string inside
    it) showed the call's framing, '<tool_call>\\n{"name": ...', as its content; a malformed call
    the model ended itself stays content, as llama-server shows it."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server import tools

    call_format = getattr(tools, fmt)()
    for reason in StopReason:
        content = "Let me look." if reason in tools.ENDED_EARLY else text
        assert tools.parse_reply(call_format, text, reason) == (content, [])
        stream = tools.CallStream(call_format)
        shown = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        assert shown + stream.finish(reason)[0] == content
    whole = text + ('": "ls"}}\n</tool_call>' if fmt == "QwenJsonCalls" else "")
    if whole != text:  # a finished call parses, cut or not
        made = tools.parse_reply(call_format, whole, StopReason.LENGTH)[1]
        assert [c.name for c in made] == ["run"]


def test_an_anthropic_reply_cut_inside_a_call_has_no_text_block_of_it():
    from anthropic.lib.streaming._messages import accumulate_event

    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server.anthropic_reply import BlockSplit, EventStream, whole_content
    from minfer_jax.server.tools import QwenJsonCalls

    text = CUT_CALLS[0][1]
    for reason, shown in (
        (StopReason.LENGTH, "Let me look."),
        (StopReason.STOP, "Let me look."),
        (StopReason.EOS, text),
    ):
        blocks, uses = whole_content(BlockSplit(QwenJsonCalls(), None, False, False), text, reason)
        assert blocks == [{"type": "text", "text": shown}] and uses == []
        head = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m"}
        events = EventStream(BlockSplit(QwenJsonCalls(), None, False, False), head)
        sse = [*events.start(9), *events.piece(text), *events.end(text, reason, 9, 12, 0)]
        message = None
        for event in sse:
            data = json.loads(event.split("data: ", 1)[1])
            message = accumulate_event(event=data, current_snapshot=message, json_bufs={})
        assert message is not None and [b.text for b in message.content] == [shown]


@pytest.mark.parametrize("parallel, names", [(True, ["run", "f"]), (False, ["run"])])
def test_parallel_tool_calls_false_keeps_one_call_of_a_free_reply(parallel, names):
    """With tool_choice auto the model is free and may call twice: parallel_tool_calls false
    (Anthropic's disable_parallel_tool_use) returned both calls."""
    import types

    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server import tools

    vocab = types.SimpleNamespace(chat_template="<tool_call>", token_to_id=lambda text: None)
    model = types.SimpleNamespace(tokenizer=vocab)
    two = ('<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')  # fmt: skip
    tool = {"name": "f", "input_schema": {"type": "object"}}
    bodies = [
        _chat({"messages": USER, "tools": [TOOL], "parallel_tool_calls": parallel}),
        _messages({"tools": [tool], "tool_choice": {"type": "auto",
                                                    "disable_parallel_tool_use": not parallel}}),
    ]  # fmt: skip
    for body in bodies:
        fmt, _ = tools.tool_setup(model, body)
        assert fmt is not None
        assert [c.name for c in tools.parse_reply(fmt, two, StopReason.EOS)[1]] == names
        stream = tools.CallStream(fmt)
        assert stream.feed(two) == "" and [c.name for c in stream.finish()[1]] == names


def test_an_anthropic_tool_of_type_custom_is_a_tool():
    """The client's ToolParam may say type "custom" (a tool the client runs: every tool here);
    it was a 400 'unknown field'. Another type (a server tool: web search) is a 400 naming it."""
    tool = {"name": "f", "input_schema": {"type": "object"}}
    chat = _messages({"tools": [{**tool, "type": "custom"}], "tool_choice": {"type": "any"}})
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    with pytest.raises(schemas.BadRequest) as e:
        _messages({"tools": [{**tool, "type": "web_search_20250305"}]})
    assert e.value.param == "tools.0.type"


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:"}}]}]},
         "messages.0.content.1"),
        ({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]},
         "messages.0.content.0"),
    ],
)  # fmt: skip
def test_an_image_or_audio_part_is_a_400_saying_text_only(body, param):
    """It was 'messages.0.content.1.image_url: unknown field': true, but not what is wrong."""
    with pytest.raises(schemas.BadRequest) as e:
        _chat(body)
    assert e.value.param == param and "text-only" in str(e.value)


def test_an_image_in_a_tool_result_or_the_system_is_a_400_saying_text_only():
    """It was '...tool_result.content.0.source: unknown field'."""
    result = {"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}
    for extra, param in (
        ({"messages": [{"role": "user", "content": [result]}]}, "content.0"),
        ({"system": [IMAGE]}, "system.0"),
    ):
        with pytest.raises(schemas.BadRequest) as e:
            _messages(extra)
        assert (e.value.param or "").endswith(param) and "text-only" in str(e.value)


def test_a_cut_bare_json_reply_of_llama_stays_content():
    """Llama 3's bare-JSON calls have no framing: a reply that opens with '{' may be an answer,
    so cut at max_tokens it stays content."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server.tools import Llama3JsonCalls, parse_reply

    text = '{"answer": "a long JSON ans'
    assert parse_reply(Llama3JsonCalls(), text, StopReason.LENGTH) == (text, [])


DEEP = "[" * 100_000  # past json's recursion limit at any setting


@pytest.mark.parametrize(
    "fmt, reply",
    [
        ("QwenJsonCalls", f"<tool_call>{DEEP}</tool_call>"),
        ("Llama3JsonCalls", '{"name": "f", "parameters": ' + DEEP),
        ("MistralCalls", f"[TOOL_CALLS]{DEEP}"),
        ("MistralCalls", f"[TOOL_CALLS]f[ARGS]{DEEP}"),
        ("Gemma4Calls", f"<|tool_call>call:f{{a:{DEEP}}}<tool_call|>"),
        ("HarmonyCalls", f"<|channel|>commentary to=functions.f<|message|>{DEEP}<|call|>"),
    ],
)
def test_a_reply_nested_past_the_json_parser_is_text_not_a_crash(fmt, reply):
    """A model running on with "[[[[..." made json raise RecursionError, not ValueError: a 500
    (or a cut stream) where the reply is no call; the Messages API's tool_use too."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server import tools
    from minfer_jax.server.anthropic_reply import BlockSplit

    calls = getattr(tools, fmt)()
    made = tools.parse_reply(calls, reply, StopReason.EOS)[1]
    # harmony's call keeps its arguments as written (a call message is a call, JSON or not)
    assert [c.name for c in made] == (["f"] if fmt == "HarmonyCalls" else [])
    split = BlockSplit(calls, None, fmt == "HarmonyCalls", show_thinking=False)
    assert split.finish(reply, StopReason.EOS)[1] == []  # no tool_use: its input is no object


def test_a_deepseek_call_of_a_long_line_parses_in_linear_time():
    """A call whose name line runs on in spaces took quadratic time to parse (about 40 s for
    200,000 spaces), on the server's event loop; fenced calls still parse."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server.tools import DeepSeekCalls, parse_reply
    from tests.clock import Stopwatch

    begin, sep, end = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
    )
    clock = Stopwatch()
    assert (
        parse_reply(DeepSeekCalls(), f"{begin}function{sep}f{' ' * 200_000}{end}", StopReason.EOS)[
            1
        ]
        == []
    )
    assert clock.seconds() < 2, clock
    fenced = f'{begin}function{sep}\n f \n\n```json\n{{"a": 1}}\n``` {end}'
    (call,) = parse_reply(DeepSeekCalls(), fenced, StopReason.EOS)[1]
    assert (call.name, json.loads(call.arguments)) == ("f", {"a": 1})


def test_a_clients_call_arguments_nested_past_the_json_parser_stay_text():
    """The history's call arguments are read as JSON for the template: "[[[[..." from a client
    was a RecursionError, a 500."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    body = _chat({"messages": [*USER, turn]})
    rendered = body.messages[1].as_template_message()["tool_calls"][0]["function"]
    assert rendered["arguments"] == DEEP


def test_a_llama_json_answer_with_a_name_field_is_no_call():
    """Llama 3's calls are bare JSON: any JSON object with a "name" was read as a call (a JSON
    answer {"name": "Bob", "age": 3}, with tools offered, came back as a call to "Bob")."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server.tools import Llama3JsonCalls, parse_reply

    answer = '{"name": "Bob", "age": 3}'
    assert parse_reply(Llama3JsonCalls(), answer, StopReason.EOS) == (answer, [])
    call = '{"name": "run", "parameters": {"cmd": "ls"}}'
    (made,) = parse_reply(Llama3JsonCalls(), call, StopReason.EOS)[1]
    assert (made.name, json.loads(made.arguments)) == ("run", {"cmd": "ls"})


def test_a_messages_request_ended_by_shutdown_is_a_503_in_anthropics_shape(llama_tiny):
    """A non-streamed Messages request that the shutdown ended (queued when the server went
    down) answered 400 invalid_request_error; the chat path says 503, so does this now."""
    import concurrent.futures
    import time

    from minfer_jax.server.backend import ShuttingDown

    app, client = _served(llama_tiny)
    body = {"model": "m", "max_tokens": 4, "messages": USER}
    with client as http:
        _loaded(app)
        backend = app.state.backend
        backend.stop.set()  # the loop stops: the request stays queued, as behind a busy slot
        for thread in backend.threads:
            thread.join(10)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(http.post, "/v1/messages", json=body)
            deadline = time.monotonic() + 60
            while backend.live == 0:  # until it is queued
                assert time.monotonic() < deadline and not reply.done(), reply.result().text
                time.sleep(0.01)
            backend.scheduler.fail_pending(ShuttingDown())  # what Backend.close does
            r = reply.result(60)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "overloaded_error" and "shutting down" in r.text


def test_count_tokens_counts_a_prompt_past_the_context(llama_tiny):
    """count_tokens said 400 'the prompt is at least N tokens but the context holds 256': an
    agent that counts to decide what to trim learnt no count. The Messages call stays a 400."""
    app, client = _served(llama_tiny)
    long = {"model": "m", "messages": [{"role": "user", "content": "word " * 300}]}
    with client as http:
        _loaded(app)
        counted = http.post("/v1/messages/count_tokens", json=long)
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > app.state.backend.scheduler.plan.ctx
        refused = http.post("/v1/messages", json={**long, "max_tokens": 4})
    assert refused.status_code == 400 and "context" in refused.text


def test_a_strict_function_under_auto_gets_the_lazy_grammar_or_a_logged_warning(caplog):
    """strict: true under tool_choice auto was accepted and not enforced: now its calls are held
    to the schema once the opener token comes (test_constrained.py shows the grammar); Llama 3's
    bare JSON calls and gpt-oss's harmony messages, which open with no token to wait for, by a
    grammar of the whole reply (test_strict_under_auto.py); harmony in a vocabulary without its
    framing tokens, and an opener that is no token, are served (agent SDKs send strict by
    default) with a warning in the server's log."""
    from minfer_jax.server import tools

    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    for tool, wanted in ((TOOL, []), (strict, ["tools"])):
        body = _chat({"messages": USER, "tools": [tool]})
        asked = tools.tool_constraint(tools.QwenJsonCalls(opener_id=7), body, [])
        assert [field for field, _ in asked] == wanted
        if wanted:
            assert "free_text: <[^7]>*" in asked[0][1]["grammar"]
    body = _chat({"messages": USER, "tools": [strict]})
    for fmt, part in (
        (tools.HarmonyCalls(marker_ids=tuple(range(7))), "body: <[^0,1,2,3,4,5,6]>*"),
        (tools.Llama3JsonCalls(opener_id=7), "answer <[7]> call"),
        (tools.Llama3JsonCalls(), "start: answer | WS? call\n"),
        (tools.Llama3JsonCalls(), '"name": {"const": "f"}'),
        (tools.HarmonyCalls(marker_ids=tuple(range(7))), '"commentary to=functions.f "'),
    ):
        caplog.clear()
        ((field, keywords),) = tools.tool_constraint(fmt, body, [])
        assert field == "tools" and part in keywords["grammar"] and not caplog.text
    for fmt in (tools.HarmonyCalls(), tools.QwenJsonCalls()):
        caplog.clear()
        assert tools.tool_constraint(fmt, body, []) == []
        assert "not held to their schemas" in caplog.text and type(fmt).__name__ in caplog.text
    forced = _chat({"messages": USER, "tools": [strict], "tool_choice": "required"})
    assert tools.tool_constraint(tools.HarmonyCalls(), forced, [])[0][0] == "tool_choice"
