"""The FastAPI application: OpenAI-compatible routes over one Backend (backend.py).

    POST /v1/completions, /v1/chat/completions   (streamed as SSE, or one JSON object with usage)
    GET  /v1/models, /health, /metrics

The port opens at once; the model loads in a background thread, and until it has loaded /health
and every /v1 route answer 503 (500 once it has failed to load). Every error is an OpenAI-style body
{"error": {"message", "type", "param", "code"}}: 400 for a malformed request or any MinferError
of the engine (prompt over the context, token id outside the vocabulary, ...), 401 for a wrong
API key, 403 for a Host or Origin refused and 415 for a body not declared JSON (guards.py), 413 for
a body over its limit (limits.py), 429 when every slot is busy and the queue is full. A client that
disconnects cancels its request, which frees its slot at the scheduler's next step.

A generation request, in order: the key, the limits (the body read in pieces up to its limit),
then in worker threads, so that /health and running streams never wait for them: JSON parsing with
the cheap counts checked first, the prompt's length in characters, tokenization that stops as soon
as a prefix shows the prompt cannot fit (files/prompts.py), the chat template (its own 1 s budget)
with message content kept literal unless --parse-special-in-content.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer_jax import validate
from minfer_jax.errors import MinferError
from minfer_jax.files import harmony
from minfer_jax.server import metrics
from minfer_jax.server.anthropic import add_messages_routes
from minfer_jax.server.backend import Backend, Handle, ServerBusy, ServerSettings, ShuttingDown
from minfer_jax.server.guards import AccessGuard, AccessPolicy
from minfer_jax.server.limits import ClientGone, RequestLimits, client_gone, longest_token_chars
from minfer_jax.server.openai_format import LogprobFormat, Reply, error_body, usage
from minfer_jax.server.reasoning import reply_thinks, split_reasoning
from minfer_jax.server.schemas import (
    SEED_MAX,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from minfer_jax.server.speculation import request_speculation, timings
from minfer_jax.server.streaming import choices_usage, stream_choices
from minfer_jax.server.tools import CallFormat, parse_reply, tool_constraint, tool_setup

# a non-streamed request checks this often whether its client is still there
DISCONNECT_POLL_S = 0.5
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
READ_METHODS = ["GET", "HEAD"]  # RFC 9110: HEAD wherever GET (load balancers probe /health so)


class ApiError(Exception):
    """An error response: HTTP status and the OpenAI-style body's fields."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def _error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=headers
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_, e: ApiError):
        return _error_response(e)

    @app.exception_handler(BadRequest)
    async def _bad(_, e: BadRequest):
        return _error_response(ApiError(e.status, str(e), "invalid_request_error", e.param))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, _):
        client_gone(request)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(ServerBusy)
    async def _busy(_, e: ServerBusy):
        return _error_response(
            ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded"),
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(MinferError)
    async def _engine(_, e: MinferError):
        return _error_response(ApiError(400, str(e), "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # e.headers: a 405's Allow, which HTTP requires
        return _error_response(ApiError(e.status_code, str(e.detail), kind), headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):
        return _error_response(
            ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
        )


def _text_prompt_ids(model, prompt: str | list[int], limit: int) -> list[int]:
    """A completion's prompt as ids: text tokenized (at most `limit` tokens), ids checked."""
    from minfer_jax.files.prompts import encode_within

    try:
        if not isinstance(prompt, str):
            return validate.token_ids(prompt, model.config.vocab_size, "prompt")
        if model.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as token ids", "prompt")
        return encode_within(model.tokenizer, prompt, limit)
    except MinferError as e:  # token ids outside the vocabulary, more tokens than the context holds
        raise BadRequest(str(e), "prompt") from None


def _chat_prompt_ids(
    model, messages: list[dict], limit: int, literal: bool, template_kwargs: dict | None = None
) -> list[int]:
    """Messages rendered with the chat template and tokenized (at most `limit` tokens). A last
    assistant message without calls is a prefill, as llama-server and Anthropic take it: the
    reply continues its text (rendered after the template's generation prompt)."""
    from minfer_jax.files.prompts import encode_chat, encode_within

    prefill = None
    if (
        len(messages) > 1
        and messages[-1]["role"] == "assistant"
        and "tool_calls" not in messages[-1]
    ):
        *messages, last = messages
        prefill = last["content"]
        if model.tokenizer is not None and model.tokenizer.harmony:  # it would need a channel
            raise BadRequest("an assistant message last (a prefill) is not supported for "
                             "gpt-oss (harmony)", "messages")  # fmt: skip
        if last.get("reasoning_content"):  # the template renders thinking only in closed turns
            raise BadRequest("an assistant message last (a prefill) continues its content: its "
                             "reasoning_content cannot be rendered", "messages")  # fmt: skip

    if model.tokenizer is None:
        raise BadRequest(
            "this model has no tokenizer (and so no chat template): use /v1/completions with "
            "token ids",
            "messages",
        )
    try:
        ids = encode_chat(
            model.tokenizer, messages, limit, literal=literal, template_kwargs=template_kwargs
        )
        if prefill:
            ids += encode_within(model.tokenizer, prefill, limit - len(ids), add_special=False,
                                 parse_special=not literal)  # fmt: skip
        return ids
    except MinferError as e:  # the template refused or failed, more tokens than the context holds
        raise BadRequest(str(e), "messages") from None


async def _wait(request: Request, handle: Handle) -> bool:
    """Wait for a non-streamed request; False (and cancelled) when its client went away first."""
    try:
        while not handle.done.done():
            await asyncio.wait({handle.done}, timeout=DISCONNECT_POLL_S)
            if not handle.done.done() and await request.is_disconnected():
                return False
        return True
    finally:
        handle.cancel()


def _authorize(backend: Backend, request: Request) -> None:
    key = backend.settings.api_key
    if key is None:
        return
    # bytes as sent and as typed: headers hold latin-1 text, argv UTF-8 with surrogate escapes
    got = request.headers.get("authorization", "").encode("latin-1")
    if not secrets.compare_digest(got, f"Bearer {key}".encode("utf-8", "surrogateescape")):
        raise ApiError(
            401,
            "invalid API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
        )


def _unavailable(message: str) -> ApiError:
    """503: the model is still loading, or the server is shutting down."""
    return ApiError(503, message, "unavailable_error", code=503)


def _failed(error: BaseException) -> ApiError:
    """The reply to a request that ended with an error: 503 for a server going down, 400 for its
    own input (a grammar past its parser's limits at a later token), else 500."""
    if isinstance(error, ShuttingDown):
        return _unavailable(str(error))
    if isinstance(error, MinferError):  # the request's own input, found out mid-generation
        return ApiError(400, f"generation stopped: {error}", "invalid_request_error")
    return ApiError(500, f"generation failed: {type(error).__name__}: {error}", "server_error")


def _load_failed(backend: Backend) -> ApiError:
    return ApiError(500, f"the model failed to load: {backend.error}", "server_error")


def _ready(backend: Backend, request: Request) -> Backend:
    _authorize(backend, request)
    if backend.closing.is_set():
        raise _failed(ShuttingDown())
    if not backend.ready.is_set():  # as /health answers: never going to load, or not yet
        if backend.error is not None:
            raise _load_failed(backend)
        raise _unavailable("Loading model")
    return backend


def _constraint(model, body, fmt: CallFormat | None = None):
    """The request's token constraint (its schema or grammar compiled, a forced tool call, or
    EOS banned), built in a worker thread: a grammar compiles off the scheduler's loop."""
    asked = tool_constraint(fmt, body, body.output_constraint())
    field, keywords = asked[0] if asked else ("ignore_eos", {"ignore_eos": body.ignore_eos})
    try:
        return model.constraint(**keywords)
    except MinferError as e:  # a schema or grammar llguidance refuses or cannot bound
        raise BadRequest(str(e), field) from None


async def _reply(
    backend: Backend,
    request: Request,
    kind: str,
    body,
    handles: list[Handle],
    calls: CallFormat | None = None,
    think: bool | None = None,
):
    """A submitted request's (its n choices') SSE stream, or its JSON once done (calls, think: as
    stream_choices takes them)."""
    tokenizer = backend.model.tokenizer
    reply = Reply(kind, backend.model_id, harmony=tokenizer is not None and tokenizer.harmony)
    logprobs = None
    if body.top_alternatives is not None:
        logprobs = functools.partial(LogprobFormat, kind, tokenizer)
    if body.stream:
        return StreamingResponse(
            stream_choices(handles, reply, body.include_usage, calls, think, logprobs, _failed),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    for handle in handles:
        if not await _wait(request, handle):
            for other in handles:
                other.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    for handle in handles:
        if handle.req.error is not None:
            raise _failed(handle.req.error)
    results = [h.req.result() for h in handles]
    choices = []
    for index, result in enumerate(results):
        choice_reply = reply if index == 0 else reply.sibling()
        reasoning, text = (
            (None, result.text) if think is None else split_reasoning(result.text, think)
        )
        reason = result.stop_reason
        text, made = parse_reply(calls, text, reason) if calls is not None else (text, [])
        lp = None if logprobs is None else logprobs()(result.logprobs or [])
        whole = choice_reply.full(
            text, result.stop_reason, 0, 0, 0, made, reasoning, index=index, logprobs=lp
        )
        choices += whole["choices"]
    reply_body = {**whole, "choices": choices, "usage": usage(*choices_usage(results))}
    spec_timings = timings(results)
    if spec_timings is not None:  # llama-server's draft counts
        reply_body["timings"] = spec_timings
    return JSONResponse(reply_body)


async def _submit_choices(
    backend: Backend, kind: str, body, ids: list[int], calls=None
) -> list[Handle]:
    """The request's n choices queued: the first prefills, the others share it (seed + i each:
    distinct, reproducible with a seed given)."""
    s = backend.settings
    if body.n > s.n_parallel + s.queue_limit:
        raise BadRequest(
            f"n={body.n} choices are more than this server runs and queues at once "
            f"({s.n_parallel} slots + {s.queue_limit} queued)",
            "n",
        )
    seed = s.seed_of(body.seed)
    handles: list[Handle] = []
    try:
        for index in range(body.n):
            choice_seed = (seed + index) % (SEED_MAX + 1)
            leader = handles[0] if handles else None
            handles.append(await _submit(backend, kind, body, ids, calls, choice_seed, leader))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def _submit(
    backend: Backend, kind: str, body, ids: list[int], calls=None, seed=None, leader=None
) -> Handle:
    """The request's constraint built (off the loop) and one generation queued (seed: body.seed
    unless given; leader: the choice whose prefill this one shares)."""
    from minfer_jax.engine.sampling import sampler_of

    constraint = await run_in_threadpool(_constraint, backend.model, body, calls)
    ctx, vocab = backend.scheduler.plan.ctx, backend.model.config.vocab_size
    speculation = request_speculation(
        backend.settings.speculation, body, backend.model.config, constraint, body.top_alternatives
    )
    # extreme counts are clamped (validate.clamped_count), as generate() and the CLI do
    wanted = backend.settings.n_predict if body.max_tokens is None else body.max_tokens
    max_tokens = validate.clamped_count("max_tokens", wanted, ctx, all_of="the context")
    sampler = sampler_of(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        repeat_last_n=body.repeat_last_n,
        history_cap=ctx,
        vocab=vocab,
    )
    try:
        handle = backend.submit(
            ids,
            max_tokens=max_tokens,
            sampler=sampler,
            seed=body.seed if seed is None else seed,
            stop=body.stops,
            stream=body.stream,
            constraint=constraint,
            logprobs=body.top_alternatives,
            leader=leader,
            speculation=speculation,
        )
    except ServerBusy:
        raise
    except ShuttingDown as e:
        raise _failed(e) from None
    except MinferError as e:  # the scheduler's checks: empty prompt, over the context, bad token id
        raise BadRequest(str(e), "messages" if kind == "chat" else "prompt") from None
    return handle


class _Admission:
    """The request limits for the loaded model, flags with their defaults resolved (the longest
    token needs the vocabulary), and the literal-content tokenizer built: both once, as soon as
    the model has loaded (prepare_when_ready), or by the first request if that comes sooner.
    Building the tokenizer copy holds the interpreter for ~1 s: better then than mid-serving."""

    def __init__(self, backend: Backend, limits: RequestLimits, literal_content: bool):
        self.backend, self.limits, self.literal_content = backend, limits, literal_content
        self.resolved: RequestLimits | None = None

    def _resolve(self) -> RequestLimits:
        backend = self.backend
        tok = backend.model.tokenizer
        if tok is not None and self.literal_content:
            tok.encode("", parse_special=False)  # builds the literal backend now
        longest = 1 if tok is None else longest_token_chars(tok)
        with contextlib.suppress(MinferError):  # no llguidance: constrained requests say so
            backend.model.grammars.ll_tokenizer()  # ~1 s for a 150k vocabulary: not mid-serving
        self.resolved = self.limits.for_model(backend.scheduler.plan.ctx, longest)
        return self.resolved

    async def limits_for(self, request: Request) -> RequestLimits:
        _ready(self.backend, request)
        return self.resolved or await run_in_threadpool(self._resolve)

    async def prepare_when_ready(self) -> None:
        while not self.backend.ready.is_set():
            if self.backend.error is not None:
                return
            await asyncio.sleep(0.1)
        if self.resolved is None:
            await run_in_threadpool(self._resolve)


def _add_generation_routes(
    app: FastAPI, backend: Backend, admission: _Admission, literal_content: bool
) -> None:
    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(request: Request):
        limits = await admission.limits_for(request)
        ctx = backend.scheduler.plan.ctx
        with backend.preparing_request():
            raw = await limits.read_body(request)
            body = await run_in_threadpool(
                parse, CompletionRequest, raw, lambda data: limits.check_json(data, ctx)
            )
            del raw  # the largest copy of the prompt: not kept while the request runs
            ids = await run_in_threadpool(_text_prompt_ids, backend.model, body.prompt, ctx - 1)
            body.prompt = ids
            handles = await _submit_choices(backend, "text", body, ids)
        return await _reply(backend, request, "text", body, handles)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(request: Request):
        limits = await admission.limits_for(request)
        ctx = backend.scheduler.plan.ctx
        with backend.preparing_request():
            raw = await limits.read_body(request)
            body = await run_in_threadpool(
                parse, ChatCompletionRequest, raw, lambda data: limits.check_json(data, ctx)
            )
            del raw
            ids, calls, think = await prepare_chat(body, limits)
            handles = await _submit_choices(backend, "chat", body, ids, calls)
        return await _reply(backend, request, "chat", body, handles, calls, think)

    async def prepare_chat(body: ChatCompletionRequest, limits: RequestLimits, count=False):
        """A chat body's prompt ids, tool-call format and thinking (as _reply takes them); count:
        only counted (count_tokens), so not held to the context (its characters are bounded)."""
        messages = [m.as_template_message() for m in body.messages]
        body.messages = []
        chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages)
        limits.check_chars(chars, "messages")
        tokenizer = backend.model.tokenizer
        if tokenizer is not None and tokenizer.harmony:
            messages = harmony.template_messages(messages)
        calls, tools = tool_setup(backend.model, body)
        ids = await run_in_threadpool(
            _chat_prompt_ids,
            backend.model,
            messages,
            sys.maxsize if count else backend.scheduler.plan.ctx - 1,
            literal_content,
            {**(body.chat_template_kwargs or {}), **tools},
        )
        return ids, calls, reply_thinks(backend.model, ids)

    add_messages_routes(
        app, backend, admission, prepare_chat, functools.partial(_submit, backend), _wait, _failed
    )


def _add_info_routes(app: FastAPI, backend: Backend, admission: _Admission) -> None:
    @app.api_route("/v1/models", methods=READ_METHODS)
    @app.api_route("/models", methods=READ_METHODS, include_in_schema=False)
    async def models(request: Request):
        limits = await admission.limits_for(request)
        b = backend
        cfg, plan = b.model.config, b.scheduler.plan
        meta = {
            "n_vocab": cfg.vocab_size,
            "n_ctx": plan.ctx,
            "n_ctx_train": cfg.context_length,
            "n_parallel": plan.n_seqs,
            "n_embd": cfg.d_model,
            "max_body_bytes": limits.max_body_bytes,
            "max_prompt_chars": limits.max_prompt_chars,
            "max_messages": limits.max_messages,
        }
        return {
            "object": "list",
            "data": [
                {
                    "id": b.model_id,
                    "object": "model",
                    "created": int(b.started),
                    "owned_by": "minfer_jax",
                    "meta": meta,
                }
            ],
        }

    @app.api_route("/health", methods=READ_METHODS)
    @app.api_route("/v1/health", methods=READ_METHODS, include_in_schema=False)
    async def health():
        status = backend.status
        if status == "ok":
            return {"status": "ok"}
        if status == "loading":
            return _error_response(_unavailable("Loading model"))
        return _error_response(_load_failed(backend))

    @app.api_route("/metrics", methods=READ_METHODS)
    async def prometheus(request: Request):
        _authorize(backend, request)
        return PlainTextResponse(metrics.render(backend), media_type=metrics.CONTENT_TYPE)


def create_app(
    settings: ServerSettings,
    *,
    loader=None,
    on_fatal=None,
    limits: RequestLimits = RequestLimits(),
    access: AccessPolicy | None = None,
    literal_content: bool = True,
) -> FastAPI:
    """The app for these settings; the model starts loading when the app starts (its lifespan).

    limits: what one request may cost (limits.py); access: Host/Origin/Content-Type checks
    (guards.py; default: loopback names only unless settings has an API key); literal_content:
    special-token text in chat message content stays text (files/prompts.py)."""
    backend = Backend(settings, loader=loader, on_fatal=on_fatal)
    if access is None:
        access = AccessPolicy.build(api_key=settings.api_key, listen_host="127.0.0.1")

    admission = _Admission(backend, limits, literal_content)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        backend.start()
        preparing = asyncio.create_task(admission.prepare_when_ready())
        try:
            yield
        finally:
            preparing.cancel()
            await run_in_threadpool(backend.close)

    app = FastAPI(
        title="minfer_jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.backend = backend
    app.add_middleware(AccessGuard, policy=access)
    _install_error_handlers(app)
    _add_generation_routes(app, backend, admission, literal_content)
    _add_info_routes(app, backend, admission)
    return app
