"""Fuzz: mutated GGUF files load (and tokenize) correctly or raise a MinferError, in bounded time
and memory.

Two families: byte-level mutations of one small valid file (flips, hostile 32/64-bit words written
over counts, lengths and type ids, truncation, inserted and deleted bytes, biased to the metadata
and tensor-info region where a wrong value can cost the most), and structured files written by
gguf-py's GGUFWriter whose known keys carry values of the wrong type or size. CI runs a fixed
derandomized set; MINFER_FUZZ_EXAMPLES=5000 runs a long random one.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import bounded, fuzz_settings, tiny_gguf
from minfer_jax.errors import MinferError
from minfer_jax.files.gguf import open_reader
from minfer_jax.files.tokenizer import Tokenizer
from minfer_jax.model.from_gguf import load_gguf

HOSTILE_WORDS = [
    0,
    1,
    2,
    7,
    8,
    12,
    255,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63,
    2**64 - 1,
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """(bytes of a valid file, where its tensor data starts: metadata and tensor infos lie
    before)."""
    path = tiny_gguf(
        tmp_path_factory.mktemp("fuzz_gguf") / "valid.gguf",
        meta={"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
    )
    return path.read_bytes(), int(open_reader(str(path)).data_offset)


@st.composite
def mutations(draw, size: int, region: int):
    """A list of (kind, offset, value) edits; offsets mostly inside the first `region` bytes."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.one_of(st.integers(0, region - 1), st.integers(0, size - 1)))
        kind = draw(st.sampled_from(["flip", "u64", "u32", "truncate", "insert", "delete"]))
        if kind == "flip":
            edits.append((kind, where, draw(st.integers(1, 255))))
        elif kind in ("u64", "u32"):
            edits.append(
                (
                    kind,
                    where,
                    draw(st.one_of(st.sampled_from(HOSTILE_WORDS), st.integers(0, 2**32))),
                )
            )
        else:
            edits.append((kind, where, draw(st.integers(1, 64))))
    return edits


def _apply(blob: bytes, edits) -> bytes:
    b = bytearray(blob)
    for kind, at, value in edits:
        at = min(at, max(len(b) - 1, 0))
        if kind == "flip" and b:
            b[at] ^= value
        elif kind in ("u64", "u32"):
            fmt = "<Q" if kind == "u64" else "<I"
            word = struct.pack(fmt, value % (2**64 if kind == "u64" else 2**32))
            b[at : at + len(word)] = word
        elif kind == "truncate":
            del b[at:]
        elif kind == "insert":
            b[at:at] = bytes([value]) * value
        elif kind == "delete":
            del b[at : at + value]
    return bytes(b)


def _use(path) -> None:
    """Everything a loaded file feeds: config, tensors' shapes, the tokenizer, encode/decode, the
    template."""
    m = load_gguf(path)
    assert m.config.vocab_size == m.tensors["token_embd.weight"].shape[0]
    for name, t in m.tensors.items():
        assert t.data.nbytes > 0, name
    if "tokenizer.ggml.tokens" in m.metadata:
        tok = Tokenizer.from_model(m)
        assert tok.vocab_size <= m.config.vocab_size
        ids = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "hi there\n"}]), add_special=False
        )
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert isinstance(tok.decode(ids), str)


def _check(path) -> None:
    try:
        bounded(lambda: _use(path), seconds=5.0, megabytes=48)
    except MinferError as e:
        event(f"refused: {type(e).__name__}")
        return
    event("loaded and used")


@fuzz_settings(150, deadline_ms=None)
@given(data=st.data())
def test_fuzz_gguf_bytes(valid, tmp_path_factory, data):
    blob, region = valid
    edits = data.draw(mutations(len(blob), region))
    path = tmp_path_factory.mktemp("m", numbered=True) / "m.gguf"
    path.write_bytes(_apply(blob, edits))
    _check(path)


VALUES = st.one_of(
    st.sampled_from(HOSTILE_WORDS),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=20),
    st.lists(st.integers(0, 2**32 - 1), max_size=5),
    st.lists(st.text(max_size=5), max_size=5),
    st.sampled_from(["", "qwen2", "gpt2", "llama"]),
    st.none(),
)
KEYS = [
    "general.architecture",
    "qwen2.block_count",
    "qwen2.context_length",
    "qwen2.embedding_length",
    "qwen2.feed_forward_length",
    "qwen2.attention.head_count",
    "qwen2.attention.head_count_kv",
    "qwen2.rope.freq_base",
    "qwen2.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "general.alignment",
]


@fuzz_settings(60, deadline_ms=None)
@given(meta=st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=3))
def test_fuzz_gguf_metadata_values(tmp_path_factory, meta):
    path = tmp_path_factory.mktemp("w", numbered=True) / "w.gguf"
    try:
        tiny_gguf(path, meta=meta)
    except (ValueError, TypeError, OverflowError, struct.error):
        return  # gguf-py cannot write this value (e.g. a mixed-type list): nothing to load
    _check(path)
