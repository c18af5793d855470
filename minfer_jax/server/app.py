"""The FastAPI application: OpenAI-compatible routes over one Backend (backend.py).

    POST /v1/completions, /v1/chat/completions   (streamed as SSE, or one JSON object with usage)
    GET  /v1/models, /health, /metrics

The port opens at once; the model loads in a background thread, and until it has loaded /health
and every /v1 route answer 503. Every error is an OpenAI-style body
{"error": {"message", "type", "param", "code"}}: 400 for a malformed request or any MinferError
of the engine (prompt over the context, token id outside the vocabulary, ...), 401 for a wrong
API key, 429 when every slot is busy and the queue is full. A client that disconnects cancels its
request, which frees its slot at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer_jax.errors import MinferError
from minfer_jax.server import metrics
from minfer_jax.server.backend import Backend, Handle, ServerBusy, ServerSettings
from minfer_jax.server.openai_format import Reply, error_body, sse
from minfer_jax.server.schemas import BadRequest, ChatCompletionRequest, CompletionRequest, parse

DISCONNECT_POLL_S = 0.5  # a non-streamed request checks this often whether its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiError(Exception):
    """An error response: HTTP status and the OpenAI-style body's fields."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _error_response(e: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_, e: ApiError):
        return _error_response(e)

    @app.exception_handler(BadRequest)
    async def _bad(_, e: BadRequest):
        return _error_response(ApiError(400, str(e), "invalid_request_error", e.param))

    @app.exception_handler(ServerBusy)
    async def _busy(_, e: ServerBusy):
        return _error_response(ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded"),
                               headers={"Retry-After": "1"})

    @app.exception_handler(MinferError)
    async def _engine(_, e: MinferError):
        return _error_response(ApiError(400, str(e), "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))


def _text_prompt_ids(model, prompt) -> list[int]:
    from minfer_jax.engine.runtime import prompt_ids

    try:
        return prompt_ids(model, prompt)
    except MinferError as e:  # token ids outside the vocabulary, text that is not valid UTF-8
        raise BadRequest(str(e), "prompt") from None


def _chat_prompt_ids(model, messages: list[dict]) -> list[int]:
    tok = model.tokenizer
    if tok is None:
        raise BadRequest("this model has no tokenizer (and so no chat template): use /v1/completions with "
                         "token ids", "messages")
    return tok.encode(tok.apply_chat_template(messages), add_special=False)


async def _stream(handle: Handle, reply: Reply, include_usage: bool):
    """SSE events of one request; leaving early (client gone) cancels it."""
    try:
        if reply.kind == "chat":
            yield sse(reply.chunk(role=True))
        async for piece in handle.pieces():
            yield sse(reply.chunk(piece))
        req = handle.req
        if req.error is not None:
            yield sse(error_body(f"generation failed: {type(req.error).__name__}: {req.error}", "server_error"))
            return
        result = req.result()
        yield sse(reply.chunk(reason=result.stop_reason))
        if include_usage:
            yield sse(reply.usage_chunk(len(result.prompt_tokens), len(result.tokens), result.cached_tokens))
        yield sse("[DONE]")
    finally:
        handle.cancel()


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
    got = request.headers.get("authorization", "").encode()
    if not secrets.compare_digest(got, f"Bearer {key}".encode()):
        raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>'", "authentication_error",
                       code="invalid_api_key")


def _ready(backend: Backend, request: Request) -> Backend:
    _authorize(backend, request)
    if not backend.ready.is_set():
        raise ApiError(503, "Loading model", "unavailable_error", code=503)
    return backend


async def _generate(backend: Backend, request: Request, kind: str, body, ids: list[int]):
    """Submit one validated request; its SSE stream, or its JSON once done."""
    from minfer_jax.engine.sampling import sampler_of

    sampler = sampler_of(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                         repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n)
    try:
        handle = backend.submit(ids, max_tokens=body.max_tokens, sampler=sampler, seed=body.seed,
                                stop=body.stops, stream=body.stream)
    except ServerBusy:
        raise
    except MinferError as e:  # the scheduler's checks: empty prompt, over the context, bad token id
        raise BadRequest(str(e), "messages" if kind == "chat" else "prompt") from None
    reply = Reply(kind, backend.model_id)
    if body.stream:
        return StreamingResponse(_stream(handle, reply, body.include_usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await _wait(request, handle):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    req = handle.req
    if req.error is not None:
        raise ApiError(500, f"generation failed: {type(req.error).__name__}: {req.error}", "server_error")
    result = req.result()
    return JSONResponse(reply.full(result.text, result.stop_reason, len(result.prompt_tokens), len(result.tokens),
                                  result.cached_tokens))


def _add_generation_routes(app: FastAPI, backend: Backend) -> None:
    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(request: Request):
        model = _ready(backend, request).model
        body = parse(CompletionRequest, await request.body())
        ids = await run_in_threadpool(_text_prompt_ids, model, body.prompt)
        return await _generate(backend, request, "text", body, ids)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(request: Request):
        model = _ready(backend, request).model
        body = parse(ChatCompletionRequest, await request.body())
        messages = [m.as_template_message() for m in body.messages]
        ids = await run_in_threadpool(_chat_prompt_ids, model, messages)
        return await _generate(backend, request, "chat", body, ids)


def _add_info_routes(app: FastAPI, backend: Backend) -> None:
    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models(request: Request):
        b = _ready(backend, request)
        cfg, plan = b.model.config, b.scheduler.plan
        meta = {"n_vocab": cfg.vocab_size, "n_ctx": plan.ctx, "n_ctx_train": cfg.context_length,
                "n_parallel": plan.n_seqs, "n_embd": cfg.d_model}
        return {"object": "list", "data": [{"id": b.model_id, "object": "model", "created": int(b.started),
                                            "owned_by": "minfer_jax", "meta": meta}]}

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health():
        status = backend.status
        if status == "ok":
            return {"status": "ok"}
        if status == "loading":
            return _error_response(ApiError(503, "Loading model", "unavailable_error", code=503))
        return _error_response(ApiError(500, f"the model failed to load: {backend.error}", "server_error"))

    @app.get("/metrics")
    async def prometheus(request: Request):
        _authorize(backend, request)
        return PlainTextResponse(metrics.render(backend), media_type=metrics.CONTENT_TYPE)


def create_app(settings: ServerSettings, *, loader=None, on_fatal=None) -> FastAPI:
    """The app for these settings; the model starts loading when the app starts (its lifespan)."""
    backend = Backend(settings, loader=loader, on_fatal=on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        backend.start()
        try:
            yield
        finally:
            await run_in_threadpool(backend.close)

    app = FastAPI(title="minfer_jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    _install_error_handlers(app)
    _add_generation_routes(app, backend)
    _add_info_routes(app, backend)
    return app
