"""A Messages reply as Anthropic's content blocks, whole or as its stream of events.

`BlockSplit` turns the generated text into (kind, text) pieces, kind "thinking" or "text", as it
streams, and the tool calls at its end: for gpt-oss by its harmony channels (files/harmony.py:
analysis -> thinking, final and commentary preambles -> text, a message to a function -> a call,
HarmonyCalls), for the other families by the think block (server/reasoning.py) and the template's
call format (server/tools.py). Thinking blocks go out only where the request enables thinking
(Anthropic's contract; llama-server sends them whenever the model reasoned): otherwise the
reasoning is dropped. A call whose arguments are not a JSON object (cut off by max_tokens) is no
tool_use block. `EventStream` writes the events: message_start, content_block_start / _delta /
_stop per block (a thinking block closed with an empty signature_delta, as llama-server does),
message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
from typing import Any

from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import CONTENT, REASONING, HarmonyStream
from minfer_jax.server.reasoning import ReasoningStream
from minfer_jax.server.tool_call import loaded
from minfer_jax.server.tools import CallFormat, CallStream, ToolCall, parse_reply

STOP_REASONS = {
    StopReason.EOS: "end_turn",
    StopReason.STOP: "stop_sequence",
    StopReason.LENGTH: "max_tokens",
    StopReason.CONTEXT: "max_tokens",
    StopReason.CANCELLED: "end_turn",
}
CUT_OFF = (StopReason.LENGTH, StopReason.CONTEXT)
THINKING, TEXT = "thinking", "text"
KINDS = (THINKING, TEXT)


class BlockSplit:
    """One reply's text -> (kind, text) pieces (feed each streamed piece, then finish once with
    the whole text) and its tool calls with their inputs."""

    def __init__(
        self, calls: CallFormat | None, think: bool | None, harmony: bool, show_thinking: bool
    ):
        self.calls, self.show_thinking = calls, show_thinking
        self.channels = HarmonyStream() if harmony else None
        self.thought = None if harmony or think is None else ReasoningStream(think)
        # harmony's calls are whole messages of the raw text, parsed at the end
        self.held = None if harmony or calls is None else CallStream(calls)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self.channels is not None:
            kinds = {REASONING: THINKING, CONTENT: TEXT}
            return self._shown([(kinds[f], t) for f, t in self.channels.feed(piece)])
        reasoning, text = self.thought.feed(piece) if self.thought is not None else ("", piece)
        return self._shown([(THINKING, reasoning), (TEXT, self._held(text))])

    def finish(
        self, text: str, reason: StopReason
    ) -> tuple[list[tuple[str, str]], list[tuple[ToolCall, dict]]]:
        """(the pieces held back, the calls whose arguments are a JSON object) of the whole
        generated text; reason: how it ended (CallStream.finish)."""
        if self.channels is not None:
            kinds = {REASONING: THINKING, CONTENT: TEXT}
            pieces = [(kinds[f], t) for f, t in self.channels.finish()]
            made = parse_reply(self.calls, text, reason)[1] if self.calls is not None else []
            return self._shown(pieces), _inputs(made)
        reasoning, rest = self.thought.finish() if self.thought is not None else ("", "")
        pieces = [(THINKING, reasoning), (TEXT, self._held(rest))]
        tail, made = self.held.finish(reason) if self.held is not None else ("", [])
        return self._shown([*pieces, (TEXT, tail)]), _inputs(made)

    def _held(self, text: str) -> str:
        return self.held.feed(text) if self.held is not None and text else text

    def _shown(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(k, t) for k, t in pieces if t and (k == TEXT or self.show_thinking)]


def _inputs(calls: list[ToolCall]) -> list[tuple[ToolCall, dict]]:
    out = []
    for call in calls:
        value = loaded(call.arguments)
        if isinstance(value, dict):
            out.append((call, value))
    return out


def stop_reason(reason: StopReason, uses: list) -> str:
    """Anthropic's stop_reason: max_tokens wherever the reply was cut off (a call too), else
    tool_use where it made calls."""
    if reason in CUT_OFF:
        return "max_tokens"
    return "tool_use" if uses else STOP_REASONS.get(reason, "end_turn")


def matched(said: str, stop_sequence: str | None) -> str | None:
    """The reply's stop_sequence: the stop string that ended it, where its stop_reason says so."""
    return stop_sequence if said == "stop_sequence" else None


def usage(n_prompt: int, n_output: int, cached: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache."""
    return {"input_tokens": n_prompt - cached, "output_tokens": n_output,
            "cache_read_input_tokens": cached}  # fmt: skip


def whole_content(split: BlockSplit, text: str, reason: StopReason) -> tuple[list[dict], list]:
    """(content blocks, tool uses) of a finished reply: thinking, text, then the tool_use blocks."""
    pieces = split.feed(text)
    rest, uses = split.finish(text, reason)
    joined = {kind: "".join(t for k, t in [*pieces, *rest] if k == kind) for kind in KINDS}
    blocks: list[dict] = []
    if joined[THINKING].strip():
        blocks.append({"type": THINKING, THINKING: joined[THINKING].strip(), "signature": ""})
    if joined[TEXT]:
        blocks.append({"type": TEXT, TEXT: joined[TEXT]})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": v} for c, v in uses]
    return blocks, uses


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class EventStream:
    """The events of one streamed reply, block by block as its kinds of text arrive."""

    def __init__(self, split: BlockSplit, head: dict):
        self.split, self.head = split, head
        self.index, self.open = -1, None

    def start(self, n_prompt: int) -> list[str]:
        message = {**self.head, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": n_prompt, "output_tokens": 0}}  # fmt: skip
        return [_event("message_start", {"message": message})]

    def piece(self, text: str) -> list[str]:
        return [e for kind, t in self.split.feed(text) for e in self._block(kind, t)]

    def end(
        self,
        text: str,
        reason: StopReason,
        n_prompt: int,
        n_output: int,
        cached: int,
        stop_sequence: str | None = None,
    ):
        """The last events, once the whole text and the stop reason are known (stop_sequence:
        the stop string that ended it, if one did)."""
        pieces, uses = self.split.finish(text, reason)
        events = [e for kind, t in pieces for e in self._block(kind, t)]
        events += self._close()
        for call, value in uses:
            events += self._tool_use(call, value)
        said = stop_reason(reason, uses)
        delta = {"stop_reason": said, "stop_sequence": matched(said, stop_sequence)}
        events.append(
            _event("message_delta", {"delta": delta, "usage": usage(n_prompt, n_output, cached)})
        )
        return [*events, _event("message_stop", {})]  # fmt: skip

    def _block(self, kind: str, piece: str) -> list[str]:
        events = []
        if self.open != kind:
            events += self._close()
            self.index, self.open = self.index + 1, kind
            block: dict[str, Any] = {"type": kind, kind: ""}
            if kind == THINKING:
                block["signature"] = ""
            events.append(_event("content_block_start", {"index": self.index,
                                                         "content_block": block}))  # fmt: skip
        delta = {"type": f"{kind}_delta", kind: piece}
        return [*events, _event("content_block_delta", {"index": self.index, "delta": delta})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == THINKING:  # the client expects a signature before a thinking block ends
            delta = {"type": "signature_delta", "signature": ""}
            events.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        self.open = None
        return [*events, _event("content_block_stop", {"index": self.index})]

    def _tool_use(self, call: ToolCall, value: dict) -> list[str]:
        self.index += 1
        start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(value, ensure_ascii=False)}
        return [
            _event("content_block_start", {"index": self.index, "content_block": start}),
            _event("content_block_delta", {"index": self.index, "delta": delta}),
            _event("content_block_stop", {"index": self.index}),
        ]


def error_event(message: str) -> str:
    return _event("error", {"error": {"type": "api_error", "message": message}})
