"""Fuzz: the server's request parser, its limits and access checks, and prompt encoding under a
limit.

In-process, no server: `schemas.parse` (with limits.py's JSON checks) on generated and mutated
bodies must return a request whose fields are in range or raise one BadRequest (a 4xx), never
anything else; `AccessPolicy.refusal` must answer every header set; `prompts.encode_within` must
give exactly `Tokenizer.encode` for a prompt that fits and refuse only prompts that do not, and
`count_at_least` must never count more tokens than the whole text has. CI runs a fixed
derandomized set; MINFER_FUZZ_EXAMPLES=5000 runs a long random one.
"""

from __future__ import annotations

import json
import math
import unicodedata

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import fuzz_settings
from minfer_jax import validate
from minfer_jax.server.guards import AccessPolicy
from minfer_jax.server.limits import LimitsError, RequestLimits
from minfer_jax.server.schemas import (
    SEED_MAX,
    UNSUPPORTED,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)

CTX = 512
LIMITS = RequestLimits(max_messages=8).for_model(CTX, 128)
HOSTILE = st.sampled_from(
    [
        math.nan,
        math.inf,
        -1,
        -2,
        0,
        0.0,
        -0.0,
        1,
        1.0,
        0.5,
        2**31,
        2**63,
        2**64,
        10**30,
        True,
        False,
        None,
        "",
        "3",
        "\ud800",
        [],
        {},
        [1],
        {"a": 1},
        "x" * 300,
        1e308,
    ]
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "tools",
    "model",
    "echo",
    "suffix",
]
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "robot", 3]),
        "content": st.one_of(
            st.text(max_size=20),
            HOSTILE,
            st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["text", "image"]),
                        "text": st.one_of(st.text(max_size=10), HOSTILE),
                    }
                ),
                max_size=3,
            ),
        ),
    }
)
BASE = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
VALID = {  # in-range values, so that many bodies are accepted and their fields checked
    "max_tokens": st.integers(-1, 10**20),
    "max_completion_tokens": st.integers(-1, 10**6),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 10**15),
    "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0.1, 10),
    "repeat_last_n": st.integers(-1, 10**12),
    "seed": st.integers(-1, SEED_MAX),
    "stop": st.lists(st.text(max_size=5), max_size=4),
    "stream": st.booleans(),
    "n": st.just(1),
    "frequency_penalty": st.sampled_from([0, 0.0, None]),
    "logprobs": st.sampled_from([None, 0]),
    "prompt": st.one_of(
        st.text(max_size=40), st.lists(st.integers(0, 151935), min_size=1, max_size=20)
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}
        ),
        min_size=1,
        max_size=8,
    ),
}


@st.composite
def bodies(draw, chat: bool = False) -> bytes:
    # the other endpoint's body field is an unknown field here (a 400 naming it)
    body = {k: v for k, v in BASE.items() if k == ("messages" if chat else "prompt")}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        hostile = st.one_of(
            HOSTILE,
            JSON_VALUES,
            st.lists(MESSAGE, max_size=10),
            st.lists(st.integers(-5, 2**40), max_size=CTX + 5),
        )
        valid = (
            name in VALID and draw(st.integers(0, 3)) < 3
        )  # a quarter of the fields hostile (0 is drawn most)
        body[name] = draw(VALID[name] if valid else hostile)
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=1, unique=True)):
        body.pop(name, None)
    raw = json.dumps(body, allow_nan=True).encode()
    if draw(st.integers(0, 9)) == 9:  # a truncated or mangled body now and then
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=8))
    return raw


def _check_accepted(kind, req) -> None:
    assert 0.0 <= req.temperature <= 2.0 and 0.0 < req.top_p <= 1.0 and 0.0 <= req.min_p <= 1.0
    assert req.top_k >= 0 and req.repeat_last_n >= -1 and 0 < req.repeat_penalty <= 10
    assert req.max_tokens is None or req.max_tokens >= -1
    assert req.seed is None or -1 <= req.seed <= SEED_MAX
    assert len(req.stops) <= validate.MAX_STOP_STRINGS and all(
        len(s) <= validate.MAX_STOP_CHARS for s in req.stops
    )
    for s in req.stops:
        s.encode("utf-8")
    if kind is CompletionRequest:
        prompt = req.prompt
        assert (
            isinstance(prompt, str)
            and len(prompt) <= LIMITS.max_prompt_chars
            or (
                isinstance(prompt, list)
                and 1 <= len(prompt) < CTX
                and all(type(t) is int for t in prompt)
            )
        )
    else:
        assert 1 <= len(req.messages) <= LIMITS.max_messages
        for m in req.messages:
            m.as_template_message()["content"].encode("utf-8")


@fuzz_settings(400)
@given(case=st.booleans().flatmap(lambda chat: st.tuples(st.just(chat), bodies(chat))))
def test_fuzz_parse(case):
    chat, raw = case
    kind = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = parse(kind, raw, lambda data: LIMITS.check_json(data, CTX))
    except BadRequest as e:
        assert 400 <= e.status < 500 and str(e)
        assert e.param is None or isinstance(e.param, str)
        event(f"refused: {e.param}")
        return
    event("accepted")
    _check_accepted(kind, req)


@fuzz_settings(200)
@given(raw=st.binary(max_size=64))
def test_fuzz_parse_raw_bytes(raw):
    try:
        parse(CompletionRequest, raw)
    except BadRequest:
        pass


def test_null_is_the_default():
    """The openai client sends null for a setting passed as None (temperature=None); OpenAI and
    llama-server read it as the default, and so must the server: a required field stays
    required."""

    def nulls(kind) -> dict:  # every optional field of the body and every unsupported setting
        optional = [f.alias or name for name, f in kind.model_fields.items() if not f.is_required()]
        return dict.fromkeys([*optional, *UNSUPPORTED])

    text = parse(
        CompletionRequest, json.dumps({"prompt": "hi", **nulls(CompletionRequest)}).encode()
    )
    assert text == CompletionRequest(prompt="hi")
    messages = [{"role": "user", "content": "hi"}]
    raw = json.dumps({"messages": messages, **nulls(ChatCompletionRequest)}).encode()
    assert parse(ChatCompletionRequest, raw) == ChatCompletionRequest(messages=messages)
    for kind, raw, param in (
        (CompletionRequest, b'{"prompt": null}', "prompt"),
        (ChatCompletionRequest, b'{"messages": null}', "messages"),
    ):
        with pytest.raises(BadRequest) as refused:
            parse(kind, raw)
        assert refused.value.param == param


def test_legacy_function_calling_is_refused_like_tools():
    """`functions` and `function_call` are the deprecated spelling of `tools` and `tool_choice`:
    refused, not silently ignored (a client would wait for a call that never comes)."""
    messages = [{"role": "user", "content": "hi"}]
    for field, value in (
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
    ):
        with pytest.raises(BadRequest, match="not supported") as refused:
            parse(ChatCompletionRequest, json.dumps({"messages": messages, field: value}).encode())
        assert refused.value.param == field
    no_op = {"messages": messages, "functions": [], "function_call": "none"}
    assert parse(ChatCompletionRequest, json.dumps(no_op).encode()).messages


def test_deep_and_wide_json_is_a_clean_400():
    for raw in (
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ):
        with pytest.raises(BadRequest, match="nested too deeply|not valid JSON"):
            parse(CompletionRequest, raw)
    with pytest.raises(BadRequest, match="--max-messages"):
        parse(
            ChatCompletionRequest,
            json.dumps({"messages": [{}] * 9}).encode(),
            lambda d: LIMITS.check_json(d, CTX),
        )


HEADER_VALUES = st.one_of(
    st.sampled_from(
        [
            "localhost",
            "127.0.0.1:8080",
            "[::1]:1",
            "evil.example",
            "",
            "null",
            "http://localhost:3000",
            "https://evil.example",
            "[",
            "a:b:c",
            ":",
            "application/json",
            "text/plain",
            "APPLICATION/JSON; charset=x",
        ]
    ),
    st.text(max_size=30),
)


@fuzz_settings(300)
@given(
    headers=st.dictionaries(st.sampled_from(["host", "origin", "content-type"]), HEADER_VALUES),
    method=st.sampled_from(["GET", "POST", "PUT", "OPTIONS"]),
    key=st.booleans(),
    extra=st.lists(st.sampled_from(["*", "lan.example", "", "10.0.0.2"]), max_size=2),
)
def test_fuzz_access_policy(headers, method, key, extra):
    policy = AccessPolicy.build(
        api_key="k" if key else None, listen_host="127.0.0.1", extra_hosts=extra
    )
    refused = policy.refusal(method, headers)
    if refused is None:
        return
    status, message, kind = refused
    assert status in (403, 415) and message and kind
    if key:
        assert status == 415  # with an API key only the content type is checked


def test_access_policy_names():
    local = AccessPolicy.build(api_key=None, listen_host="127.0.0.1")
    assert local.refusal("GET", {"host": "localhost:8080"}) is None
    assert local.refusal("GET", {"host": "evil.example"})[0] == 403
    lan = AccessPolicy.build(api_key=None, listen_host="192.168.1.5", extra_hosts=["My-Box."])
    assert (
        lan.refusal("GET", {"host": "192.168.1.5:8080"}) is None
        and lan.refusal("GET", {"host": "my-box"}) is None
    )
    anywhere = AccessPolicy.build(api_key=None, listen_host="0.0.0.0")
    assert (
        anywhere.refusal("GET", {"host": "0.0.0.0:8080"})[0] == 403
    )  # a wildcard address names no one host
    assert (
        AccessPolicy.build(api_key=None, listen_host="::", extra_hosts=["*"]).refusal(
            "GET", {"host": "x", "origin": "https://y"}
        )
        is None
    )
    keyed = AccessPolicy.build(api_key="k", listen_host="0.0.0.0", any_content_type=True)
    assert keyed.refusal("POST", {"host": "x", "content-type": "text/plain"}) is None


def test_request_limits_defaults_and_flags():
    resolved = RequestLimits().for_model(4096, 128)
    assert resolved.max_prompt_chars == 4096 * 128 and resolved.max_body_bytes == 8 * 4096 * 128
    assert RequestLimits().for_model(16, 4).max_body_bytes == 1 << 20  # never less than 1 MiB
    assert RequestLimits(max_body_bytes=5, max_prompt_chars=7).for_model(
        4096, 128
    ) == RequestLimits(max_body_bytes=5, max_prompt_chars=7)
    for bad in (
        {"max_body_bytes": -1},
        {"max_prompt_chars": 1.5},
        {"max_messages": 0},
        {"max_messages": True},
    ):
        with pytest.raises(LimitsError, match=next(iter(bad)).replace("_", "-")):
            RequestLimits(**bad)


# -- prompt encoding under a limit (the real tokenizer) --------------------------------------------
@pytest.fixture(scope="module")
def tok(real_model):
    from minfer_jax.files.tokenizer import Tokenizer

    return Tokenizer.from_model(real_model)


PROMPT_TEXT = st.lists(
    st.sampled_from(
        list("ab é\n\t<|>_")
        + ["<|im_start|>", "<|im_end|>", "<tool_call>", "hello", "  ", "\ufdd0", "e\u0301"]
    ),
    max_size=30,
).map("".join)


@pytest.mark.real_model
@fuzz_settings(300)
@given(
    text=st.lists(PROMPT_TEXT, max_size=6).map("".join),
    limit=st.integers(1, 60),
    literal=st.booleans(),
)
def test_fuzz_encode_within(tok, text, limit, literal):
    from minfer_jax.files.prompts import PromptTooLong, encode_within

    whole = tok.encode(text, parse_special=not literal)
    for n in range(0, len(text) + 1, 5):
        assert tok.count_at_least(text[:n], parse_special=not literal) <= len(whole)
    try:
        ids = encode_within(tok, text, limit, parse_special=not literal)
    except PromptTooLong as e:
        assert len(whole) > limit and e.tokens <= len(whole)
        return
    assert ids == whole and len(ids) <= limit


@pytest.mark.real_model
@pytest.mark.parametrize("literal", [True, False])
def test_chat_too_long_counts_against_the_whole_limit(tok, literal):
    from minfer_jax.files.prompts import PromptTooLong, encode_chat

    messages = [{"role": "user", "content": "the quick brown fox jumps. " * 2000}]
    whole = encode_chat(tok, messages, 100_000, literal=literal)
    with pytest.raises(PromptTooLong) as caught:
        encode_chat(tok, messages, 100, literal=literal)
    # the template's tokens before the content count too: the error names the context asked for
    assert caught.value.limit == 100 and 100 < caught.value.tokens <= len(whole)
    assert "the context holds 101" in str(caught.value)


@pytest.mark.real_model
@fuzz_settings(150)
@given(contents=st.lists(PROMPT_TEXT, min_size=1, max_size=4))
def test_fuzz_literal_chat_content(tok, contents):
    from minfer_jax.files.prompts import encode_chat

    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    literal = encode_chat(tok, messages, 10_000, literal=True)
    assert tok.decode(literal) == unicodedata.normalize(
        "NFC", tok.apply_chat_template(messages)
    )  # the same text
    if not any(t in c for c in contents for t in ("<|im_start|>", "<|im_end|>")):
        assert literal == encode_chat(tok, messages, 10_000, literal=False)
    template_turns = (
        len(messages) + 2
    )  # the default system message, each message, the generation prompt
    assert literal.count(tok.token_to_id("<|im_start|>")) == template_turns
