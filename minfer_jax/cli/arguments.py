"""The command line of `minfer-generate`: its flags (llama.cpp's spelling; the engine's from
engine/options.add_arguments) and their checks."""

from __future__ import annotations

import argparse
import math
import re
import sys

from minfer_jax import validate
from minfer_jax.cli.constraints import add_constraint_flags
from minfer_jax.engine import options
from minfer_jax.engine.flags import StrictParser, add_llama_noops
from minfer_jax.engine.spec_flags import add_speculative_flags
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.version import __version__

PROG = "minfer-generate"
DEFAULT_N_PREDICT = 128
DEFAULT_CTX = 4096

DESCRIPTION = """\
Generate text with a Qwen2, Llama, Qwen3 or Gemma 3 GGUF model (JAX; Pallas kernels on a GPU).
Generated text is streamed to stdout; progress, timings and errors go to stderr."""

EPILOG = """\
examples:
  %(prog)s -p "def fibonacci(n):" -n 64 --temp 0
  %(prog)s -m model.gguf --chat -p "Write a haiku about JAX"
  %(prog)s --chat                       # interactive chat (/exit or Ctrl-D quits)
  echo "import numpy as np" | %(prog)s -n 32 -s 42

The default model is the built-in Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the `model` extra).
-m also takes a local .gguf path or hf:<repo>:<file> (needs huggingface_hub).
A prompt from -f or stdin loses one trailing newline, as in llama.cpp.
With --chat and stdin piped (not a terminal), stdin is one user message (no interactive loop).
"""


class UsageError(InvalidArgumentError):
    """A bad command line: reported as one `error:` line, exit status 2."""


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the version and exit",
        )

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(_version() + "\n")
        raise SystemExit(0)


class _Parser(StrictParser):
    def error(self, message):  # argparse prints usage + message and exits; we want one line
        raise UsageError(f"{message} (see --help)")


def _version() -> str:
    import jax

    return f"{PROG} {__version__} (jax {jax.__version__}, default backend {jax.default_backend()})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_arguments(p.add_argument_group("model"))
    _prompt_arguments(p.add_argument_group("prompt"))
    _generation_arguments(p.add_argument_group("generation"))
    _output_arguments(p.add_argument_group("output"))
    add_llama_noops(p.add_argument_group("llama.cpp flags that mean nothing here"))
    return p


def _model_arguments(m) -> None:
    m.add_argument(
        "-m",
        "--model",
        metavar="REF",
        default=None,
        help="GGUF path, 'default' or hf:<repo>:<file> (default: the built-in model)",
    )
    m.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=DEFAULT_CTX,
        metavar="N",
        help=f"context size in tokens, prompt + reply (default {DEFAULT_CTX}; 0 = the model's "
        "trained context; larger values are clamped to it)",
    )
    options.add_arguments(m)


def _prompt_arguments(q) -> None:
    src = q.add_mutually_exclusive_group()
    src.add_argument(
        "-p", "--prompt", metavar="TEXT", help="the prompt (else -f, else stdin if it is piped)"
    )
    src.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE")
    q.add_argument(
        "--chat",
        "-cnv",
        "--conversation",
        dest="chat",
        action="store_true",
        help="apply the model's chat template; without a prompt on a terminal: interactive chat",
    )
    q.add_argument(
        "-no-cnv",
        "--no-conversation",
        dest="chat",
        action="store_false",
        help="plain completion, no chat template (the default)",
    )
    q.add_argument(
        "-st",
        "--single-turn",
        action="store_true",
        help="chat for one turn, then exit (implies --chat; the message from -p, -f, stdin or "
        "one line typed)",
    )
    q.add_argument(
        "-e",
        "--escape",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="read \\n \\r \\t \\' \\\" \\\\ \\xHH in -p, -sys, --stop/-r as llama.cpp "
        "does (default: off, the text is taken as typed)",
    )
    q.add_argument(
        "-sys",
        "--system-prompt",
        metavar="TEXT",
        default=None,
        help="system message for chat mode (implies --chat)",
    )
    q.add_argument(
        "--display-prompt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="echo the prompt before the completion (plain completion mode only; default: off)",
    )


def _generation_arguments(g) -> None:
    g.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=DEFAULT_N_PREDICT,
        metavar="N",
        help=f"tokens to generate (default {DEFAULT_N_PREDICT}; -1 = until end of text or a full "
        "context)",
    )
    g.add_argument(
        "--stop",
        "-r",
        "--reverse-prompt",
        dest="stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT is generated (not printed); repeatable (-r: llama-cli's reverse "
        "prompt)",
    )
    g.add_argument(
        "--temp", type=float, default=0.8, metavar="T", help="temperature (default 0.8; 0 = greedy)"
    )
    g.add_argument(
        "--top-k", type=int, default=40, metavar="K", help="top-k sampling (default 40; 0 = off)"
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=0.95,
        metavar="P",
        help="top-p sampling (default 0.95; 1 = off)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.05,
        metavar="P",
        help="min-p sampling (default 0.05; 0 = off)",
    )
    g.add_argument(
        "--repeat-penalty",
        type=float,
        default=1.0,
        metavar="X",
        help="penalize repeated tokens (default 1.0 = off)",
    )
    g.add_argument(
        "--repeat-last-n",
        type=int,
        default=64,
        metavar="N",
        help="tokens of history the repeat penalty looks at (default 64; -1 = the context size)",
    )
    g.add_argument(
        "-s",
        "--seed",
        type=int,
        default=-1,
        metavar="SEED",
        help="random seed, 0..2^32-1 (default -1: random; --verbose prints it)",
    )
    add_constraint_flags(g)
    add_speculative_flags(g)


def _output_arguments(o) -> None:
    o.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print the text when generation ends instead of streaming it",
    )
    o.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print model, backend, seed and sampler details on stderr",
    )
    o.add_argument("--version", action=_VersionAction)


# -------------------------------------------------------------------------------------------------
# entry point


_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|[nrt'\"\\])")
_ESCAPED = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def process_escapes(text: str) -> str:
    """llama.cpp's -e: backslash escapes in command-line text read as the characters they name."""
    return _ESCAPE.sub(lambda m: chr(int(m[1][1:], 16)) if m[1][0] == "x" else _ESCAPED[m[1]], text)


def apply_escapes(args) -> None:
    """-e/--escape: the command line's texts with their escapes read."""
    if not args.escape:
        return
    if args.prompt is not None:
        args.prompt = process_escapes(args.prompt)
    if args.system_prompt is not None:
        args.system_prompt = process_escapes(args.system_prompt)
    args.stop = [process_escapes(s) for s in args.stop]


def validate_arguments(args) -> None:
    # extreme counts are clamped (validate.clamped_count): only what means nothing is refused
    if args.n_predict < -1:
        raise UsageError(
            f"-n/--n-predict must be -1 (until the context is full) or >= 0, got {args.n_predict}"
        )
    if args.ctx_size < 0:
        raise UsageError(
            f"-c/--ctx-size must be >= 0 (0 = the model's trained context; more is clamped to it), "
            f"got {args.ctx_size}"
        )
    if not math.isfinite(args.temp):
        raise UsageError(f"--temp must be a finite number, got {args.temp}")
    if args.top_k < 0:
        raise UsageError(
            "--top-k must be >= 0 (0 = off; more than the vocabulary means all of it), got "
            f"{args.top_k}"
        )
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0.0 <= args.min_p <= 1.0:
        raise UsageError(f"--min-p must be in [0, 1], got {args.min_p}")
    if not (math.isfinite(args.repeat_penalty) and args.repeat_penalty > 0):
        raise UsageError(f"--repeat-penalty must be > 0, got {args.repeat_penalty}")
    if args.repeat_last_n < -1:
        raise UsageError(
            "--repeat-last-n must be -1 (the context size) or >= 0 (more than the context means "
            f"the context), got {args.repeat_last_n}"
        )
    if not -1 <= args.seed < 2**32:
        raise UsageError(f"-s/--seed must be -1 (random) or in 0..{2**32 - 1}, got {args.seed}")
    for flag, value in (
        ("-p/--prompt", args.prompt),
        ("-sys/--system-prompt", args.system_prompt),
        *(("--stop", s) for s in args.stop),
    ):
        if value is not None:
            checked_text(flag, value)
    if len(args.stop) > validate.MAX_STOP_STRINGS or any(
        len(s) > validate.MAX_STOP_CHARS for s in args.stop
    ):
        raise UsageError(
            f"--stop: at most {validate.MAX_STOP_STRINGS} strings of at most "
            f"{validate.MAX_STOP_CHARS} characters"
        )


def checked_text(flag: str, value: str) -> str:
    """Text from the command line or stdin: undecodable bytes arrive as lone surrogates."""
    try:
        return validate.text(flag, value)
    except InvalidArgumentError as e:
        raise UsageError(f"{e}; pass UTF-8 text") from None
