"""OpenAI's response shapes: completion and chat objects, their streamed chunks, error bodies.

Pure functions from plain values to JSON-ready dicts, so the wire format lives in one place.
"""

from __future__ import annotations

import json
import time
import uuid

from minfer_jax.engine.steps import StopReason

# scheduler stop reasons -> OpenAI finish_reason ("context": the slot is full, which OpenAI calls
# length)
FINISH_REASON = {
    StopReason.EOS: "stop",
    StopReason.STOP: "stop",
    StopReason.LENGTH: "length",
    StopReason.CONTEXT: "length",
    StopReason.CANCELLED: "stop",
}


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens reused from a slot
    (not prefilled again)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Reply:
    """The fixed fields of one response (id, created, model) and its shapes, for either endpoint."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model  # kind: "chat" or "text"
        self.id, self.created = new_id(kind), int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(
        self,
        text: str,
        reason: StopReason,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        tool_calls: list | None = None,
        reasoning: str | None = None,
    ) -> dict:
        """The non-streamed response; tool_calls: ToolCall (server/tools.py) parsed from it;
        reasoning: a thinking model's think block (server/reasoning.py)."""
        finish = "tool_calls" if tool_calls else FINISH_REASON.get(reason, "stop")
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text or None}
            if tool_calls:
                message["tool_calls"] = [c.openai() for c in tool_calls]
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            head = self._head("text_completion")
        return {
            **head,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    def chunk(
        self,
        text: str | None = None,
        reason: StopReason | None = None,
        *,
        role: bool = False,
        call=None,
        call_index: int = 0,
        called: bool = False,
        reasoning: str | None = None,
    ) -> dict:
        """One streamed chunk: a text piece, the opening role (chat), one tool call (`call`, at
        `call_index`), or the final finish_reason ("tool_calls" once `called`)."""
        finish = None if reason is None else FINISH_REASON.get(reason, "stop")
        if called and reason is not None:
            finish = "tool_calls"
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({} if text is None else {"content": text})
            )
            if call is not None:
                delta = {"tool_calls": [call.openai(call_index)]}
            if reasoning is not None:
                delta = {"reasoning_content": reasoning}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            **self._head(obj),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line ([DONE] as it is)."""
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"
