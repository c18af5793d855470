"""llama.cpp's flags on minfer_jax's command lines (engine/flags.py): taken whole or refused by
name, never read as a prefix of another flag (`-t 2` was `--tensor-parallel 2`, `-ngl 99` was
`-n gl`, `-cnv` was `-c nv`); no-ops say once that they mean nothing here."""

from __future__ import annotations

import argparse

import pytest

from minfer_jax.cli import arguments as cli_arguments
from minfer_jax.cli.arguments import UsageError, apply_escapes, process_escapes
from minfer_jax.engine.flags import NOOPS, StrictParser
from minfer_jax.server import cli as serve_cli

from minfer_bench.bench import arguments as bench_arguments
from minfer_bench.bench.parsing import BenchError

PARSERS = {
    "generate": cli_arguments.build_parser,
    "serve": serve_cli.build_parser,
    "bench": bench_arguments.build_parser,
}
PARSE_ERRORS = (UsageError, serve_cli._UsageError, BenchError)


def _parse(tool: str, *argv: str) -> argparse.Namespace:
    return PARSERS[tool]().parse_args(list(argv))


def _refusal(tool: str, *argv: str) -> str:
    with pytest.raises(PARSE_ERRORS) as e:
        _parse(tool, *argv)
    return str(e.value)


@pytest.mark.parametrize("tool", PARSERS)
@pytest.mark.parametrize(
    "argv, dest",
    [
        (["-t", "2"], "llama_threads"),
        (["--threads", "8"], "llama_threads"),
        (["-ngl", "99"], "llama_gpu_layers"),
        (["--n-gpu-layers", "99"], "llama_gpu_layers"),
        (["-fa"], "llama_flash_attn"),
        (["-fa", "on"], "llama_flash_attn"),
    ],
)
def test_no_ops_are_taken_with_one_note(tool, argv, dest, capsys):
    args = _parse(tool, *argv, *argv)  # given twice: still one note
    assert getattr(args, dest) is not None
    assert args.tensor_parallel is None  # -t is never -tp
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and argv[0] in err and "means nothing here" in err


@pytest.mark.parametrize("tool", ["generate", "serve"])
def test_jinja_is_a_no_op(tool, capsys):
    assert _parse(tool, "--jinja").llama_jinja is not None
    assert "--jinja" in capsys.readouterr().err


@pytest.mark.parametrize("tool", PARSERS)
def test_tensor_parallel_has_its_own_spelling(tool):
    assert _parse(tool, "-tp", "2").tensor_parallel == 2
    assert _parse(tool, "--tensor-parallel", "4").tensor_parallel == 4
    assert "-tpx" in _refusal(tool, "-tpx", "2")


@pytest.mark.parametrize("tool", PARSERS)
@pytest.mark.parametrize("flag", ["--tensor", "--temper", "-tpp", "-ng", "--kern", "-xyz"])
def test_no_prefix_matching(tool, flag):
    assert flag in _refusal(tool, flag, "1")


def test_generate_takes_llama_clis_flags():
    args = _parse("generate", "-cnv", "-r", "User:", "--ignore-eos", "-p", "hi")
    assert args.chat and args.stop == ["User:"] and args.ignore_eos
    assert not _parse("generate", "-cnv", "-no-cnv").chat
    assert _parse("generate", "--conversation").chat
    assert _parse("generate", "-st").single_turn and not _parse("generate").single_turn
    assert _parse("generate", "-r", "a", "--stop", "b", "--reverse-prompt", "c").stop == [
        "a",
        "b",
        "c",
    ]
    # short flags keep their attached values, numbers only
    assert _parse("generate", "-n64", "-s-1").n_predict == 64
    assert _parse("generate", "-n-1").n_predict == -1
    assert "-ngl" in _refusal("generate", "-ngl")  # a value is needed, and the flag is named


def test_escapes_as_llama_cpp_reads_them():
    assert process_escapes(r"a\nb\tc\\n\x41\'\"\q") == "a\nb\tc\\nA'\"\\q"
    args = _parse("generate", "-e", "-p", r"x\ny", "-r", r"\n\n", "-sys", r"be\tbrief")
    apply_escapes(args)
    assert (args.prompt, args.stop, args.system_prompt) == ("x\ny", ["\n\n"], "be\tbrief")
    plain = _parse("generate", "-p", r"x\ny")
    apply_escapes(plain)
    assert plain.prompt == r"x\ny" and not plain.escape


@pytest.mark.parametrize("tool", ["serve", "bench"])
@pytest.mark.parametrize("flag", ["-cnv", "-no-cnv", "-st", "-e", "--ignore-eos"])
def test_llama_cli_only_flags_are_refused_by_name(tool, flag):
    message = _refusal(tool, flag)
    assert flag in message and f"not a flag of {'serve.py' if tool == 'serve' else 'bench.py'}" in (
        message
    )


def test_serve_refuses_reverse_prompt_and_bench_keeps_repetitions():
    assert "stop" in _refusal("serve", "-r", "User:")
    assert _parse("bench", "-r", "3").repetitions == 3
    assert "--jinja" in _refusal("bench", "--jinja")


def test_every_noop_is_declared_once_per_parser():
    for build in PARSERS.values():
        parser = build()
        assert isinstance(parser, StrictParser)
        strings = [s for a in parser._actions for s in a.option_strings]
        assert len(strings) == len(set(strings))
    assert set(NOOPS) == {"threads", "gpu_layers", "flash_attn", "jinja"}


def test_serve_takes_llama_servers_seed():
    """-s/--seed: the seed of requests that give none (-1: a random one each), as the CLI's."""
    assert serve_cli.settings_from(_parse("serve", "-s", "42")).seed == 42
    assert serve_cli.settings_from(_parse("serve", "--seed", "-1")).seed == -1
    assert serve_cli.settings_from(_parse("serve")).seed == -1
    with pytest.raises(ValueError, match="-s/--seed"):
        serve_cli.settings_from(_parse("serve", "-s", str(2**32)))
