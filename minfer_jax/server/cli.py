"""`python scripts/serve.py` (also `python -m minfer_jax.server`): the OpenAI-compatible server.

Flags follow llama-server's spelling: -m, --host, --port, -np/--parallel, -c/--ctx-size (the
total context, divided among the -np slots), -n/--n-predict, -a/--alias, --api-key, --no-warmup,
and the CLI's speculative-decoding flags (--spec-type, --spec-draft-n-max / --draft-max, ...:
engine/spec_flags.py; per request: server/speculation.py).
Request limits (limits.py: --max-body-bytes, --max-prompt-chars, --max-messages) and access
checks (guards.py: --allowed-hosts, --any-content-type) have no llama-server spelling;
--parse-special-in-content makes special-token text in chat messages control tokens again.
The port opens before the model has loaded (/health answers 503 until it has). A bad flag prints
one `error:` line and exits with 2; a model that fails to load stops the server with exit 1;
SIGINT (Ctrl-C) shuts down gracefully and exits with 130.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

from minfer_jax.engine import options
from minfer_jax.engine.flags import StrictParser, add_llama_noops, add_llama_refusals
from minfer_jax.engine.spec_flags import add_speculative_flags, speculation_from_args
from minfer_jax.errors import MinferError
from minfer_jax.server.backend import DEFAULT_DECODE_STEPS, DEFAULT_SLOT_CTX
from minfer_jax.server.limits import DEFAULT_MAX_MESSAGES

PROG = "serve.py"
EXIT_LOAD_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT, after uvicorn's graceful shutdown

EPILOG = """\
examples:
  %(prog)s -m model.gguf --host 127.0.0.1 --port 8080 -np 8 -c 32768
  %(prog)s -np 4 --api-key secret          # the built-in default model, 4 slots of 4096 tokens
endpoints: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics
"""


class _UsageError(Exception):
    pass


class _Parser(StrictParser):
    def error(self, message):  # one line, not usage + message
        raise _UsageError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="OpenAI-compatible HTTP server for a GGUF model (Qwen2, Llama, Qwen3, Gemma 3; "
        "minfer_jax).",
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-m",
        "--model",
        metavar="REF",
        default=None,
        help="GGUF path or hf:<repo>:<file> (default: the built-in model, the `model` extra)",
    )
    _serving_arguments(p.add_argument_group("serving"))
    _access_arguments(p.add_argument_group("requests and access"))
    _engine_arguments(p.add_argument_group("engine"))
    add_llama_noops(p.add_argument_group("llama.cpp flags that mean nothing here"))
    add_llama_refusals(
        p,
        PROG,
        hints={
            "ignore_eos": "send ignore_eos in the request",
            "reverse_prompt": "send stop in the request",
        },
    )
    return p


def _serving_arguments(p) -> None:
    p.add_argument(
        "-a",
        "--alias",
        metavar="NAME",
        default=None,
        help="model id for /v1/models (default: file name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="sequences decoded at once: KV cache slots (default 1)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        metavar="N",
        help=f"total context in tokens, divided among the -np slots (default 0: {DEFAULT_SLOT_CTX} "
        "per slot, at most the model's trained context)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=-1,
        metavar="N",
        help="default max_tokens of a request (default -1: until the slot's context is full)",
    )
    p.add_argument(
        "-s",
        "--seed",
        type=int,
        default=-1,
        metavar="N",
        help="seed of the requests that give none, 0..2^32-1: replies reproducible (default -1: a "
        "random seed each)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=None,
        metavar="N",
        help="requests that may wait for a slot; more get 429 (default 4 x -np)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=DEFAULT_DECODE_STEPS,
        metavar="N",
        help="tokens per decode executable; text streams once per such chunk (default "
        f"{DEFAULT_DECODE_STEPS}: every token as it is made; 16 trades that for throughput at few "
        "clients)",
    )


def _access_arguments(p) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=0,
        metavar="N",
        help="largest request body; more gets 413 (default 0: 8 bytes per --max-prompt-chars, >= "
        "1 MiB)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=0,
        metavar="N",
        help="longest prompt (or chat messages' content) in characters, refused before tokenizing "
        "(default 0: the slot's context x the longest token, what could fit)",
    )
    p.add_argument(
        "--max-messages",
        type=int,
        default=DEFAULT_MAX_MESSAGES,
        metavar="N",
        help=f"most messages in a chat request (default {DEFAULT_MAX_MESSAGES}, OpenAI's)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        metavar="H1,H2",
        help="without --api-key, Host/Origin names answered besides localhost, 127.0.0.1, ::1 and "
        "the --host address ('*': any; default: none)",
    )
    p.add_argument(
        "--any-content-type",
        action="store_true",
        help="accept POST bodies whatever their Content-Type (default: application/json only)",
    )
    p.add_argument(
        "--parse-special-in-content",
        action="store_true",
        help="let special-token text in chat message content (<|im_start|>, ...) become control "
        "tokens, as transformers and llama-server do (default: it stays literal text)",
    )


def _engine_arguments(p) -> None:
    options.add_arguments(p)
    add_speculative_flags(p)
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling the first executables before /health reports ok",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default info)",
    )


def settings_from(args):
    from minfer_jax.server.backend import ServerSettings

    if not 0 <= args.port <= 65535:
        raise _UsageError(f"--port must be in 0..65535, got {args.port}")
    speculation = speculation_from_args(args)
    if speculation is not None and speculation.on_device:  # its step drafts one sequence alone
        raise _UsageError(
            f"--spec-type {args.spec_type} (the MTP drafter) is not served yet: the server "
            "speculates with ngram-simple; the CLI and generate() take draft-mtp"
        )
    return ServerSettings(
        model=args.model,
        n_parallel=args.parallel,
        ctx_size=args.ctx_size,
        n_predict=args.n_predict,
        max_queued=args.max_queued,
        decode_steps=args.decode_steps,
        alias=args.alias,
        api_key=args.api_key,
        warmup=args.warmup,
        options=options.from_arguments(args),
        speculation=speculation,
        seed=args.seed,
    )


def http_options_from(args) -> dict:
    """create_app's request limits, access policy and chat-content mode from the flags."""
    from minfer_jax.server.guards import AccessPolicy
    from minfer_jax.server.limits import RequestLimits

    limits = RequestLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_messages=args.max_messages,
    )
    access = AccessPolicy.build(
        api_key=args.api_key,
        listen_host=args.host,
        extra_hosts=args.allowed_hosts.split(","),
        any_content_type=args.any_content_type,
    )
    return {
        "limits": limits,
        "access": access,
        "literal_content": not args.parse_special_in_content,
    }


def _warn_open(args, access) -> None:
    """A server on every interface without a key still answers only loopback Host names: say so."""
    from minfer_jax.server.guards import WILDCARD_ADDRESSES, host_name

    if access.allowed_hosts is not None and host_name(args.host) in WILDCARD_ADDRESSES:
        print(
            f"warning: listening on {args.host} without --api-key: only requests addressed to "
            f"{', '.join(sorted(access.allowed_hosts))} are answered (--api-key or "
            "--allowed-hosts for others)",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None, loader: Callable | None = None) -> int:
    """The server's command line; loader: what turns -m into a Model (default runtime.load)."""
    try:
        args = build_parser().parse_args(argv)
        settings = settings_from(args)
        http = http_options_from(args)
    except (_UsageError, MinferError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    import uvicorn

    from minfer_jax.server.app import create_app

    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:
        print(f"error: the model failed to load: {type(error).__name__}: {error}", file=sys.stderr)
        if server is not None:
            server.should_exit = True

    _warn_open(args, http["access"])
    app = create_app(settings, loader=loader, on_fatal=on_fatal, **http)

    class Server(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig, frame) -> None:
            # the first signal: queued requests end now (503), running ones get the grace period
            self.interrupted = self.interrupted or sig == signal.SIGINT
            app.state.backend.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled once it has shut down
        return EXIT_INTERRUPTED
    if server.interrupted:  # not re-raised (seen when the grace period cut a stream): still 130
        return EXIT_INTERRUPTED
    return EXIT_LOAD_FAILED if app.state.backend.error is not None else 0
