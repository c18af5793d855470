"""Fuzz: public API arguments (generate, Model.logits, Sampler, load, the tokenizer) give a
MinferError or a correct result, in bounded time and memory.

Each case starts from one of a few valid argument sets (so valid cases reuse a handful of compiled
executables) and replaces some arguments by hostile values: NaN and infinities, bools, floats
where ints are meant, strings, None, huge and negative numbers, ids outside the vocabulary, text
with lone surrogates. CI runs a fixed derandomized set; MINFER_FUZZ_EXAMPLES=5000 runs a long random
one.
"""

from __future__ import annotations

import math
import unicodedata

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import TINY, bounded, fuzz_settings, tiny_gguf
from minfer_jax import MinferError, generate, load
from minfer_jax.engine.sampling import Sampler
from minfer_jax.model.from_gguf import load_gguf

VOCAB, CTX = TINY.vocab_size, TINY.context_length
HOSTILE = st.sampled_from(
    [
        math.nan,
        math.inf,
        -math.inf,
        -1,
        -1.0,
        0,
        0.5,
        1.5,
        2**31 - 1,
        2**31,
        2**63,
        2**64,
        10**12,
        -(2**63) - 1,
        True,
        False,
        None,
        "3",
        "",
        b"1",
        [1],
        1e308,
        -0.0,
        1e-320,
    ]
)
BASES = [
    dict(
        max_new_tokens=3,
        temperature=0.0,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        repeat_penalty=1.0,
        repeat_last_n=64,
        seed=0,
        stop=(),
        chat=False,
        decode_steps=4,
    ),
    dict(
        max_new_tokens=5,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.0,
        repeat_penalty=1.0,
        repeat_last_n=64,
        seed=7,
        stop=("a",),
        chat=False,
        decode_steps=4,
    ),
    dict(
        max_new_tokens=2,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.3,
        repeat_last_n=8,
        seed=3,
        stop=(),
        chat=True,
        decode_steps=16,
    ),
]
IDS = st.lists(
    st.one_of(
        st.integers(0, VOCAB - 1),
        st.integers(-(2**40), 2**40),
        st.sampled_from([-1, VOCAB, 2**31 - 1]),
        st.booleans(),
        st.floats(),
        st.none(),
    ),
    max_size=12,
)
TEXT = st.text(alphabet=st.characters(blacklist_categories=()), max_size=30)  # surrogates included


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(
        tiny_gguf(tmp_path_factory.mktemp("fuzz_api") / "tiny.gguf"), kernels="xla", ctx_size=CTX
    )


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    return load_gguf(tiny_gguf(tmp_path_factory.mktemp("fuzz_load") / "tiny.gguf"))


@st.composite
def generate_calls(draw):
    kwargs = dict(draw(st.sampled_from(BASES)))
    for name in draw(st.lists(st.sampled_from(sorted(kwargs)), max_size=3, unique=True)):
        kwargs[name] = draw(HOSTILE)
    prompt = draw(st.one_of(IDS, TEXT, st.just([1, 2, 3]), HOSTILE))
    return prompt, kwargs


def _check_result(out, prompt, kwargs) -> None:
    assert out.stop_reason in ("eos", "stop", "length", "context")
    assert len(out.tokens) <= kwargs["max_new_tokens"]
    assert all(0 <= t < VOCAB for t in out.tokens)
    assert isinstance(out.text, str)
    if not isinstance(prompt, str):
        assert out.prompt_tokens == [int(t) for t in prompt]


@fuzz_settings(150, deadline_ms=None)
@given(call=generate_calls())
def test_fuzz_generate(model, call):
    prompt, kwargs = call
    try:
        out = bounded(lambda: generate(model, prompt, **kwargs), seconds=30.0, megabytes=None)
    except MinferError as e:
        event(f"refused: {type(e).__name__}")
        return
    event("generated")
    _check_result(out, prompt, kwargs)


@fuzz_settings(80, deadline_ms=None)
@given(ids=st.one_of(IDS, HOSTILE, TEXT))
def test_fuzz_logits(model, ids):
    try:
        out = bounded(lambda: model.logits(ids), seconds=30.0, megabytes=None)
    except MinferError:
        event("refused")
        return
    event("computed")
    assert out.shape == (len(ids), VOCAB) and np.isfinite(out).all()


@fuzz_settings(150)
@given(
    fields=st.dictionaries(
        st.sampled_from(
            ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"]
        ),
        st.one_of(HOSTILE, st.floats(), st.integers()),
    )
)
def test_fuzz_sampler(fields):
    try:
        s = Sampler(**fields)
    except MinferError as e:
        assert isinstance(e, ValueError)
        return
    hash(s)
    assert (
        math.isfinite(s.temperature)
        and 0 < s.top_p <= 1
        and 0 <= s.min_p <= 1
        and s.repeat_penalty > 0
    )
    assert (
        isinstance(s.top_k, int)
        and isinstance(s.repeat_last_n, int)
        and s.top_k >= 0
        and s.repeat_last_n >= 0
    )


@fuzz_settings(40, deadline_ms=None)
@given(
    kwargs=st.dictionaries(
        st.sampled_from(["ctx_size", "weights", "kernels", "gemm"]),
        st.one_of(
            HOSTILE,
            st.sampled_from(
                ["quantized", "dense", "xla", "pallas", "interpret", "auto", "f16", "int8", "cuda"]
            ),
            st.integers(-5, 2**40),
        ),
        max_size=2,
    )
)
def test_fuzz_load(parsed, kwargs):
    kwargs.setdefault("kernels", "xla")
    try:
        m = bounded(lambda: load(gguf_model=parsed, **kwargs), seconds=30.0, megabytes=None)
    except MinferError:
        event("refused")
        return
    event("loaded")
    assert 1 <= m.ctx_size <= CTX and m.weight_mode in ("quantized", "int8", "dense")


@fuzz_settings(150)
@given(text=st.one_of(TEXT, HOSTILE), ids=IDS)
def test_fuzz_tokenizer(model, text, ids):
    tok = model.tokenizer
    try:
        encoded = tok.encode(text)
    except MinferError:
        pass
    else:
        assert all(0 <= i < VOCAB for i in encoded)
        assert tok.decode(encoded) == unicodedata.normalize(
            "NFC", text
        )  # byte-level: every text round-trips
    try:
        decoded = tok.decode(ids)
    except MinferError:
        return
    assert isinstance(decoded, str)
