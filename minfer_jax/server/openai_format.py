"""OpenAI's response shapes: completion and chat objects, their streamed chunks, error bodies.

Pure functions from plain values to JSON-ready dicts, so the wire format lives in one place.
"""

from __future__ import annotations

import json
import time
import uuid

from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import (
    CONTENT,
    REASONING,
    HarmonyStream,
    TokenChannels,
    split_channels,
)

# scheduler stop reasons -> OpenAI finish_reason ("context": the slot is full, which OpenAI calls
# length)
FINISH_REASON = {
    StopReason.EOS: "stop",
    StopReason.STOP: "stop",
    StopReason.LENGTH: "length",
    StopReason.CONTEXT: "length",
    StopReason.CANCELLED: "stop",
}
CUT = (StopReason.LENGTH, StopReason.CONTEXT)  # llama-server: "length" wins over "tool_calls"


def finish_reason(reason: StopReason, called: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" where the reply made calls and ended by itself; a
    reply cut at max_tokens or the context is "length", calls or not (llama-server's rule, and
    the Messages API's max_tokens), so an agent does not run the calls of a cut-off turn."""
    if called and reason not in CUT:
        return "tool_calls"
    return FINISH_REASON.get(reason, "stop")


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
    """The fixed fields of one response (id, created, model) and its shapes, for either endpoint;
    one per choice (`sibling`: the next choice's, same id)."""

    def __init__(self, kind: str, model: str, harmony: bool = False):
        self.kind, self.model = kind, model  # kind: "chat" or "text"
        self.id, self.created = new_id(kind), int(time.time())
        # gpt-oss chat: the text's harmony channels go to content and reasoning_content
        self.channels = HarmonyStream() if harmony and kind == "chat" else None

    def sibling(self) -> Reply:
        """A reply for another choice of the same response: same id, its own harmony state."""
        other = Reply(self.kind, self.model, harmony=self.channels is not None)
        other.id, other.created = self.id, self.created
        return other

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
        *,
        index: int = 0,
        logprobs: dict | None = None,
    ) -> dict:
        """The non-streamed response; tool_calls: ToolCall (server/tools.py) parsed from it;
        reasoning: a thinking model's think block (server/reasoning.py); index: the choice's;
        logprobs: its tokens' (LogprobFormat)."""
        finish = finish_reason(reason, bool(tool_calls))
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
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            head = self._head("chat.completion")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
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
        index: int = 0,
        logprobs: dict | None = None,
    ) -> dict:
        """One streamed chunk of choice `index`: a text piece (of `field`: content, or a harmony
        chat's reasoning_content), the opening role (chat), one tool call (`call`, at
        `call_index`), or the final finish_reason ("tool_calls" once `called`); logprobs: of the
        tokens since the last chunk (LogprobFormat)."""
        finish = None if reason is None else finish_reason(reason, called)
        if self.kind == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({} if text is None else {field: text})
            )
            if call is not None:
                delta = {"tool_calls": [call.openai(call_index)]}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
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


class LogprobFormat:
    """Tokens' logprobs (engine TokenLogprob) as OpenAI writes them: chat's
    {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}, or the completions endpoint's
    {tokens, token_logprobs, top_logprobs, text_offset}. A token's text is its bytes decoded (a
    piece of a UTF-8 character shows as U+FFFD; `bytes` holds it exactly). A harmony chat's
    tokens follow its fields: `content` holds the content's tokens, `reasoning_content` the
    analysis channel's; framing (markers, headers) and tool-call messages have none."""

    def __init__(self, kind: str, tokenizer):
        self.kind, self.tokenizer = kind, tokenizer
        self.offset = 0  # completions: characters of the reply before the next token
        harmony = kind == "chat" and tokenizer is not None and tokenizer.harmony
        self.channels = TokenChannels() if harmony else None
        self.held: list = []  # harmony: tokens whose field is not known yet

    def _bytes(self, token: int) -> bytes:
        return b"" if self.tokenizer is None else self.tokenizer.token_bytes([token])

    def _entry(self, token: int, logprob: float) -> dict:
        raw = self._bytes(token)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _by_field(self, entries, final: bool) -> dict[str, list]:
        """A harmony chat's tokens by the field their text goes to (those it decides so far)."""
        assert self.channels is not None
        self.held += entries
        fields: list[str | None] = []
        for e in entries:
            fields += self.channels.feed(self._bytes(e.token).decode("utf-8", errors="replace"))
        if final:
            fields += self.channels.finish()
        decided, self.held = self.held[: len(fields)], self.held[len(fields) :]
        out: dict[str, list] = {CONTENT: [], REASONING: []}
        for field, e in zip(fields, decided, strict=True):
            if field in out:
                out[field].append(e)
        return out

    def __call__(self, entries, final: bool = True) -> dict:
        """The logprobs object of these tokens (the next ones of the reply, when streaming;
        final: the reply's last, which decides a harmony chat's tokens still held)."""
        if self.kind == "chat":
            fields = {CONTENT: entries} if self.channels is None else self._by_field(entries, final)
            shown: dict = {
                field: [
                    {
                        **self._entry(e.token, e.logprob),
                        "top_logprobs": [self._entry(*t) for t in e.top],
                    }
                    for e in of_field
                ]
                for field, of_field in fields.items()
                if field == CONTENT or of_field
            }
            return {**shown, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self._entry(e.token, e.logprob)["token"])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._entry(*t)["token"]: t[1] for t in e.top} for e in entries],
            "text_offset": offsets,
        }
