"""gpt-oss's harmony format: the chat template the files carry renders in our sandbox, the
vocabulary's end tokens follow llama.cpp, and the output's channels split into the answer and the
reasoning, streamed in any pieces."""

from pathlib import Path

import pytest

from minfer_jax.files.chat_template import render_chat_template
from minfer_jax.files.harmony import HarmonyStream, split_channels
from minfer_jax.files.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).parent / "data" / "gpt-oss-chat-template.jinja").read_text("utf-8")

REPLY = (
    "<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
)


def test_template_renders_a_conversation():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "greet back"},
        {"role": "user", "content": "2+2?"},
    ]
    text = render_chat_template(TEMPLATE, messages, add_generation_prompt=True)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "<|start|>user<|message|>hi<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert text.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    effort = render_chat_template(
        TEMPLATE, messages[1:2], add_generation_prompt=True, reasoning_effort="high"
    )
    assert "Reasoning: high" in effort


def test_template_renders_tools():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    text = render_chat_template(
        TEMPLATE, [{"role": "user", "content": "Paris?"}], add_generation_prompt=True, tools=tools
    )
    assert "namespace functions" in text and "type get_weather = (_: {" in text


def test_split_channels():
    assert split_channels(REPLY) == {
        "content": "2 + 2 = 4.",
        "reasoning_content": "The user asks 2+2. Easy.",
    }
    assert split_channels("plain text, no header") == {"content": "plain text, no header"}
    assert split_channels("<|") == {"content": "<|"}  # too short for a marker: text
    assert split_channels("<|channel|>final<|message|>only") == {"content": "only"}
    assert split_channels("<|channel|>analysis<|message|>cut off") == {
        "content": "",
        "reasoning_content": "cut off",
    }
    tool = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}"
    assert split_channels(tool) == {"content": ""}  # a call: parsed by server/tools.py


@pytest.mark.parametrize(
    "text, fields",
    [
        ("ab<|constrain|>", {"content": "ab"}),  # what a random gpt-oss-tiny wrote, cut off
        ("ab<|channel|>analysis<|message|>cd", {"content": "ab", "reasoning_content": "cd"}),
        ("<|channel|>final<|message|>ab<|start|>assistant<|channel|>final<|message|>cd",
         {"content": "abcd"}),
        ("ab<|message|>cd", {"content": "abcd"}),
        # a reply that opens a header it never finishes (cut off, or a random gpt-oss-tiny's
        # '<|constrain|>' first: an unseeded CI reply showed it)
        ("<|constrain|>\x02ab", {"content": ""}),
        ("<|channel|>final", {"content": ""}),
        ("<|end|>ab", {"content": ""}),
    ],
)  # fmt: skip
def test_a_header_marker_inside_a_body_opens_a_header(text, fields):
    """A model that skips <|end|> still never shows a marker: the marker ends the body."""
    assert split_channels(text) == fields
    for size in (1, 2, 3):
        stream = HarmonyStream()
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])]
        pieces += stream.finish()
        assert all("<|" not in piece for _, piece in pieces), pieces
        assert "".join(p for f, p in pieces if f == "content") == fields["content"]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_stream_in_any_pieces(size):
    stream = HarmonyStream()
    pieces = []
    for i in range(0, len(REPLY), size):
        pieces += stream.feed(REPLY[i : i + size])
    pieces += stream.finish()
    joined: dict[str, str] = {}
    for field, text in pieces:
        assert "<|" not in text and text
        joined[field] = joined.get(field, "") + text
    assert joined == split_channels(REPLY)
    fields = [f for f, _ in pieces]
    assert fields == sorted(fields, key=lambda f: f == "content")  # reasoning first, then answer


def test_harmony_vocabulary_end_tokens_and_rendered_framing():
    """llama.cpp's o200k_harmony rules: <|return|> and <|call|> end the turn, <|end|> does not,
    and the framing tokens are not skipped as control tokens."""
    from tests.test_tokenizer import _byte_level_alphabet

    special = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    alphabet = _byte_level_alphabet()
    tokens = [*alphabet, *special]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(alphabet) + [3] * len(special),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
        "tokenizer.ggml.eot_token_id": tokens.index("<|end|>"),
    }
    tok = Tokenizer.from_metadata(meta)
    assert {tok.id_to_token(i) for i in tok.eos_ids} == {"<|return|>", "<|call|>"}
    ids = tok.encode(REPLY + "<|return|>", add_special=False)
    assert tok.decode(ids, skip_special=True) == REPLY  # framing kept, <|return|> skipped


def test_chat_reply_fields():
    """The server's chat replies of a harmony model: the final channel as content, analysis as
    reasoning_content, streamed or whole; the completions endpoint and other models unchanged."""
    from minfer_jax.engine.steps import StopReason
    from minfer_jax.server.openai_format import Reply

    whole = Reply("chat", "m", harmony=True).full(REPLY, StopReason.EOS, 5, 9)
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "2 + 2 = 4.",
        "reasoning_content": "The user asks 2+2. Easy.",
    }
    reply = Reply("chat", "m", harmony=True)
    deltas = [reply.chunk(t, field=f)["choices"][0]["delta"] for f, t in reply.deltas(REPLY[:20])]
    deltas += [reply.chunk(t, field=f)["choices"][0]["delta"] for f, t in reply.deltas(REPLY[20:])]
    deltas += [reply.chunk(t, field=f)["choices"][0]["delta"] for f, t in reply.deltas(None)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks 2+2. Easy."
    assert "".join(d.get("content", "") for d in deltas) == "2 + 2 = 4."
    plain = Reply("chat", "m").full(REPLY, StopReason.EOS, 5, 9)
    assert plain["choices"][0]["message"]["content"] == REPLY
    assert Reply("text", "m", harmony=True).deltas(REPLY) == [("content", REPLY)]


def test_cli_chat_shows_the_answer_and_sends_reasoning_to_stderr():
    import io

    from minfer_jax.cli.chat import _Session

    out, err = io.StringIO(), io.StringIO()
    session = _Session(
        model=None,
        sampler=None,
        seed=0,
        max_len=64,
        n_predict=8,
        stop=(),
        stream=True,
        out=out,
        err=err,
        verbose=False,
        channels=HarmonyStream(),
    )
    for i in range(0, len(REPLY), 6):
        session._on_text(REPLY[i : i + 6])
    for field, text in session.channels.finish():
        session._show(field, text)
    assert out.getvalue() == "".join(session.partial) == "2 + 2 = 4."
    assert err.getvalue() == "The user asks 2+2. Easy."
    assert session.answer(REPLY) == "2 + 2 = 4."
