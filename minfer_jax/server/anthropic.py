"""Anthropic's Messages API over the same engine: POST /v1/messages and
/v1/messages/count_tokens (what Claude Code and the `anthropic` client call).

A Messages body becomes a chat body (system prompt, text / thinking / tool_use / tool_result blocks
as messages, tools, tool_choice, stop_sequences, thinking as the template's enable_thinking) and
runs through the chat path (template, tool-call format, constraint, scheduler; gpt-oss's harmony
template included); the reply comes back as content blocks (thinking, text, tool_use), whole or
streamed with Anthropic's events (anthropic_reply.py).
Errors are Anthropic's {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from minfer_jax.errors import MinferError
from minfer_jax.server.anthropic_reply import (
    BlockSplit,
    EventStream,
    error_event,
    matched,
    stop_reason,
    usage,
    whole_content,
)
from minfer_jax.server.schemas import (
    BadRequest,
    ChatCompletionRequest,
    FunctionName,
    StopStrings,
    Text,
    parse,
    refusal,
    text_only,
)

TOOL_ERROR = "Error: "  # before the content of a tool_result with is_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # a caching hint: prefix reuse is always on

    _text_only = model_validator(mode="before")(text_only)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


Block = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Tool(_Strict):
    type: Literal["custom"] | None = None  # a client-run tool, as every tool here is
    name: FunctionName
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    stop_sequences: StopStrings | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None  # describes the caller
    service_tier: str | None = None  # describes the caller
    # accepted and ignored (schemas.parse): they describe the caller or where it is served, or hint
    # at caching (prefix reuse is always on); none changes the reply
    caller_fields: ClassVar[tuple[str, ...]] = (
        "cache_control",
        "inference_geo",
        "user_profile_id",
        "workspace_id",
    )
    # settings accepted only at their no-op values (schemas.parse)
    unsupported: ClassVar[dict[str, tuple]] = {"speed": (None, "standard")}

    @property
    def thinks(self) -> bool:
        """The reply may hold thinking blocks (the request enables thinking)."""
        return self.thinking is not None and self.thinking.type == "enabled"


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _messages(req: MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function",
                 "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in blocks if isinstance(b, ToolUseBlock)
            ]  # fmt: skip
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
            out.append(
                {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                 **({"reasoning_content": thought} if thought else {})}
            )  # fmt: skip
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                # a failed call says so in the text: a chat template has no field for it
                result = f"{TOOL_ERROR}{_text(b.content)}" if b.is_error else _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def _function(tool: Tool) -> dict:
    fn = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat body this Messages body asks for (Anthropic's defaults: no top-k/p filters)."""
    body: dict[str, Any] = {
        "messages": _messages(req),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": 0.0,
        "stream": req.stream,
        "stop": req.stop_sequences,
    }
    if req.tools:
        body["tools"] = [_function(t) for t in req.tools]
    choice = req.tool_choice
    if choice is not None:  # any or tool without tools: the chat body's 400
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name or ""}}
        )
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:  # a check of the chat path's that the Messages fields lack
        raise refusal(e) from None


def error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status
    )


async def _stream(handle, events: EventStream, n_prompt: int):
    """Anthropic's events for one request; leaving early (client gone) cancels it."""
    try:
        for e in events.start(n_prompt):
            yield e
        async for piece in handle.pieces():
            for e in events.piece(piece):
                yield e
        req = handle.req
        if req.error is not None:
            yield error_event(str(req.error))
            return
        result = req.result()
        for e in events.end(
            result.text,
            result.stop_reason,
            n_prompt,
            len(result.tokens),
            result.cached_tokens,
            result.stop_string,
        ):
            yield e
    finally:
        handle.cancel()


def _drop_null_block_fields(data: dict) -> None:
    """null is "not given" inside content blocks too (the client echoes a reply's blocks with
    fields it has no value for)."""
    for message in data.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict):
                for key in [k for k, v in block.items() if v is None]:
                    del block[key]


def add_messages_routes(
    app: FastAPI, backend, admission, prepare_chat, submit, wait, failed
) -> None:
    """POST /v1/messages and /v1/messages/count_tokens; prepare_chat, submit, wait, failed (the
    error a request that ended with one answers): the chat path's steps (app.py), passed in so
    that this module does not import the app."""

    async def chat_of(request: Request, kind: type[MessagesRequest]):
        limits = await admission.limits_for(request)
        raw = await limits.read_body(request)
        ctx = backend.scheduler.plan.ctx

        def check(data: dict) -> None:
            limits.check_json(data, ctx)
            _drop_null_block_fields(data)

        body = await run_in_threadpool(parse, kind, raw, check)
        chat = to_chat(body)
        ids, calls, think = await prepare_chat(chat, limits, kind is CountTokensRequest)
        return body, chat, ids, calls, think

    async def answered(request: Request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return error(400, str(e))
        except MinferError as e:
            status = 429 if type(e).__name__ == "ServerBusy" else 400
            return error(status, str(e))
        except Exception as e:  # the app's ApiError (not ready, wrong key): its status kept
            if hasattr(e, "status") and hasattr(e, "message"):
                return error(e.status, e.message)
            raise

    async def messages(request: Request):
        with backend.preparing_request():
            body, chat, ids, calls, think = await chat_of(request, MessagesRequest)
            handle = await submit("chat", chat, ids, calls)
        tokenizer = backend.model.tokenizer
        harmony = tokenizer is not None and tokenizer.harmony
        split = BlockSplit(calls, think, harmony, show_thinking=body.thinks)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": backend.model_id}  # fmt: skip
        if chat.stream:
            return StreamingResponse(
                _stream(handle, EventStream(split, head), len(ids)), media_type="text/event-stream"
            )
        if not await wait(request, handle):
            return error(499, "the client went away")
        if handle.req.error is not None:  # 503 for a server going down, as the chat path says
            raise failed(handle.req.error)
        result = handle.req.result()
        content, uses = whole_content(split, result.text, result.stop_reason)
        said = stop_reason(result.stop_reason, uses)
        return {
            **head,
            "content": content,
            "stop_reason": said,
            "stop_sequence": matched(said, result.stop_string),
            "usage": usage(len(ids), len(result.tokens), result.cached_tokens),
        }

    async def count_tokens(request: Request):
        _, _, ids, _, _ = await chat_of(request, CountTokensRequest)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    async def messages_route(request: Request):
        return await answered(request, messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request):
        return await answered(request, count_tokens)
