"""Strict functions under tool_choice auto where calls open with no token to wait for: a grammar of
the whole reply (llama.cpp's lazy grammars trigger on text here). gpt-oss (harmony): a message
addressed to a function only in the forced call's form, valid against the function's schema, every
other message's body free. Llama 3.x: a reply opening with `{"name"` (or after <|python_tag|>) is a
valid call, any other is free."""

from __future__ import annotations

import numpy as np
import pytest

from minfer_jax.engine.grammar import Grammars, GrammarSpec
from minfer_jax.files.harmony import MARKERS as HARMONY_MARKERS
from minfer_jax.files.tokenizer import Tokenizer
from minfer_jax.server.tools import HarmonyCalls, Llama3JsonCalls
from tests.test_constrained import first_refused
from tests.test_harmony_tools import CALL_TEXT, WEATHER, _valid, gptoss  # noqa: F401

ANALYSIS_THEN_FINAL = (
    "<|channel|>analysis<|message|>Think it over: to= <b> {x}.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny, 21 C."
)


def _refused_at(model, grammar: str, text: str) -> int | None:
    """The index of the first token of text the grammar refuses (None: all taken)."""
    constraint = model.constraint(grammar=grammar)
    return first_refused(constraint, model.tokenizer.encode(text, add_special=False))


@pytest.fixture(scope="module")
def grammar(gptoss):  # noqa: F811
    ids = tuple(gptoss.tokenizer.token_to_id(m) for m in HARMONY_MARKERS)
    return HarmonyCalls(marker_ids=ids).whole_reply_grammar([WEATHER])


def test_the_whole_reply_grammar_takes_harmony_replies_and_refuses_a_bad_call(gptoss, grammar):  # noqa: F811
    assert _refused_at(gptoss, grammar, ANALYSIS_THEN_FINAL) is None
    assert _refused_at(gptoss, grammar, "<|channel|>final<|message|>Sunny.") is None
    call = CALL_TEXT.replace('{"city": "Paris", "unit": "c"}', '{"city":"Paris","unit":"c"}')
    assert _refused_at(gptoss, grammar, call + "<|call|>") is None
    ids = gptoss.tokenizer.encode(call, add_special=False)
    bad = call.replace('"c"', '"kelvin"')  # refused inside the arguments, not before
    at = _refused_at(gptoss, grammar, bad)
    assert at is not None and at > ids.index(gptoss.tokenizer.token_to_id("<|constrain|>")), at
    # a recipient only in a call's own header (a free message's header holds no `to=`)
    for header in ("commentary to=functions.get_weather", "analysis to=x"):
        assert _refused_at(gptoss, grammar, f"<|channel|>{header}<|message|>{{}}") is not None
    # no other function, no framing token in a body
    assert _refused_at(gptoss, grammar, call.replace("get_weather", "get_time")) is not None
    assert _refused_at(gptoss, grammar, "<|channel|>final<|message|>a<|channel|>b") is not None


def _allowed(constraint, vocab: int):
    row = np.zeros((-(-vocab // 32),), np.int32)
    constraint.fill(row)
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def test_every_call_the_grammar_lets_through_validates(gptoss, grammar):  # noqa: F811
    """A seeded random walk over the tokens the grammar allows, from the call's header on: it
    ends at <|call|> with arguments valid against the schema (no model needed to draw them)."""
    rng = np.random.default_rng(0)
    header = CALL_TEXT.split('{"city"')[0]
    end = gptoss.tokenizer.token_to_id("<|call|>")
    for _ in range(3):
        constraint = gptoss.constraint(grammar=grammar)
        ids = gptoss.tokenizer.encode(header, add_special=False)
        for token in ids:
            constraint.advance(token)
        while ids[-1] != end and len(ids) < 400:
            ids.append(int(rng.choice(_allowed(constraint, gptoss.config.vocab_size))))
            constraint.advance(ids[-1])
        text = gptoss.tokenizer.decode(ids)
        assert ids[-1] == end and constraint.finished, text
        _, calls = HarmonyCalls().parse(text)
        assert [c.name for c in calls] == ["get_weather"], text
        _valid(calls[0].arguments)


def test_a_strict_function_under_auto_on_gpt_oss_through_the_server(gptoss, caplog):  # noqa: F811
    """tool_choice auto with a strict function on gpt-oss-tiny (seeded): served under the whole
    reply's grammar (no warning logged; the same draw without strict differs), the reply parses
    (no harmony framing in its text) and any call validates."""
    import openai
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    app = create_app(ServerSettings(warmup=False, seed=11), loader=lambda *args, **kwargs: gptoss)
    replies = []
    with TestClient(app, base_url="http://localhost") as http:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        for strict in (True, False):
            tools = [{"type": "function", "function": {**WEATHER, "strict": strict}}]
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                max_tokens=12, logprobs=True,
            )  # fmt: skip
            replies.append(reply.choices[0])
    assert "not held to their schemas" not in caplog.text
    held, free = replies
    assert held.model_dump() != free.model_dump(), held
    for field in ("content", "reasoning_content"):
        text = getattr(held.message, field, None) or ""
        assert not any(marker in text for marker in HARMONY_MARKERS), text
    for call in held.message.tool_calls or []:
        assert call.function.name == "get_weather"
        _valid(call.function.arguments)


# -- Llama 3.x: bare JSON calls ------------------------------------------------------------------
def test_the_llama3_reply_grammar_holds_a_call_and_frees_any_other_reply():
    """A tokenizer alone (the byte alphabet and Llama 3's control tokens): answers, JSON answers
    and whitespace pass; a call, at the start or after <|python_tag|>, passes only valid."""
    from tests.test_tokenizer import _byte_level_alphabet

    alphabet = _byte_level_alphabet()
    tokens = [*alphabet, "<|begin_of_text|>", "<|eot_id|>", "<|python_tag|>", "<|eom_id|>"]
    tokenizer = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(alphabet) + [3] * 4,
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.bos_token_id": tokens.index("<|begin_of_text|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|eot_id|>"),
            "tokenizer.ggml.add_bos_token": False,
        }
    )
    fmt = Llama3JsonCalls(opener_id=tokenizer.token_to_id("<|python_tag|>"))
    spec = GrammarSpec.grammar(fmt.whole_reply_grammar([WEATHER]))
    grammars = Grammars(tokenizer, len(tokens))

    def refused_at(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special=False)
        return first_refused(grammars.compile(spec), ids)

    call = '{"name":"get_weather","parameters":{"city":"Oslo","unit":"c"}}'
    for text in ("Sure, sunny.", '{"answer": 3}', "  {}", " ", "", call, " \n" + call,
                 "Let me see.<|python_tag|>" + call, 'Not {"name": here}'):  # fmt: skip
        assert refused_at(text) is None, text
    bad = call.replace('"c"', '"kelvin"')
    for text in (bad, " " + bad, "Hm.<|python_tag|>" + bad, '{"name": "get_weather"}'):
        at = refused_at(text)
        assert at is not None and at >= len(tokenizer.encode(text.split('"name"')[0])), text
    assert refused_at(call.replace("get_weather", "get_time")) is not None
