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

import contextlib
import dataclasses
import os
import secrets
import sys
import time
from collections.abc import Sequence

from minfer_jax import validate
from minfer_jax.cli.arguments import (
    UsageError,
    apply_escapes,
    build_parser,
    checked_text,
    validate_arguments,
)
from minfer_jax.cli.chat import _Session, _summary
from minfer_jax.cli.constraints import constraint_keywords
from minfer_jax.engine import options
from minfer_jax.engine.phases import PhaseTimer, format_phase, process_age

# module attributes: tests substitute an already loaded model
from minfer_jax.engine.runtime import load
from minfer_jax.engine.spec_flags import draft_speculation, speculation_from_args
from minfer_jax.errors import ContextOverflowError, MinferError
from minfer_jax.files.harmony import HarmonyStream
from minfer_jax.files.model_source import resolve_model
from minfer_jax.model.from_gguf import load_gguf

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage/model/prompt error, 130 interrupted)."""
    parser = build_parser()
    err = sys.stderr
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
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
            raise UsageError(f"cannot read prompt file {args.file}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise UsageError(
                f"prompt file {args.file} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    if sys.stdin is not None and not _stdin_is_tty():
        return _strip_one_newline(_read_stdin())
    if chat:
        return None
    raise UsageError(
        "no prompt: give -p TEXT or -f FILE, pipe text on stdin, or use --chat for an interactive "
        "chat"
    )


def _read_stdin() -> str:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes under it (tests, embedding)
        return checked_text("stdin", sys.stdin.read())
    data = buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
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

    apply_escapes(args)
    validate_arguments(args)
    constrain = constraint_keywords(args)
    speculation = speculation_from_args(args)
    chat = args.chat or args.single_turn or args.system_prompt is not None
    prompt = _read_prompt(args, chat)
    seed = args.seed if args.seed >= 0 else secrets.randbelow(2**32)
    progress = bool(getattr(err, "isatty", lambda: False)())
    opts = options.from_arguments(args, progress=progress)
    if opts.kernels == "pallas" and jax.default_backend() != "gpu":
        raise UsageError(
            f"--kernels pallas needs a GPU (this JAX runs on {jax.default_backend()}); "
            "use --kernels xla or interpret"
        )

    started = process_age()  # the interpreter's start and the imports, before any timer of ours
    t0 = time.perf_counter()
    timer = PhaseTimer()
    path = resolve_model(args.model, progress=progress)
    timer.mark("resolve")
    gguf_model = load_gguf(path)
    timer.mark("parse")
    trained = gguf_model.config.context_length
    ctx = _choose_ctx(args.ctx_size, trained, err)
    mtp = speculation is not None and speculation.on_device  # draft-mtp: load the MTP block
    model = load(options=dataclasses.replace(opts, ctx_size=ctx, mtp=mtp), gguf_model=gguf_model)
    speculation = draft_speculation(args, model) or speculation
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
        _print_details(err, model, gguf_model, path, max_len, load_s, seed, sampler, phases)
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
        speculation=speculation,
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
        return _interactive(session, base, turns=1 if args.single_turn else None)

    ids = _encode(tok, prompt, base if chat else None)
    if not chat and args.display_prompt:
        session.write(prompt)
    if not ids:
        raise UsageError("the prompt is empty (it encodes to no tokens)")
    result = session.generate(ids)
    if not args.stream:
        session.write(session.answer(result.text))
    _newline_if_needed(out, session)
    _report_end(args, session, result, err)
    return 0


def _report_end(args, session, result, err) -> None:
    """The one-shot run's summary on stderr; with --verbose, speculation and first-text times."""
    err.write(_summary(session.totals))
    if args.verbose and result.speculation is not None:
        s = result.speculation
        err.write(
            f"speculation: {s.verify_steps} verification steps, {s.accepted} of {s.drafted} "
            f"drafted tokens accepted ({s.tokens_per_step:.2f} tokens per step), "
            f"{s.plain_chunks} plain chunks\n"
        )
    if args.verbose and session.first_text_at is not None:
        err.write(
            format_phase("first text after the process started", session.first_text_at) + "\n"
        )
    err.flush()


def _encode(tok, prompt: str, chat_base: list | None) -> list[int]:
    """The one-shot prompt's ids: plain, or (chat_base: the system message or none) as one user
    turn through the chat template."""
    if chat_base is None:
        return tok.encode(prompt)
    turn = chat_base + [{"role": "user", "content": prompt}]
    return tok.encode(tok.apply_chat_template(turn), add_special=False)


def _print_details(err, model, gguf_model, path, max_len, load_s, seed, sampler, phases) -> None:
    """--verbose: the model, backend, seed, sampler and each load phase on stderr."""
    import jax

    cfg, trained = model.config, gguf_model.config.context_length
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


def _interactive(session: _Session, base: list[dict], turns: int | None = None) -> int:
    """The chat loop (turns: replies before it ends by itself, -st; None: until /exit)."""
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
            checked_text("the message", text)
        except UsageError as e:
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
        if turns is not None and turn >= turns:
            break
    if session.totals.turns:
        err.write(f"{session.totals.turns} replies; totals:\n" + _summary(session.totals))
        err.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
