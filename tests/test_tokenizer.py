"""Tokenizer: exact ids against llama.cpp's qwen2 vectors, the classic BPE pitfalls, streaming.

Real-model tests use the GGUF's own vocabulary; the synthetic-vocabulary tests cover
metadata handling (errors, BOS, DeepSeek-style specials, other pre-tokenizer names) without it.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minfer_jax.errors import GGUFError, UnsupportedError
from minfer_jax.files.tokenizer import Tokenizer
from tests.clock import Stopwatch
from tests.cut_vocab import cut_vocab_meta, vocab_vectors
from tests.fuzz_support import fuzz_settings

DATA = Path(__file__).parent / "data" / "tokenizer"
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643


def _llama_cpp_vectors() -> list[tuple[str, list[int]]]:
    """(text, ids) pairs from llama.cpp's ggml-vocab-qwen2.gguf.inp/.out (see data README)."""
    texts = (
        (DATA / "ggml-vocab-qwen2.gguf.inp")
        .read_text(encoding="utf-8")
        .split("\n__ggml_vocab_test__\n")
    )
    lines = (DATA / "ggml-vocab-qwen2.gguf.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == ""
    return [
        (t, [int(x) for x in line.split()]) for t, line in zip(texts[:-1], lines[:-1], strict=True)
    ]


VECTORS = _llama_cpp_vectors()

# text -> pre-tokens of the Qwen2 split regex, worked out by hand from the regex alternatives.
PRE_TOKENS = {
    "12345": ["1", "2", "3", "4", "5"],  # \p{N}: one digit per piece
    "He'S": ["He", "'S"],  # contractions are case-insensitive
    "don't": ["don", "'t"],
    "they're I've I'm we'll he'd": [
        "they",
        "'re",
        " I",
        "'ve",
        " I",
        "'m",
        " we",
        "'ll",
        " he",
        "'d",
    ],
    "'RE": ["'RE"],
    "\n\n\n": ["\n\n\n"],  # \s*[\r\n]+ keeps a newline run together
    "   leading": ["  ", " leading"],  # \s+(?!\S) leaves one space for the word
    "trailing   ": ["trailing", "   "],
    "a\tb\t\tc": ["a", "\tb", "\t", "\tc"],  # a tab may lead a word like a space
    "x  \n  y": ["x", "  \n", " ", " y"],
    "line1\r\nline2": ["line", "1", "\r\n", "line", "2"],
    "<|im_start": ["<|", "im", "_start"],  # not the special token: plain punctuation + words
    "你好世界": ["你好世界"],
    "😁🦙 ok": ["😁🦙", " ok"],
}

ROUNDTRIP = [
    *PRE_TOKENS,
    "",
    " ",
    "\t",
    "\n",
    "Hello world",
    "  Hello",
    "😶\u200d🌫\ufe0f",
    "ü",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<tool_call>\n{}\n</tool_call>",
    "a\x00b\x7f",
    "def f(x):\n    return x**2  # 平方\n",
]


@pytest.fixture(scope="module")
def tok(real_model) -> Tokenizer:
    return Tokenizer.from_metadata(real_model.metadata, source=real_model.path)


def test_build_time_of_real_tokenizer(real_model):
    """151,936 tokens + 151,387 merges must not stall model loading."""
    clock = Stopwatch()  # the CPU time too: a busy CI core stretches the wall clock only
    Tokenizer.from_metadata(real_model.metadata)
    assert clock.seconds() < 2.0, f"building the tokenizer took {clock}"


@pytest.mark.parametrize(("text", "expected"), VECTORS, ids=[repr(t)[:40] for t, _ in VECTORS])
def test_matches_llama_cpp_reference_ids(tok, text, expected):
    ids = tok.encode(text)
    assert ids == expected
    assert tok.decode(ids) == text


def test_decode_matches_tokenizers_bytelevel_decoder(tok):
    """Our byte table agrees with the tokenizers ByteLevel decoder on valid byte-level text."""
    for text, ids in VECTORS:
        assert tok.decode(ids) == tok._backend.decode(ids) == text


@pytest.mark.parametrize(("text", "pieces"), PRE_TOKENS.items(), ids=[repr(t) for t in PRE_TOKENS])
def test_tokens_never_cross_pretoken_boundaries(tok, text, pieces):
    """Each token lies inside one regex piece: the split is what the model was trained on."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    token_ends = _cumulative([len(tok.token_bytes([i])) for i in ids])
    piece_ends = _cumulative([len(p.encode("utf-8")) for p in pieces])
    assert set(piece_ends) <= set(token_ends), [tok.id_to_token(i) for i in ids]


def _cumulative(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def test_digits_are_single_tokens(tok):
    assert [tok.id_to_token(i) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]
    assert tok.encode("333333333") == [18] * 9


@pytest.mark.parametrize(
    ("text", "spelled"),
    [
        ("He'S", ["He", "'S"]),
        ("I'll", ["I", "'ll"]),
        ("'RE", ["'RE"]),
        ("don't", ["don", "'t"]),
        ("\n\n\n", ["ĊĊĊ"]),
        ("   leading", ["ĠĠ", "Ġleading"]),
        ("\t\tx", ["ĉ", "ĉx"]),
    ],
)
def test_spelled_tokens(tok, text, spelled):
    assert [tok.id_to_token(i) for i in tok.encode(text)] == spelled


def test_trailing_spaces_stay_one_token(tok):
    ids = tok.encode("trailing   ")
    assert tok.id_to_token(ids[-1]) == "ĠĠĠ"
    assert tok.decode(ids[:-1]) == "trailing"


def test_special_tokens_inside_text(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert [tok.id_to_token(i) for i in ids[1:-1]] == ["user", "Ċ", "hi"]
    assert IM_START not in tok.encode("<|im_start")
    assert tok.encode("<tool_call>") == [tok.token_to_id("<tool_call>")]


def test_empty_string(tok):
    assert tok.encode("") == []
    assert tok.decode([]) == ""


@pytest.mark.parametrize("text", ROUNDTRIP, ids=[repr(t)[:40] for t in ROUNDTRIP])
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_nfc_normalization_like_hf(tok):
    """HF's Qwen2 tokenizer NFC-normalizes: a decomposed é encodes like the composed one."""
    assert tok.encode("e\u0301") == tok.encode("\u00e9")


def test_skip_special_drops_control_but_keeps_user_defined(tok):
    ids = tok.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\n<tool_call>{}</tool_call>"
    assert tok.decode(ids) == "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>"


def test_ids_and_sizes(tok):
    assert tok.vocab_size == 151936
    assert tok.bos_id == ENDOFTEXT and not tok.add_bos
    assert tok.eos_id == IM_END
    assert tok.eos_ids == frozenset({IM_END, ENDOFTEXT})
    assert tok.token_to_id("<|im_start|>") == IM_START
    assert tok.token_to_id("Ġhello") == tok.encode(" hello")[0]
    assert tok.token_to_id("no such token") is None
    assert tok.encode("hi", add_special=True) == tok.encode(
        "hi", add_special=False
    )  # no BOS for Qwen


@pytest.mark.parametrize("bad", [-1, 151936, 10**12])
def test_decode_rejects_ids_outside_vocab(tok, bad):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, bad])


def test_stream_waits_for_complete_characters(tok):
    ids = tok.encode(" this is 🦙.cpp")
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids] + [stream.finish()]
    assert "" in pieces[:-1], "test text should split a character across tokens"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == " this is 🦙.cpp"


def test_stream_flushes_dangling_bytes(tok):
    first = tok.encode(" 🦙")[0]  # 'ĠðŁ': a space and half an emoji
    stream = tok.decode_stream()
    assert stream.step(first) == " "
    assert stream.finish() == "\ufffd"


def test_stream_skip_special(tok):
    stream = tok.decode_stream(skip_special=True)
    text = stream.feed(tok.encode("<|im_start|>hi<|im_end|>")) + stream.finish()
    assert text == "hi"


@fuzz_settings(300, deadline_ms=None)  # derandomized: CI's cases are the same each run
@given(st.text(max_size=60))
def test_roundtrip_property(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


@fuzz_settings(200, deadline_ms=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_stream_pieces_are_whole_characters(tok, text):
    text = unicodedata.normalize("NFC", text)
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in tok.encode(text)]
    assert stream.finish() == ""
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


@fuzz_settings(200, deadline_ms=None)
@given(st.lists(st.integers(0, 151935), max_size=20))
def test_stream_equals_decode_for_any_ids(tok, ids):
    """Even for garbage (cut characters, specials mid-character) streaming == decode."""
    stream = tok.decode_stream()
    streamed = "".join(stream.step(i) for i in ids) + stream.finish()
    assert streamed == tok.decode(ids)


# --- synthetic vocabularies: metadata handling without the real model -----------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> character table, written out independently of the implementation."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _meta(**overrides) -> dict:
    """A tiny DeepSeek-R1-Distill-like vocabulary: bytes, two merges, four added tokens."""
    alphabet = _byte_level_alphabet()
    tokens = [*alphabet, "he", "hel", "<|im_end|>", BOS, EOS, "<tool_call>"]
    types = [1] * (len(alphabet) + 2) + [3, 3, 3, 4]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "deepseek-r1-qwen",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["h e", "he l"],
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_synthetic_bos_and_deepseek_specials():
    tok = Tokenizer.from_metadata(_meta())
    bos, eos, hel = (tok.token_to_id(t) for t in (BOS, EOS, "hel"))
    assert tok.encode("hel") == [bos, hel]
    assert tok.encode("hel", add_special=False) == [hel]
    assert tok.encode(f"{BOS}hel{EOS}", add_special=False) == [bos, hel, eos]
    assert tok.decode([bos, hel, eos]) == f"{BOS}hel{EOS}"  # tokenizers' ByteLevel would drop them
    assert tok.decode([bos, hel, eos], skip_special=True) == "hel"
    assert tok.eos_ids == frozenset({eos, tok.token_to_id("<|im_end|>")})


def test_synthetic_chat_template_fallback_and_variables():
    tok = Tokenizer.from_metadata(_meta())
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = Tokenizer.from_metadata(
        _meta(
            **{"tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
        )
    )
    assert tok.apply_chat_template(msgs) == f"{BOS}hi{EOS}"


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen", None])
def test_synthetic_qwen2_family_pre_tokenizers(pre):
    tok = Tokenizer.from_metadata(_meta(**{"tokenizer.ggml.pre": pre}))
    assert tok.decode(tok.encode("hello 123\n\n", add_special=False)) == "hello 123\n\n"


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"tokenizer.ggml.model": "t5"}, UnsupportedError, "tokenizer model 't5'"),
        ({"tokenizer.ggml.pre": "falcon"}, UnsupportedError, "pre-tokenizer 'falcon'"),
        ({"tokenizer.ggml.tokens": None}, GGUFError, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.token_type": [1, 1]}, GGUFError, "token types"),
        ({"tokenizer.ggml.merges": ["he"]}, GGUFError, "merge #0"),
        ({"tokenizer.ggml.merges": ["x y"]}, GGUFError, "needs the token 'xy'"),
        ({"tokenizer.ggml.bos_token_id": 10**6}, GGUFError, "bos_token_id"),
        ({"tokenizer.ggml.bos_token_id": None}, GGUFError, "add_bos_token"),
    ],
)
def test_synthetic_bad_metadata(overrides, error, match):
    with pytest.raises(error, match=match) as info:
        Tokenizer.from_metadata(_meta(**overrides), source="model.gguf")
    assert "model.gguf" in str(info.value)


# --- llama.cpp's vectors for the other vocabularies (tools/extract_vocab.py cut their vocab
# files) ---


@pytest.mark.parametrize(
    "name",
    [
        "ggml-vocab-llama-bpe",
        "ggml-vocab-llama-spm",
        "ggml-vocab-gpt-2",
        "ggml-vocab-phi-3",
        "ggml-vocab-qwen35",
        "ggml-vocab-gemma-4",
    ],
)
def test_llama_cpp_vectors_of_other_vocabularies(name):
    tok = Tokenizer.from_metadata(cut_vocab_meta(name), source=name)
    cases = vocab_vectors(name)
    assert len(cases) >= 40
    for text, expected in cases:
        assert tok.encode(text, add_special=False) == expected, text
        if name.endswith(("-bpe", "gpt-2", "qwen35", "gemma-4")):  # no added space: exact
            assert tok.decode(expected) == text


def test_qwen35_split_keeps_combining_marks_on_their_letter():
    """Qwen3.5's split puts a combining mark in the letter run and does not NFC-normalize: the
    decomposed "é" of its vectors is 'e' + U+0301 as two tokens, where qwen2's split (and NFC)
    give other ids on its vectors."""
    meta = cut_vocab_meta("ggml-vocab-qwen35")
    tok = Tokenizer.from_metadata(meta)
    qwen2 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})
    assert not tok.add_bos
    cases = vocab_vectors("ggml-vocab-qwen35")
    assert tok.encode("e\u0301", add_special=False) == [68, 53839]
    differ = [t for t, ids in cases if qwen2.encode(t, add_special=False) != ids]
    assert "e\u0301" in differ and len(differ) >= 3


@pytest.mark.parametrize("name", ["qwen35", "gemma-4"])
def test_natural_text_and_code_ids_equal_llama_cpp(name):
    """llama.cpp's ids (tools/llama_cpp_reference.py tokenize, on its whole ggml-vocab-NAME.gguf)
    of prose, code, JSON, CJK, emoji, digits, contractions, whitespace runs and chat markers, on
    the vocabulary cut to what they need (tools/extract_vocab.py --also)."""
    import json

    data = json.loads(
        (Path(__file__).parent / "data" / "llama_cpp" / f"{name}-tokenizer.json").read_text("utf-8")
    )
    tok = Tokenizer.from_metadata(cut_vocab_meta(f"ggml-vocab-{name}"), source=name)
    assert len(data["cases"]) >= 40
    for case in data["cases"]:
        assert tok.encode(case["text"], add_special=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]


def test_gemma4_tokenizer_model():
    """tokenizer.ggml.model = gemma4 (llama.cpp's rules): BOS even where the file says no, a
    newline run is one token, a space is '▁' with none added before the text, a character
    without a token falls back to its <0xXX> bytes, and <turn|> / <|tool_response> end a turn."""
    meta = cut_vocab_meta("ggml-vocab-gemma-4")
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_bos_token": False})
    bos = meta["tokenizer.ggml.bos_token_id"]
    assert tok.add_bos and tok.encode("\n\n\n") == [bos, tok.token_to_id("\n\n\n")]
    spelled = [tok.id_to_token(i) for i in tok.encode("a\n\n b<|turn>hi<turn|>", add_special=False)]
    assert spelled == ["a", "\n\n", "▁b", "<|turn>", "hi", "<turn|>"]
    assert [tok.id_to_token(i) for i in tok.encode("Ω", add_special=False)] == ["<0xCE>", "<0xA9>"]
    assert tok.decode(tok.encode("Ω a\n", add_special=False)) == "Ω a\n"
    ends = {tok.id_to_token(i) for i in tok.eos_ids}
    assert ends == {"<eos>", "<turn|>", "<|tool_response>"}


@pytest.mark.parametrize("name", ["ggml-vocab-llama-spm", "ggml-vocab-gemma-4"])
def test_grammar_library_reads_the_bytes_of_spm_spelled_tokens(name):
    """llguidance builds its token table from backend_json (a '▁'-spelled vocabulary needs the
    decoder there) and gets the bytes our decode gives, for every token of the cut vocabulary."""
    import llguidance

    meta = cut_vocab_meta(name)
    tok = Tokenizer.from_metadata(meta)
    table = llguidance.LLTokenizer(tok.backend_json(), n_vocab=tok.vocab_size, eos_token=tok.eos_id)
    kept = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if not t.startswith("\ue000")]
    assert len(kept) > 500
    # <0xFF> (never in UTF-8 text) is llguidance's own marker byte: it keeps that token empty
    kept.remove(tok.token_to_id("<0xFF>"))
    assert [table.decode_bytes([i]) for i in kept] == [tok.token_bytes([i]) for i in kept]


def test_gemma4_count_at_least_is_a_lower_bound():
    """count_at_least on Gemma 4's split (a pre-token is a whole line) never counts more tokens
    than any continuation of the prefix has, special tokens cut in half included."""
    import random

    tok = Tokenizer.from_metadata(cut_vocab_meta("ggml-vocab-gemma-4"))
    rng = random.Random(0)
    pieces = [
        " ",
        "  ",
        "Hello",
        " world",
        "\n",
        "\n\n",
        "a",
        "<|turn>",
        "<turn",
        "|>",
        "é",
        "東京",
    ]
    for _ in range(400):
        prefix, rest = ("".join(rng.choices(pieces, k=rng.randint(0, 8))) for _ in range(2))
        assert tok.count_at_least(prefix) <= len(tok.encode(prefix + rest, add_special=False))


def test_bos_defaults_follow_llama_cpp():
    """SentencePiece and Llama 3 vocabularies add BOS unless the file says otherwise; gpt-2 does
    not."""
    spm = cut_vocab_meta("ggml-vocab-llama-spm")
    assert Tokenizer.from_metadata(spm).encode("hi")[0] == spm["tokenizer.ggml.bos_token_id"]
    bpe = {
        k: v
        for k, v in cut_vocab_meta("ggml-vocab-llama-bpe").items()
        if k != "tokenizer.ggml.add_bos_token"
    }
    assert Tokenizer.from_metadata(bpe).encode("hi")[0] == 128000
    gpt2 = cut_vocab_meta("ggml-vocab-gpt-2")
    assert Tokenizer.from_metadata(gpt2).encode("hi") == [5303]


def test_gpt4o_pre_tokenizer_equals_llama_cpp():
    """gpt-oss's `gpt-4o` split: llama.cpp's ids (tools/llama_cpp_reference.py vocab) on the
    llama-bpe test vocabulary with merges across the places where splits differ, for its own test
    texts and the texts that part the splits; the llama-bpe split gives other ids on some."""
    import json

    from tests.cut_vocab import PRE_TOKENIZER_MERGES, with_merges

    data = json.loads(
        (Path(__file__).parent / "data" / "llama_cpp" / "gpt-4o-tokenizer.json").read_text("utf-8")
    )
    meta = with_merges(cut_vocab_meta(data["vocab"]), PRE_TOKENIZER_MERGES)
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "gpt-4o"})
    llama3 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert not tok.add_bos
    differ = 0
    for case in data["cases"]:
        assert tok.encode(case["text"], add_special=False) == case["ids"], case["text"]
        differ += llama3.encode(case["text"], add_special=False) != case["ids"]
    assert len(data["cases"]) >= 70 and differ >= 3
