"""Anthropic's Messages API over the same engine: POST /v1/messages and
/v1/messages/count_tokens (what Claude Code and the `anthropic` client call).

A Messages body becomes a chat body (system prompt, text / tool_use / tool_result blocks as
messages, tools, tool_choice, stop_sequences, thinking as the template's enable_thinking) and runs
through the chat path (template, tool-call format, constraint, scheduler); the reply comes back as
content blocks (thinking, text, tool_use), streamed with Anthropic's events: message_start,
content_block_start / _delta / _stop per block, message_delta (stop_reason, usage), message_stop.
Errors are Anthropic's {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from minfer_jax.engine.steps import StopReason
from minfer_jax.errors import MinferError
from minfer_jax.server.reasoning import ReasoningStream, split_reasoning
from minfer_jax.server.schemas import BadRequest, ChatCompletionRequest, StopString, Text, parse
from minfer_jax.server.tools import CallStream

STOP_REASONS = {
    StopReason.EOS: "end_turn",
    StopReason.STOP: "stop_sequence",
    StopReason.LENGTH: "max_tokens",
    StopReason.CONTEXT: "max_tokens",
    StopReason.CANCELLED: "end_turn",
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # a caching hint: prefix reuse is always on


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
    name: Text
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
    stop_sequences: list[StopString] | None = None
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
            out.append(
                {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            )
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                out.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
                )
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
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name or ""}}
            )
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status
    )


def _blocks(text: str, reasoning: str | None, calls) -> list[dict]:
    blocks: list[dict] = []
    if reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    for c in calls:
        blocks.append(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
        )
    return blocks


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Events:
    """Anthropic's stream for one reply: blocks opened as their kind of text arrives."""

    def __init__(self):
        self.index, self.open = -1, None

    def block(self, kind: str, piece: str):
        if self.open != kind:
            yield from self.close()
            self.index, self.open = self.index + 1, kind
            yield _event(
                "content_block_start",
                {"index": self.index, "content_block": {"type": kind, kind: ""}},
            )
        delta = {"type": f"{kind}_delta", kind: piece}
        yield _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self):
        if self.open is not None:
            yield _event("content_block_stop", {"index": self.index})
            self.open = None

    def tool_use(self, call):
        yield from self.close()
        self.index += 1
        start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        yield _event("content_block_start", {"index": self.index, "content_block": start})
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        yield _event("content_block_delta", {"index": self.index, "delta": delta})
        yield _event("content_block_stop", {"index": self.index})


async def _stream(handle, head: dict, n_prompt: int, calls, think):
    """Anthropic's events for one request; leaving early (client gone) cancels it."""
    events = _Events()
    held = None if calls is None else CallStream(calls)
    thought = None if think is None else ReasoningStream(think)
    try:
        message = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": n_prompt, "output_tokens": 0}}  # fmt: skip
        yield _event("message_start", {"message": message})

        def pieces(reasoning: str, text: str):
            if reasoning:
                yield from events.block("thinking", reasoning)
            text = held.feed(text) if held is not None and text else text
            if text:
                yield from events.block("text", text)

        async for piece in handle.pieces():
            reasoning, text = thought.feed(piece) if thought is not None else ("", piece)
            for e in pieces(reasoning, text):
                yield e
        for e in pieces(*(thought.finish() if thought is not None else ("", ""))):
            yield e
        req = handle.req
        if req.error is not None:
            yield _event("error", {"error": {"type": "api_error", "message": str(req.error)}})
            return
        result = req.result()
        rest, made = held.finish() if held is not None else ("", [])
        for e in events.block("text", rest) if rest else ():
            yield e
        for e in events.close():
            yield e
        for call in made:
            for e in events.tool_use(call):
                yield e
        stop = "tool_use" if made else STOP_REASONS.get(result.stop_reason, "end_turn")
        yield _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                       "usage": {"output_tokens": len(result.tokens)}})  # fmt: skip
        yield _event("message_stop", {})
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


def add_messages_routes(app: FastAPI, backend, admission, prepare_chat, submit, wait) -> None:
    """POST /v1/messages and /v1/messages/count_tokens; prepare_chat, submit, wait: the chat
    path's steps (app.py), passed in so that this module does not import the app."""

    async def chat_of(request: Request, kind: type[MessagesRequest]):
        limits = await admission.limits_for(request)
        raw = await limits.read_body(request)
        ctx = backend.scheduler.plan.ctx

        def check(data: dict) -> None:
            limits.check_json(data, ctx)
            _drop_null_block_fields(data)

        body = await run_in_threadpool(parse, kind, raw, check)
        chat = to_chat(body)
        ids, calls, think = await prepare_chat(chat, limits)
        return chat, ids, calls, think

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
        chat, ids, calls, think = await chat_of(request, MessagesRequest)
        handle = await submit("chat", chat, ids, calls)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": backend.model_id}  # fmt: skip
        if chat.stream:
            return StreamingResponse(
                _stream(handle, head, len(ids), calls, think), media_type="text/event-stream"
            )
        if not await wait(request, handle):
            return error(499, "the client went away")
        result = handle.req.result()
        reasoning, text = (
            (None, result.text) if think is None else split_reasoning(result.text, think)
        )
        text, made = calls.parse(text) if calls is not None else (text, [])
        stop = "tool_use" if made else STOP_REASONS.get(result.stop_reason, "end_turn")
        usage = {"input_tokens": len(ids), "output_tokens": len(result.tokens),
                 "cache_read_input_tokens": result.cached_tokens}  # fmt: skip
        content = _blocks(text, reasoning, made)
        return {
            **head,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    async def count_tokens(request: Request):
        _, ids, _, _ = await chat_of(request, CountTokensRequest)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    async def messages_route(request: Request):
        return await answered(request, messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request):
        return await answered(request, count_tokens)
