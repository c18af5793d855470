"""`minfer-generate` (also `python scripts/generate.py`): text generation from the command line.

Flags follow llama.cpp's spelling (-m, -p, -f, -n, -c, -s, --temp, --top-k, ...). Generated text
goes to stdout, streamed chunk by chunk; everything else (progress bar, "compiling ...", the
timing summary, --verbose details, errors) goes to stderr, so `minfer-generate ... > out.txt`
captures only the model's text.

Prompt sources, in order: -p TEXT, -f FILE, stdin when it is not a terminal. With --chat and
none of them (stdin a terminal) the CLI runs an interactive multi-turn chat. Piped stdin with
--chat is one chat turn (the whole of stdin is the user message), not an interactive session.

User errors (bad flags, a missing model, a broken GGUF, a prompt longer than the context) print
one `error: ...` line on stderr and exit with status 2. Ctrl-C exits with 130 (in the interactive
chat it only stops the current reply).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence

from minfer_jax import ops, validate
from minfer_jax.cli.chat import _Session, _summary
from minfer_jax.cli.constraints import add_constraint_flags, constraint_keywords
from minfer_jax.engine.phases import PhaseTimer, format_phase, process_age

# module attributes: tests substitute an already loaded model
from minfer_jax.engine.runtime import load
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError, MinferError
from minfer_jax.files.harmony import HarmonyStream
from minfer_jax.files.model_source import resolve_model
from minfer_jax.model.from_gguf import load_gguf
from minfer_jax.version import __version__

PROG = "minfer-generate"
DEFAULT_N_PREDICT = 128
DEFAULT_CTX = 4096
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

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


class _UsageError(InvalidArgumentError):
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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message and exits; we want one line
        raise _UsageError(f"{message} (see --help)")


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
    m = p.add_argument_group("model")
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
    m.add_argument(
        "--backend",
        "--kernels",
        dest="backend",
        default="auto",
        choices=("auto", *ops.KERNELS.names),
        help=f"quantized matmul implementation: {ops.KERNELS.describe()}; auto = pallas on a GPU, "
        "else xla",
    )
    m.add_argument(
        "--deterministic",
        action="store_true",
        help="a sequence gets the same tokens alone or batched (slower decode, most past 8 rows)",
    )
    m.add_argument(
        "--precise",
        action="store_true",
        help="decode activations in two int8 terms instead of one (llama.cpp's): logits stay "
        "near a float64 forward's on tokens where one term drifts; slower decode on a GPU",
    )
    m.add_argument(
        "-tp",
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split the weights and KV cache over N devices (tensor parallelism; default: one "
        "device)",
    )

    q = p.add_argument_group("prompt")
    src = q.add_mutually_exclusive_group()
    src.add_argument(
        "-p", "--prompt", metavar="TEXT", help="the prompt (else -f, else stdin if it is piped)"
    )
    src.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE")
    q.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template; without a prompt on a terminal: interactive chat",
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

    g = p.add_argument_group("generation")
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
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT is generated (not printed); repeatable",
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

    o = p.add_argument_group("output")
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
    return p


# -------------------------------------------------------------------------------------------------
# entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage/model/prompt error, 130 interrupted)."""
    parser = build_parser()
    err = sys.stderr
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        return _fail(err, str(e))
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(
            errors="replace"
        )  # never die on a character the terminal cannot show
    try:
        return _run(args, sys.stdout, err)
    except MinferError as e:  # every user error; anything else is a bug and keeps its traceback
        return _fail(err, str(e))
    except KeyboardInterrupt:
        _newline_if_needed(sys.stdout)
        err.write("interrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `minfer-generate ... | head`: stop quietly
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _error_line(message: str) -> str:
    """One printable line: whitespace collapsed, undecodable input echoed in the message
    backslash-escaped."""
    line = " ".join(message.split()) or "unknown error"
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def _fail(err, message: str) -> int:
    err.write(f"error: {_error_line(message)}\n")
    err.flush()
    return EXIT_USAGE


# -------------------------------------------------------------------------------------------------
# the run


def _validate(args) -> None:
    # extreme counts are clamped (validate.clamped_count): only what means nothing is refused
    if args.n_predict < -1:
        raise _UsageError(
            f"-n/--n-predict must be -1 (until the context is full) or >= 0, got {args.n_predict}"
        )
    if args.ctx_size < 0:
        raise _UsageError(
            f"-c/--ctx-size must be >= 0 (0 = the model's trained context; more is clamped to it), "
            f"got {args.ctx_size}"
        )
    if not math.isfinite(args.temp):
        raise _UsageError(f"--temp must be a finite number, got {args.temp}")
    if args.top_k < 0:
        raise _UsageError(
            "--top-k must be >= 0 (0 = off; more than the vocabulary means all of it), got "
            f"{args.top_k}"
        )
    if not 0.0 < args.top_p <= 1.0:
        raise _UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0.0 <= args.min_p <= 1.0:
        raise _UsageError(f"--min-p must be in [0, 1], got {args.min_p}")
    if not (math.isfinite(args.repeat_penalty) and args.repeat_penalty > 0):
        raise _UsageError(f"--repeat-penalty must be > 0, got {args.repeat_penalty}")
    if args.repeat_last_n < -1:
        raise _UsageError(
            "--repeat-last-n must be -1 (the context size) or >= 0 (more than the context means "
            f"the context), got {args.repeat_last_n}"
        )
    if not -1 <= args.seed < 2**32:
        raise _UsageError(f"-s/--seed must be -1 (random) or in 0..{2**32 - 1}, got {args.seed}")
    for flag, value in (
        ("-p/--prompt", args.prompt),
        ("-sys/--system-prompt", args.system_prompt),
        *(("--stop", s) for s in args.stop),
    ):
        if value is not None:
            _text(flag, value)
    if len(args.stop) > validate.MAX_STOP_STRINGS or any(
        len(s) > validate.MAX_STOP_CHARS for s in args.stop
    ):
        raise _UsageError(
            f"--stop: at most {validate.MAX_STOP_STRINGS} strings of at most "
            f"{validate.MAX_STOP_CHARS} characters"
        )


def _text(flag: str, value: str) -> str:
    """Text from the command line or stdin: undecodable bytes arrive as lone surrogates."""
    try:
        return validate.text(flag, value)
    except InvalidArgumentError as e:
        raise _UsageError(f"{e}; pass UTF-8 text") from None


def _stdin_is_tty() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _strip_one_newline(text: str) -> str:
    return text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")


def _read_prompt(args, chat: bool) -> str | None:
    """The prompt text, or None for an interactive chat."""
    if args.prompt is not None:
        return args.prompt
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return _strip_one_newline(f.read())
        except OSError as e:
            raise _UsageError(f"cannot read prompt file {args.file}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise _UsageError(
                f"prompt file {args.file} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    if sys.stdin is not None and not _stdin_is_tty():
        return _strip_one_newline(_read_stdin())
    if chat:
        return None
    raise _UsageError(
        "no prompt: give -p TEXT or -f FILE, pipe text on stdin, or use --chat for an interactive "
        "chat"
    )


def _read_stdin() -> str:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes under it (tests, embedding)
        return _text("stdin", sys.stdin.read())
    data = buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UsageError(
            f"stdin is not UTF-8 text ({e.reason} at byte {e.start}); pass UTF-8 text"
        ) from None


def _choose_ctx(requested: int, trained: int, err) -> int:
    if requested == 0:
        return trained
    if requested > trained:
        err.write(
            f"warning: -c {requested} is larger than the model's trained context; using {trained}\n"
        )
        return trained
    return requested


def _make_sampler(args, ctx: int, vocab_size: int):
    from minfer_jax.engine.sampling import sampler_of

    return sampler_of(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        history_cap=ctx,
        vocab=vocab_size,
    )


def _run(args, out, err) -> int:
    import jax

    _validate(args)
    constrain = constraint_keywords(args)
    chat = args.chat or args.system_prompt is not None
    prompt = _read_prompt(args, chat)
    seed = args.seed if args.seed >= 0 else secrets.randbelow(2**32)
    kernels = None if args.backend == "auto" else args.backend
    if kernels == "pallas" and jax.default_backend() != "gpu":
        raise _UsageError(
            f"--backend pallas needs a GPU (this JAX runs on {jax.default_backend()}); "
            "use --backend xla or interpret"
        )
    progress = bool(getattr(err, "isatty", lambda: False)())

    started = process_age()  # the interpreter's start and the imports, before any timer of ours
    t0 = time.perf_counter()
    timer = PhaseTimer()
    path = resolve_model(args.model, progress=progress)
    timer.mark("resolve")
    gguf_model = load_gguf(path)
    timer.mark("parse")
    trained = gguf_model.config.context_length
    ctx = _choose_ctx(args.ctx_size, trained, err)
    model = load(
        gguf_model=gguf_model,
        ctx_size=ctx,  # bounds the KV cache
        kernels=kernels,
        progress=progress,
        tensor_parallel=args.tensor_parallel,
        deterministic=args.deterministic,
        precise=args.precise,
    )
    sampler = _make_sampler(args, ctx, model.config.vocab_size)
    model.constraint(**constrain)  # a bad schema or grammar fails now, before any prompt
    load_s = time.perf_counter() - t0
    phases = {
        **({"python + imports": started} if started is not None else {}),
        **timer.phases,
        **model.startup,
    }
    if model.tokenizer is None:
        raise MinferError(
            f"{path}: the GGUF has no tokenizer metadata (tokenizer.ggml.*); the CLI needs one"
        )
    max_len = min(ctx, model.ctx_size)
    if args.verbose:
        cfg = model.config
        name = gguf_model.metadata.get("general.name", os.path.basename(path))
        err.write(
            f"model: {name} ({path})\n"
            f"  {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads}/{cfg.n_kv_heads} "
            f"heads, vocab {cfg.vocab_size}, trained context {trained}\n"
            f"backend: {jax.default_backend()}, kernels {model.impl.kernels}, weights "
            f"{model.weight_mode} ({model.weight_nbytes / 2**20:.0f} MiB), context {max_len}, "
            f"loaded in {load_s:.1f} s\n"
            f"seed: {seed}\n"
            f"sampler: {_describe_sampler(sampler)}\n"
        )
        err.write("".join(format_phase(name, sec) + "\n" for name, sec in phases.items()))
        if model.weights_from == "cache":
            err.write("weights: mapped from the weights cache\n")
    n_predict = validate.clamped_count(
        "-n/--n-predict", args.n_predict, max_len, all_of="the context"
    )
    session = _Session(
        model=model,
        sampler=sampler,
        seed=seed,
        max_len=max_len,
        n_predict=n_predict,
        stop=tuple(args.stop),
        stream=args.stream,
        out=out,
        err=err,
        verbose=args.verbose,
        constrain=constrain,
        channels=(
            HarmonyStream()
            if (chat or prompt is None) and model.tokenizer is not None and model.tokenizer.harmony
            else None
        ),
    )
    tok = model.tokenizer
    base = (
        [{"role": "system", "content": args.system_prompt}]
        if args.system_prompt is not None
        else []
    )
    if prompt is None:
        return _interactive(session, base)

    if chat:
        ids = tok.encode(
            tok.apply_chat_template(base + [{"role": "user", "content": prompt}]), add_special=False
        )
    else:
        ids = tok.encode(prompt)
        if args.display_prompt:
            session.write(prompt)
    if not ids:
        raise _UsageError("the prompt is empty (it encodes to no tokens)")
    result = session.generate(ids)
    if not args.stream:
        session.write(session.answer(result.text))
    _newline_if_needed(out, session)
    err.write(_summary(session.totals))
    if args.verbose and session.first_text_at is not None:
        err.write(
            format_phase("first text after the process started", session.first_text_at) + "\n"
        )
    err.flush()
    return 0


def _describe_sampler(s) -> str:
    if s.greedy:
        desc = "greedy"
    else:
        desc = f"temp {s.temperature}, top-k {s.top_k}, top-p {s.top_p}, min-p {s.min_p}"
    if s.repeat_penalty != 1.0:
        desc += f", repeat-penalty {s.repeat_penalty} over the last {s.repeat_last_n} tokens"
    return desc


def _newline_if_needed(out, session: _Session | None = None) -> None:
    with contextlib.suppress(Exception):
        if session is None or (session.wrote_any and not session.last_char_newline):
            out.write("\n")
        out.flush()


# -------------------------------------------------------------------------------------------------
# interactive chat


_input = input  # tests replace this


def _read_message() -> str:
    """One user message; a line ending in a backslash continues on the next line."""
    lines = []
    prompt = "> "
    while True:
        line = _input(prompt)
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = ". "
            continue
        lines.append(line)
        return "\n".join(lines)


def _interactive(session: _Session, base: list[dict]) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    err = session.err
    tok = session.model.tokenizer
    err.write(
        "interactive chat: /exit or Ctrl-D quits, /reset clears the history, Ctrl-C stops a reply; "
        "end a line with \\ to continue it\n"
    )
    err.flush()
    history = list(base)
    turn = 0
    while True:
        try:
            text = _read_message()
        except EOFError:
            session.write("\n")
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line being typed
            session.write("\n")
            continue
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history = list(base)
            err.write("(history cleared)\n")
            continue
        try:
            _text("the message", text)
        except _UsageError as e:
            err.write(f"error: {_error_line(str(e))}\n")
            continue
        history.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(history), add_special=False)
        try:
            result = session.generate(ids, turn=turn)
            reply = session.answer(result.text)
            if not session.stream:
                session.write(reply)
        except ContextOverflowError as e:
            history.pop()
            err.write(f"error: {_error_line(str(e))} (/reset clears the history)\n")
            err.flush()
            continue
        except KeyboardInterrupt:
            reply = "".join(session.partial)  # keep what the user saw as the assistant's turn
            session.write("\n")
            err.write("[reply interrupted]\n")
            err.flush()
            history.append({"role": "assistant", "content": reply})
            turn += 1
            continue
        history.append({"role": "assistant", "content": reply})
        turn += 1
        session.write("\n")
        if session.verbose:
            err.write(_summary(session.last))
            err.flush()
    if session.totals.turns:
        err.write(f"{session.totals.turns} replies; totals:\n" + _summary(session.totals))
        err.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
