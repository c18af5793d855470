"""One Options type: load(path, options) and load(path, **fields) agree, unknown keywords and wrong
types are InvalidArgumentErrors, and every command line declares the engine's flags through the one
helper (same spellings, same meaning of --kernels)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import minfer_jax
from configs import tiny_config
from minfer_jax.engine import options
from minfer_jax.errors import InvalidArgumentError

from minfer_bench.synthetic import placeholder_tokenizer, synthetic_model_from_config, write_gguf

ENGINE_DESTS = {
    "kernels",
    "gemm",
    "weights",
    "deterministic",
    "precise",
    "fused_decode",
    "prefill_chunk",
    "tensor_parallel",
}


@pytest.fixture(scope="module")
def tiny_model_file(tmp_path_factory) -> str:
    """A 1-layer model written as a GGUF with a placeholder tokenizer (what a user's file is)."""
    cfg = tiny_config(n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, d_ff=128, vocab_size=300)
    path = str(tmp_path_factory.mktemp("options") / "tiny.gguf")
    gm = synthetic_model_from_config(cfg, "q8_0", seed=1)
    write_gguf(gm, path, progress=False, tokenizer=placeholder_tokenizer(cfg.vocab_size))
    return path


@pytest.fixture(autouse=True)
def _no_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("MINFER_COMPILATION_CACHE", "0")
    monkeypatch.setenv("MINFER_WEIGHTS_CACHE", "0")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from minfer_jax.cli import generate
    from minfer_jax.server import cli as server_cli
    from tools import engine_check

    from minfer_bench.bench import arguments

    return {
        "generate": generate.build_parser(),
        "serve": server_cli.build_parser(),
        "bench": arguments.build_parser(),
        "engine_check": engine_check.build_parser(),
    }


def _engine_flags(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {
        a.dest: (tuple(sorted(a.option_strings)), tuple(a.choices or ()), a.default)
        for a in parser._actions
        if a.dest in ENGINE_DESTS
    }


def test_every_command_line_declares_the_engine_flags_alike():
    reference = argparse.ArgumentParser()
    options.add_arguments(reference)
    want = _engine_flags(reference)
    assert set(want) == ENGINE_DESTS
    for name, parser in _parsers().items():
        assert _engine_flags(parser) == want, name
        # --kernels is the matmul implementation everywhere (bench's per-matmul timing: --matmuls)
        (kernels,) = [a for a in parser._actions if "--kernels" in a.option_strings]
        assert kernels.dest == "kernels" and "xla" in kernels.choices, name


def test_flags_make_the_options():
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args(
        ["--kernels", "interpret", "--precise", "-ub", "32", "--unfused-decode"]
    )
    got = options.from_arguments(args, ctx_size=128)
    assert got == minfer_jax.Options(
        kernels="interpret", precise=True, prefill_chunk=32, fused_decode=False, ctx_size=128
    )
    assert options.from_arguments(parser.parse_args([])) == minfer_jax.Options()


def test_options_check_their_fields():
    with pytest.raises(InvalidArgumentError, match="kernels"):
        minfer_jax.Options(kernels="cuda")
    with pytest.raises(InvalidArgumentError, match="deterministic"):
        minfer_jax.Options(deterministic="yes")
    with pytest.raises(InvalidArgumentError, match="ctx_size"):
        minfer_jax.Options(ctx_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        minfer_jax.Options().ctx_size = 5  # type: ignore[misc]


def test_load_refuses_unknown_keywords_and_wrong_types():
    with pytest.raises(InvalidArgumentError, match="'temprature'"):
        minfer_jax.load("x.gguf", temprature=0.7)
    with pytest.raises(InvalidArgumentError, match="did you mean 'ctx_size'"):
        minfer_jax.load("x.gguf", ctx_sise=64)
    with pytest.raises(InvalidArgumentError, match="path must be a str"):
        minfer_jax.load(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="options must be a minfer_jax.Options"):
        minfer_jax.load("x.gguf", {"ctx_size": 64})  # type: ignore[arg-type]


def test_load_takes_options_or_keywords(tiny_model_file):
    by_options = minfer_jax.load(tiny_model_file, minfer_jax.Options(ctx_size=64, kernels="xla"))
    by_keywords = minfer_jax.load(tiny_model_file, ctx_size=64, kernels="xla")
    over = minfer_jax.load(tiny_model_file, minfer_jax.Options(ctx_size=32), ctx_size=64)
    for m in (by_options, by_keywords, over):
        assert m.ctx_size == 64 and m.impl.kernels == "xla"
    assert by_options.options == by_keywords.options


def test_unfused_decode_is_an_option_not_a_private_field(tiny_model_file):
    m = minfer_jax.load(tiny_model_file, ctx_size=32, fused_decode=False)
    assert m.impl.fused_decode is False
