"""Issue 18's failure classes, one test each: every bad input gets a MinferError, nothing wrong gets
through.

Each test failed on the main of 2026-12-01 (output came back, a plain ValueError/TypeError or a
tokenizers panic escaped, or memory and time were unbounded) and passes with the validators.
The model is a one-layer 300-token Qwen2 (tests/fuzz_support.py), loaded once on XLA.
"""

from __future__ import annotations

import math
import struct

import pytest

from fuzz_support import TINY, bounded, tiny_gguf
from minfer_jax import MinferError, generate, load
from minfer_jax.engine.sampling import Sampler
from minfer_jax.errors import GGUFError, InvalidArgumentError, TemplateError
from minfer_jax.files.chat_template import render_chat_template
from minfer_jax.files.tokenizer import Tokenizer
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import load_gguf
from minfer_jax.ops import Impl

NAN = float("nan")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def model(tiny_path):
    return load(tiny_path, kernels="xla", ctx_size=TINY.context_length)


def _refused(fn, *parts, exc=MinferError):
    """fn() must raise `exc` (a MinferError) whose message names every part."""
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, MinferError), type(info.value)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {info.value}"
    return info.value


# --------------------------------------------------------------------------------------------
# token ids out of range


@pytest.mark.parametrize("ids", [[-1], [1, 2, 3, 1000], [2**31 - 1], [5, 300]])
def test_generate_refuses_ids_outside_the_vocabulary(model, ids):
    bad = next(i for i in ids if not 0 <= i < 300)
    _refused(lambda: generate(model, ids, max_new_tokens=2), str(bad), "300")


@pytest.mark.parametrize("ids", [[-1], [1, 2, 3, 1000], [2**31 - 1], [2**40]])
def test_logits_refuse_ids_outside_the_vocabulary(model, ids):
    _refused(lambda: model.logits(ids), "300")


@pytest.mark.parametrize("ids", [[1.5], ["3"], [True], [None]])
def test_ids_must_be_integers(model, ids):
    _refused(lambda: model.logits(ids), "token id")
    _refused(lambda: generate(model, ids, max_new_tokens=1), "token id")


def test_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    tokens = [f"<t{i}>" for i in range(TINY.vocab_size + 20)]
    path = tiny_gguf(tmp_path / "big_vocab.gguf", tokens=tokens, meta={"tokenizer.ggml.merges": []})
    _refused(lambda: load_gguf(path), "320", "300", "token_embd", exc=GGUFError)


# --------------------------------------------------------------------------------------------
# NaN settings and wrong types


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": NAN}, "temperature"),
        ({"repeat_penalty": NAN}, "repeat_penalty"),
        ({"max_new_tokens": NAN}, "max_new_tokens"),
        ({"top_p": NAN}, "top_p"),
        ({"min_p": NAN}, "min_p"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"repeat_last_n": 1.5}, "repeat_last_n"),
        ({"seed": 2**70}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"decode_steps": 0}, "decode_steps"),
        ({"decode_steps": 10**6}, "decode_steps"),
        ({"repeat_last_n": -2, "repeat_penalty": 1.1}, "repeat_last_n"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": -2}, "max_new_tokens"),
        ({"stop": "ab"}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop": ["\udc80"]}, "UTF-8"),
    ],
)
def test_generate_refuses_bad_settings(model, kwargs, name):
    err = _refused(
        lambda: bounded(
            lambda: generate(
                model, [1, 2], max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs
            ),
            seconds=2.0,
        ),
        name,
    )
    assert isinstance(
        err, ValueError
    )  # InvalidArgumentError keeps `except ValueError` callers working


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 10**18},
        {"max_new_tokens": -1},
        {"top_k": 10**12},
        {"repeat_last_n": 2_000_000_000, "repeat_penalty": 1.1},
    ],
)
def test_extreme_counts_are_clamped_like_llama_cpp(model, kwargs):
    """Past the context or the vocabulary means all of it: the same tokens as the limit itself."""
    base = dict(temperature=0.7, seed=5, max_new_tokens=4)
    out = bounded(
        lambda: generate(model, [1, 2], **{**base, **kwargs}), seconds=60.0, megabytes=None
    )
    limit = {
        "max_new_tokens": TINY.context_length,
        "top_k": TINY.vocab_size,
        "repeat_last_n": TINY.context_length,
    }
    same = {**base, **{k: limit[k] if k in limit else v for k, v in kwargs.items()}}
    assert out.tokens == generate(model, [1, 2], **same).tokens
    if "max_new_tokens" in kwargs:
        assert out.stop_reason in ("context", "eos") and len(out.tokens) >= 1


def test_load_clamps_the_context_and_checks_prefill_chunk(tiny_path):
    assert load(tiny_path, kernels="xla", ctx_size=10**9).ctx_size == TINY.context_length
    for chunk in (0, 1, -1, 1_000_000, 24, 2.0, True):
        _refused(
            lambda chunk=chunk: load(tiny_path, kernels="xla", prefill_chunk=chunk),
            "prefill_chunk",
            "16..65536" if chunk != 24 else "power of two",
            exc=InvalidArgumentError,
        )


def test_prompt_with_a_lone_surrogate(model):
    _refused(lambda: generate(model, "abc\udc80", max_new_tokens=1), "UTF-8")
    _refused(lambda: model.tokenizer.encode("x\ud800"), "UTF-8")
    _refused(lambda: model.tokenizer.encode(b"bytes"), "str")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ctx_size": 2.5},
        {"ctx_size": 0},
        {"ctx_size": True},
        {"ctx_size": -5},
        {"weights": "fp8"},
        {"kernels": "cuda"},
        {"gemm": "fast"},
    ],
)
def test_load_refuses_bad_arguments(tiny_path, kwargs):
    _refused(lambda: load(tiny_path, **kwargs), next(iter(kwargs)).split("_")[0])


def test_config_sampler_impl_errors_are_minfer_errors():
    for build in (
        lambda: Sampler(top_k=-1),
        lambda: Sampler(temperature=NAN),
        lambda: Sampler(top_k=2.5),
        lambda: Impl(kernels="cuda"),
        lambda: Impl(gemv_max_nt=0),
        lambda: Config(1, 60, 7, 1, 8, 16, 10, 1e4, 1e-6, True),
    ):
        err = _refused(build, exc=InvalidArgumentError)
        assert isinstance(err, ValueError)


def test_trained_context_of_2_to_the_40_is_a_gguf_error(tmp_path):
    path = tiny_gguf(tmp_path / "ctx.gguf", meta={"qwen2.context_length": 2**40})
    _refused(lambda: load_gguf(path), "context_length", str(2**40), exc=GGUFError)


def test_metadata_of_the_wrong_type_is_a_gguf_error(tmp_path):
    path = tiny_gguf(tmp_path / "pre.gguf", meta={"tokenizer.ggml.pre": ["qwen2", "x"]})
    _refused(lambda: load_gguf(path), "tokenizer.ggml.pre", "should be str", exc=GGUFError)
    path = tiny_gguf(tmp_path / "bos.gguf", meta={"tokenizer.ggml.add_bos_token": "yes"})
    _refused(lambda: load_gguf(path), "tokenizer.ggml.add_bos_token", exc=GGUFError)


def test_merge_whose_join_is_not_a_token_is_a_gguf_error(tmp_path):
    path = tiny_gguf(
        tmp_path / "merge.gguf", meta={"tokenizer.ggml.merges": ["a b"]}
    )  # 'ab' not in the vocab
    m = load_gguf(path)
    _refused(lambda: Tokenizer.from_model(m), "merge", "'ab'", exc=GGUFError)


# --------------------------------------------------------------------------------------------
# unbounded memory or time


@pytest.mark.parametrize(
    "template",
    [
        "{{ (['x' * 4000000] * 1000)|join }}",
        "{{ ['x' * 4000000] * 1000 }}",
        "{{ ''.join(['x' * 4000000] * 1000) }}",
        "{{ '{:{}}'.format('x', 3000000000) }}",
        "{{ '{0:{1}}'.format('x', 3000000000) }}",
        "{% set s = 'x' * 4000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s "
        "~ s ~ s ~ s }}",
        "{% for a in 'x' * 3000 %}{% for b in 'x' * 3000 %}{% for c in 'x' * 3000 %}{% endfor "
        "%}{% endfor %}{% endfor %}",
        "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{{ '' }}{% endfor %}{% endfor %}",
        "{{ ((7 ** 4000) ** 4000) ** 4000 }}",
        "{% set ns = namespace(x=3) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% "
        "endfor %}{{ ns.x > 0 }}",
    ],
)
def test_template_bombs_fail_fast(template):
    loops = template.startswith("{% for")  # time only: tracemalloc would slow the 2M loop steps ~7x
    _refused(
        lambda: bounded(
            lambda: render_chat_template(template, []),
            seconds=4.0,
            megabytes=None if loops else 200,
        ),
        exc=TemplateError,
    )


def test_huge_template_source_is_refused_before_compiling():
    big = "{{ 'x' }}" * 500_000  # 4.5 MB
    _refused(
        lambda: bounded(lambda: render_chat_template(big, []), seconds=1.0),
        "characters",
        exc=TemplateError,
    )


def test_metadata_array_length_is_checked_before_parsing(tmp_path):
    # 200k empty strings (8 zero bytes each) as the last metadata value; then its count says 2**40.
    path = tiny_gguf(tmp_path / "arr.gguf", meta={"zz.pad": [""] * 200_000})
    blob = bytearray(path.read_bytes())
    key = struct.pack("<Q", 6) + b"zz.pad"
    at = blob.find(key) + len(key) + 4 + 4  # past the value type and the item type
    assert struct.unpack_from("<Q", blob, at)[0] == 200_000
    struct.pack_into("<Q", blob, at, 2**40)
    path.write_bytes(bytes(blob))
    _refused(
        lambda: bounded(lambda: load_gguf(path), seconds=0.5, megabytes=8),
        "zz.pad",
        str(2**40),
        exc=GGUFError,
    )


def test_kv_cache_larger_than_memory_is_refused_at_load(tmp_path):
    path = tiny_gguf(tmp_path / "long.gguf", meta={"qwen2.context_length": 2**30})
    _refused(
        lambda: bounded(
            lambda: load(path, kernels="xla", ctx_size=2**30), seconds=10.0, megabytes=512
        ),
        "KV cache",
        "bytes",
    )


# --------------------------------------------------------------------------------------------
# the sandbox refuses instead of rendering ''


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages['__dict__'] }}",
        "{{ messages['_private'] }}",
        "{{ messages|attr('__dict__') }}",
        "{{ messages|attr('_x') }}",
        "{{ messages|map(attribute='__class__')|list }}",
        "{{ messages|selectattr('__dict__')|list }}",
        "{{ messages|sort(attribute='__x') }}",
        "{{ (messages|first)['__class__'] }}",
    ],
)
def test_sandbox_refuses_hidden_attributes(template):
    _refused(
        lambda: render_chat_template(template, [{"role": "user", "content": "hi"}]),
        "attribute",
        exc=TemplateError,
    )


# --------------------------------------------------------------------------------------------
# CLI: one `error:` line and status 2, never a traceback


def _cli(monkeypatch, *argv, stdin: bytes = b""):
    import io
    import sys

    from minfer_jax.cli import generate as cli

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "argv, stdin, expect",
    [
        (["-p", "abc\udcff"], b"", "UTF-8"),
        (["-sys", "be \udce9", "-p", "hi"], b"", "UTF-8"),
        (["--stop", "\udc80", "-p", "hi"], b"", "UTF-8"),
        ([], b"caf\xe9 au lait", "UTF-8"),
        (["--repeat-last-n", "-2", "-p", "hi"], b"", "--repeat-last-n"),
        (["-n", "-2", "-p", "hi"], b"", "-n/--n-predict"),
        (["-c", "-1", "-p", "hi"], b"", "-c/--ctx-size"),
        (["--top-k", "-1", "-p", "hi"], b"", "--top-k"),
        (["--temp", "nan", "-p", "hi"], b"", "--temp"),
        (["--top-p", "nan", "-p", "hi"], b"", "--top-p"),
        (["-p", ""], b"", "empty"),
    ],
)
def test_cli_bad_input_is_one_error_line(monkeypatch, tiny_path, argv, stdin, expect):
    rc, out, err = _cli(monkeypatch, "-m", str(tiny_path), "--temp", "0", *argv, stdin=stdin)
    assert rc == 2 and out == "", (rc, out, err)
    lines = [line for line in err.splitlines() if not line.startswith("warning: ")]  # -c 4096 > 128
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err


@pytest.mark.parametrize(
    "argv",
    [
        ["-n", "99999999999"],
        ["-n", str(2 * 10**9)],
        ["--top-k", "99999999999"],
        ["--top-k", str(2 * 10**9)],
        ["-c", "99999999999"],
        ["--repeat-last-n", str(2 * 10**9), "--repeat-penalty", "1.1"],
    ],
)
def test_cli_extreme_counts_are_clamped(monkeypatch, tiny_path, argv):
    rc, out, err = bounded(
        lambda: _cli(
            monkeypatch, "-m", str(tiny_path), "--temp", "0.7", "-s", "3", "-p", "hi", *argv
        ),
        seconds=60.0,
        megabytes=None,
    )
    assert rc == 0 and "error" not in err, err


def test_cli_repeat_last_n_past_the_context_is_the_context(monkeypatch, tiny_path):
    rc, out, err = bounded(
        lambda: _cli(
            monkeypatch,
            "-m",
            str(tiny_path),
            "--temp",
            "0",
            "-n",
            "3",
            "--repeat-penalty",
            "1.1",
            "--repeat-last-n",
            "2000000000",
            "-p",
            "hi",
            "-v",
        ),
        seconds=60.0,
        megabytes=None,
    )
    assert (
        rc == 0 and "over the last 4096 tokens" not in err and "over the last 128 tokens" in err
    ), err


def test_cli_ctx_0_with_a_huge_trained_context(monkeypatch, tmp_path):
    path = tiny_gguf(tmp_path / "long.gguf", meta={"qwen2.context_length": 2**30})
    rc, out, err = bounded(
        lambda: _cli(monkeypatch, "-m", str(path), "-c", "0", "-p", "hi"),
        seconds=20.0,
        megabytes=None,
    )
    assert rc == 2 and "KV cache" in err and err.count("\n") == 1, err
