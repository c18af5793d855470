"""OpenAI's response shapes: completion and chat objects, their streamed chunks, error bodies.

Pure functions from plain values to JSON-ready dicts, so the wire format lives in one place.
"""

from __future__ import annotations

import json
import time
import uuid

from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import HarmonyStream, split_channels

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

    def __init__(self, kind: str, model: str, harmony: bool = False):
        self.kind, self.model = kind, model  # kind: "chat" or "text"
        self.id, self.created = new_id(kind), int(time.time())
        # gpt-oss chat: the text's harmony channels go to content and reasoning_content
        self.channels = HarmonyStream() if harmony and kind == "chat" else None

    def deltas(self, piece: str | None) -> list[tuple[str, str]]:
        """(field, text) of one streamed text piece (None: the end, flushing what was held
        back): the piece as content, or a harmony chat's pieces per channel."""
        if self.channels is None:
            return [] if piece is None else [("content", piece)]
        return self.channels.finish() if piece is None else self.channels.feed(piece)

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
            message: dict = {"role": "assistant"}
            if self.channels is not None:  # gpt-oss: content and reasoning_content by channel
                message.update(split_channels(text))
                if tool_calls and not message["content"]:
                    message["content"] = None
            else:
                message["content"] = text if text or not tool_calls else None
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = [c.openai() for c in tool_calls]
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
        field: str = "content",
        call=None,
        call_index: int = 0,
        called: bool = False,
    ) -> dict:
        """One streamed chunk: a text piece (of `field`: content, or a harmony chat's
        reasoning_content), the opening role (chat), one tool call (`call`, at `call_index`), or
        the final finish_reason ("tool_calls" once `called`)."""
        finish = None if reason is None else FINISH_REASON.get(reason, "stop")
        if called and reason is not None:
            finish = "tool_calls"
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({} if text is None else {field: text})
            )
            if call is not None:
                delta = {"tool_calls": [call.openai(call_index)]}
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
