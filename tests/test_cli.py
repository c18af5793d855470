"""The command-line interface (minfer_jax.cli.generate, scripts/generate.py).

Most tests run `cli.main(argv)` in-process against one real model loaded once for the module
(`cli.load` is replaced by a function returning it, `cli.load_gguf` by a memoized parse; model
resolution and everything after loading run for real). One test runs scripts/generate.py as a
subprocess end to end. JAX's persistent compilation cache points at a temporary directory, so
nothing depends on (or pollutes) the user's cache.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minfer_jax import GenerationResult
from minfer_jax.cli import generate as cli

REPO = Path(__file__).resolve().parents[1]
FIB = "def fibonacci(n):"


class _Stdout(io.StringIO):
    """A stdout that records each write (to see streaming) and is not a terminal."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def shared_model(real_model_path, xla_cache):
    from minfer_jax.engine.runtime import load

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINFER_COMPILATION_CACHE", xla_cache)
        return load(real_model_path)  # context 4096: the CLI narrows it per run with max_len


@pytest.fixture
def run_cli(shared_model, real_model_path, monkeypatch):
    """run_cli(*argv, stdin="") -> (exit status, stdout text, stderr text, stdout object)."""
    loads: list[dict] = []

    def fake_load(path=None, options=None, **kwargs):
        loads.append(dataclasses.asdict(options))  # the CLI hands load() one Options
        return shared_model

    monkeypatch.setattr(cli, "load", fake_load)
    monkeypatch.setattr(cli, "load_gguf", lambda path: _parsed_gguf(path))  # parsing takes seconds

    def run(*argv, stdin: str = ""):
        out, err = _Stdout(), io.StringIO()
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        rc = cli.main(["-m", real_model_path, *argv])
        return rc, out.getvalue(), err.getvalue(), out

    run.loads = loads
    return run


@functools.cache
def _parsed_gguf(path):
    from minfer_jax.model.from_gguf import load_gguf

    return load_gguf(path)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- no model needed -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["-n"],
        ["--temp", "hot"],
        ["-n", "-5", "-p", "x"],
        ["--top-p", "0", "-p", "x"],
        ["-s", "-7", "-p", "x"],
        ["-p", "a", "-f", "b"],
        ["--backend", "cuda"],
        ["--json-schema", "{not json", "-p", "x"],
        ["--grammar", 'root ::= "a"', "--json-schema", "{}", "-p", "x"],
        ["--grammar-file", "/nonexistent/g.gbnf", "-p", "x"],
    ],
)
def test_bad_flags_one_line_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(err)


def test_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    out, _ = capsys.readouterr()
    assert "examples:" in out and "--n-predict" in out and "--chat" in out
    assert cli.main(["--version"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("minfer-generate 0.1.0")


def test_missing_model_file(tmp_path, capsys):
    assert cli.main(["-m", str(tmp_path / "nope.gguf"), "-p", "x"]) == 2
    assert "not found" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("data", [b"GGUF\x03\x00\x00\x00garbage!", b"\x00" * 64, b""])
def test_broken_gguf(tmp_path, capsys, data):
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    assert cli.main(["-m", str(path), "-p", "x"]) == 2
    assert str(path) in _one_error_line(capsys.readouterr().err)


def test_missing_prompt_file(tmp_path, capsys):
    assert cli.main(["-f", str(tmp_path / "none.txt")]) == 2
    assert "cannot read prompt file" in _one_error_line(capsys.readouterr().err)


def test_no_prompt_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_stdin_is_tty", lambda: True)
    assert cli.main([]) == 2
    assert "no prompt" in _one_error_line(capsys.readouterr().err)


def test_pallas_needs_a_gpu(capsys):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert cli.main(["--backend", "pallas", "-p", "x"]) == 2
    assert "GPU" in _one_error_line(capsys.readouterr().err)


# -- the real model, in-process ------------------------------------------------------------------


@pytest.mark.real_model
def test_greedy_completion_streams(run_cli):
    rc, out, err, stdout = run_cli("-p", FIB, "-n", "32", "--temp", "0", "--verbose")
    assert rc == 0, err
    assert "if n <= 0" in out
    assert re.search(
        r"^seed: \d+$", err, re.MULTILINE
    )  # random without -s; printed so the run can be repeated
    assert "sampler: greedy" in err
    assert re.search(r"(compiling|loading) prefill \[16\] greedy \+ decode \[16\] greedy", err), err
    assert len([w for w in stdout.writes if w.strip()]) >= 2  # text came out chunk by chunk
    assert re.search(r"prompt: 4 tokens, [\d.]+ tok/s", err)
    assert re.search(r"generated: 32 tokens, [\d.]+ tok/s", err)
    assert re.search(r"compile: [\d.]+ s \| stop: length", err)
    assert run_cli.loads[-1]["ctx_size"] == 4096


@pytest.mark.real_model
def test_json_schema_and_grammar_flags_constrain_the_output(run_cli, tmp_path):
    schema = '{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, '
    schema += '"required": ["answer"], "additionalProperties": false}'
    rc, out, err, _ = run_cli("-p", "Is 7 prime? Answer in JSON.", "-j", schema, "--temp", "0")
    assert rc == 0, err
    assert json.loads(out) in ({"answer": "yes"}, {"answer": "no"}), out
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "fib" [0-9] [0-9]?\n')
    rc, out, err, _ = run_cli("-p", FIB, "--grammar-file", str(grammar), "-n", "8", "--temp", "0")
    assert rc == 0 and re.fullmatch("fib[0-9]{1,2}\n?", out), (out, err)
    rc, out, err, _ = run_cli("-p", FIB, "--grammar", "root ::= missing", "-n", "4")
    assert rc == 2 and "grammar" in _one_error_line(err)


@pytest.mark.real_model
def test_mode_flags_reach_load(run_cli):
    """--precise and --deterministic are load()'s precise / deterministic; the server's flags
    are its settings'."""
    from minfer_jax.server import cli as server_cli

    rc, _, err, _ = run_cli("-p", FIB, "-n", "1", "--temp", "0", "--precise", "--deterministic")
    assert rc == 0, err
    assert run_cli.loads[-1]["precise"] is True and run_cli.loads[-1]["deterministic"] is True
    rc, _, err, _ = run_cli("-p", FIB, "-n", "1", "--temp", "0")
    assert run_cli.loads[-1]["precise"] is False and run_cli.loads[-1]["deterministic"] is False
    settings = server_cli.settings_from(server_cli.build_parser().parse_args(["--precise"]))
    assert settings.options.precise and not settings.options.deterministic


@pytest.mark.real_model
def test_prompt_from_stdin_and_file(run_cli, tmp_path):
    rc, out, err, _ = run_cli(
        "-n", "1", "--temp", "0", stdin=FIB + "\n"
    )  # one trailing newline dropped
    assert rc == 0, err
    assert "prompt: 4 tokens" in err
    f = tmp_path / "prompt.txt"
    f.write_text(FIB + "\n")
    rc, out2, err, _ = run_cli("-n", "1", "--temp", "0", "-f", str(f))
    assert rc == 0, err
    assert "prompt: 4 tokens" in err and out2 == out
    rc, out3, err, stdout = run_cli(
        "-n", "1", "--temp", "0", "-p", FIB, "--no-stream", "--display-prompt"
    )
    assert rc == 0, err
    assert (
        out3 == FIB + out and len(stdout.writes) <= 3
    )  # prompt, text, final newline: no streaming
    assert "compiling" not in err  # executables are compiled once per model


@pytest.mark.real_model
def test_seed_reproducible(run_cli):
    args = ("-p", "The best thing about Python is", "-n", "12", "--temp", "0.8")
    rc, a, err, _ = run_cli(*args, "-s", "4242", "--verbose")
    assert rc == 0, err
    assert (
        a.strip()
        and "sampler: temp 0.8, top-k 40, top-p 0.95, min-p 0.05" in err
        and "seed: 4242" in err
    )
    rc, b, err, _ = run_cli(*args, "--seed", "4242")
    assert rc == 0, err
    assert a == b


@pytest.mark.real_model
def test_chat_one_shot(run_cli, shared_model, monkeypatch):
    tok = shared_model.tokenizer
    seen = []
    real_template = tok.apply_chat_template
    monkeypatch.setattr(
        tok,
        "apply_chat_template",
        lambda messages, **kw: (seen.append(list(messages)), real_template(messages, **kw))[1],
    )
    rc, out, err, _ = run_cli("--chat", "-p", "hi", "-n", "8", "--temp", "0")
    assert rc == 0, err
    assert out.strip() and "<|im" not in out
    assert seen[-1] == [{"role": "user", "content": "hi"}]
    # -sys implies --chat; piped stdin with --chat is one user message (no interactive loop)
    rc, out, err, _ = run_cli("-sys", "You are terse.", "-n", "1", "--temp", "0", stdin="hello\n")
    assert rc == 0, err
    assert seen[-1] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hello"},
    ]


@pytest.mark.real_model
def test_prompt_longer_than_context(run_cli):
    rc, out, err, _ = run_cli("-c", "32", "-p", "word " * 100)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "context" in line and "-c" in line


@pytest.mark.real_model
def test_ctx_clamped_to_trained_context(run_cli, shared_model):
    rc, _, err, _ = run_cli("-c", "1000000", "-p", FIB, "-n", "0")
    assert rc == 0, err
    assert "warning: -c 1000000" in err
    assert run_cli.loads[-1]["ctx_size"] == shared_model.config.context_length


@pytest.mark.real_model
def test_one_shot_ctrl_c(run_cli, monkeypatch):
    def interrupted(session, ids, max_new, seed):
        session._on_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._Session, "_produce", interrupted)
    rc, out, err, _ = run_cli("-p", FIB, "-n", "4", "--temp", "0")
    assert rc == 130 and out == "partial\n" and "interrupted" in err and "Traceback" not in err


@pytest.mark.real_model
def test_interactive_chat_keeps_history(run_cli, shared_model, monkeypatch):
    """TTY chat with scripted input: history across turns, Ctrl-C keeps the session, /reset,
    Ctrl-D."""
    tok = shared_model.tokenizer
    prompts: list[str] = []
    replies = iter(
        [None, "Second reply.", "Third reply."]
    )  # None: Ctrl-C in the middle of the reply

    def fake_generation(session, ids, max_new, seed):
        prompts.append(tok.decode(ids))
        reply = next(replies)
        if reply is None:
            session._on_text("I was say")
            raise KeyboardInterrupt
        session._on_text(reply)
        return GenerationResult(
            tokens=tok.encode(reply),
            text=reply,
            prompt_tokens=list(ids),
            stop_reason="eos",
            prefill_s=0.1,
            decode_s=0.1,
            compile_s=0.0,
        ), 0.0

    lines = iter(
        [
            "first question",
            "",
            "second \\",
            "line two",
            "/reset",
            "third",
            KeyboardInterrupt,
            "/exit",
        ]
    )

    def fake_input(prompt=""):
        line = next(lines)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line

    monkeypatch.setattr(cli, "_stdin_is_tty", lambda: True)
    monkeypatch.setattr(cli, "_input", fake_input)
    monkeypatch.setattr(cli._Session, "_produce", fake_generation)
    rc, out, err, _ = run_cli("--chat", "-sys", "Be brief.", "-n", "16")
    assert rc == 0, err
    assert len(prompts) == 3
    assert "Be brief." in prompts[0] and "first question" in prompts[0]
    # turn 2 sees turn 1, including the interrupted partial reply, and the continued line
    assert (
        "first question" in prompts[1]
        and "I was say" in prompts[1]
        and "second \nline two" in prompts[1]
    )
    # after /reset only the system prompt remains
    assert (
        "Be brief." in prompts[2] and "third" in prompts[2] and "first question" not in prompts[2]
    )
    assert "I was say\n" in out and "Second reply.\n" in out and "Third reply.\n" in out
    assert "[reply interrupted]" in err and "history cleared" in err
    assert "2 replies; totals:" in err


@pytest.mark.real_model
def test_interactive_chat_ctrl_d(run_cli, monkeypatch):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr(cli, "_stdin_is_tty", lambda: True)
    monkeypatch.setattr(cli, "_input", eof)
    rc, _, err, _ = run_cli("--chat")
    assert rc == 0 and "interactive chat" in err and "Traceback" not in err


@pytest.mark.real_model
def test_single_turn_chat_ends_after_one_reply(run_cli, shared_model, monkeypatch):
    """-st (llama-cli's single turn): one message typed, one reply, then the process ends."""
    tok = shared_model.tokenizer
    prompts: list[str] = []

    def one_reply(session, ids, max_new, seed):
        prompts.append(tok.decode(ids))
        session._on_text("Hi.")
        result = GenerationResult(
            tokens=tok.encode("Hi."),
            text="Hi.",
            prompt_tokens=list(ids),
            stop_reason="eos",
            prefill_s=0.1,
            decode_s=0.1,
            compile_s=0.0,
        )
        return result, 0.0

    lines = iter(["first", "second"])
    monkeypatch.setattr(cli, "_stdin_is_tty", lambda: True)
    monkeypatch.setattr(cli, "_input", lambda prompt="": next(lines))
    monkeypatch.setattr(cli._Session, "_produce", one_reply)
    rc, out, err, _ = run_cli("-st", "-t", "4", "-ngl", "99", "-n", "8")
    assert rc == 0, err
    assert len(prompts) == 1 and "first" in prompts[0] and "<|im_start|>user" in prompts[0]
    assert out == "Hi.\n" and next(lines) == "second"
    assert err.count("means nothing here") == 2


# -- end to end ----------------------------------------------------------------------------------


def _script(*argv, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
        check=False,
    )


def test_script_bad_flag_exit_status():
    proc = _script("--no-such-flag")
    assert proc.returncode == 2 and proc.stdout == ""
    _one_error_line(proc.stderr)


@pytest.mark.real_model
@pytest.mark.slow
def test_script_greedy_end_to_end(real_model_path, xla_cache):
    env = {**os.environ, "MINFER_COMPILATION_CACHE": xla_cache}
    proc = _script("-m", real_model_path, "-p", FIB, "-n", "32", "--temp", "0", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "if n <= 0" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert re.search(
        r"prompt: 4 tokens, [\d.]+ tok/s .*generated: 32 tokens, [\d.]+ tok/s", proc.stderr
    )
    assert re.search(r"compile: [\d.]+ s \| stop: length", proc.stderr)
    assert "if n" not in proc.stderr  # the text goes to stdout only


def test_summary_counts_reused_prompt_tokens_apart():
    """A turn that reuses the last turn's K/V reports its prefill rate over the tokens it
    prefilled."""
    from minfer_jax.cli.chat import _summary, _Totals

    line = _summary(_Totals(prompt_tokens=10, cached_tokens=6, prefill_s=2.0, stop_reason="eos"))
    assert line.startswith("prompt: 10 tokens (6 reused), 2.0 tok/s (2.00 s)")
    assert _summary(_Totals(prompt_tokens=4, prefill_s=1.0)).startswith(
        "prompt: 4 tokens, 4.0 tok/s"
    )
