"""gpt-oss's harmony output format: the generated text split into its channels.

After the chat template's `<|start|>assistant` the model writes messages of the form
`<|channel|>NAME[ to=RECIPIENT][<|constrain|>FORMAT]<|message|>BODY<|end|>`, the next one opened
by `<|start|>assistant`, the last one ending in `<|return|>` (or `<|call|>` for a tool call),
which end the turn and are not in the text. The `analysis` channel holds the model's reasoning,
`final` the answer the user sees; a message addressed to a function (` to=functions.NAME` in its
header: a tool call, which server/tools.py's HarmonyCalls parses from the whole text) is not
shown; anything else (commentary preambles) is kept in the content as it is. The framing tokens
reach the text because llama.cpp's overrides render them (files/vocabulary.py,
HARMONY_RENDERED). Text that does not start with a channel header is content. A header marker
inside a body (a model that skipped `<|end|>`) ends the body there and opens a header, and a
header never finished (no `<|message|>`: cut off, or a model's stray marker) is dropped, so no
marker ever reaches the text.
"""

from __future__ import annotations

import re

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
START = "<|start|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_MARKERS = (START, CHANNEL, "<|constrain|>", MESSAGE)  # one of these in a body opens a header
MARKERS = (*HEADER_MARKERS, *BODY_ENDS)
REASONING, CONTENT = "reasoning_content", "content"  # the OpenAI chat fields they go to
CALL = "tool_call"  # a message to a function: dropped from the fields
RECIPIENT = " to="  # a header may open with the recipient, before its channel
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_TO_FUNCTION = re.compile(r"\bto=functions\.")


def _field(header: str) -> str:
    """The response field a message with this header goes to: analysis -> reasoning, a call to a
    function -> CALL."""
    if _TO_FUNCTION.search(header):
        return CALL
    name = _CHANNEL_NAME.search(header)
    return REASONING if name and name.group(1) == "analysis" else CONTENT


def _held_back(text: str) -> int:
    """Length of text's longest suffix that could still become a marker."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


class HarmonyStream:
    """Splits streamed text into (field, text) pieces: feed() each piece as it comes, finish()
    once at the end. Headers and framing tokens are dropped; a marker split across pieces is
    held back until it is whole."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_body = False
        self._started = False  # any text seen: text before a header is content
        self._field = CONTENT

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._buf:
            if not self._in_body:
                could_be_header = any(
                    m.startswith(self._buf) or self._buf.startswith(m)
                    for m in (*MARKERS, RECIPIENT)
                )
                if not self._started and not could_be_header:  # no header at all: content
                    self._started, self._in_body, self._field = True, True, CONTENT
                    continue
                i = self._buf.find(MESSAGE)
                if i < 0:  # the header is not complete yet (at the end: an unfinished header)
                    if final:  # shown only where it is no header: text shorter than a marker
                        opened = any(self._buf.startswith(m) for m in (*MARKERS, RECIPIENT))
                        out.append((CONTENT, "" if self._started or opened else self._buf))
                        self._buf = ""
                    break
                self._started, self._in_body = True, True
                self._field = _field(self._buf[:i])
                self._buf = self._buf[i + len(MESSAGE) :]
                continue
            self._started = True
            ends = [(i, m) for m in MARKERS if (i := self._buf.find(m)) >= 0]
            if ends:
                i, marker = min(ends)
                out.append((self._field, self._buf[:i]))
                skip = len(marker) if marker in BODY_ENDS else 0  # a header marker opens the header
                self._buf, self._in_body = self._buf[i + skip :], False
                continue
            keep = 0 if final else _held_back(self._buf)
            out.append((self._field, self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return [(f, t) for f, t in out if t and f != CALL]


class TokenChannels:
    """The field each generated token's text goes to, token by token (a harmony chat's logprobs
    follow its fields): CONTENT, REASONING, CALL, or None for framing (a marker token or a
    header's text). HarmonyStream's rules at token grain (the markers are whole tokens); tokens
    that may open a header before any marker (" to=functions.f...") wait until that is known."""

    def __init__(self) -> None:
        self._header = ""  # the text of the header being read
        self._field: str | None = None  # the body's field; None while in a header
        self._started = False  # a marker or body seen: text before a header is content
        self._waiting = 0  # tokens before any marker that may be a header or content

    def feed(self, piece: str) -> list[str | None]:
        """The fields of the tokens this one decides (those waiting, then itself, in order)."""
        if piece in MARKERS:  # tokens waiting before a marker were a header's (" to=...")
            self._started = True
            if piece == MESSAGE:
                self._field, self._header = _field(self._header), ""
            else:  # a header opens (or goes on) at a header marker; a body ends at its end
                self._field = None
                self._header = self._header + piece if piece in (CHANNEL, "<|constrain|>") else ""
            return self._decided(None, None)
        if self._field is None and not self._started:
            header = self._header + piece
            if header.startswith(RECIPIENT) or RECIPIENT.startswith(header):
                self._header, self._waiting = header, self._waiting + 1
                return []
            self._started, self._field = True, CONTENT  # no header at all: content
            return self._decided(CONTENT, CONTENT)
        if self._field is None:
            self._header += piece
        return [self._field]

    def finish(self) -> list[str | None]:
        """The fields of the tokens still waiting at the end: HarmonyStream shows text that is
        only the start of a recipient (" to") as content, an unfinished header not."""
        return self._decided(None if self._header.startswith(RECIPIENT) else CONTENT, None)[:-1]

    def _decided(self, waiting: str | None, this: str | None) -> list[str | None]:
        out, self._waiting = [waiting] * self._waiting + [this], 0
        return out


def split_channels(text: str) -> dict[str, str]:
    """The whole generated text -> {"content": ..., "reasoning_content": ...} (each joined over
    its messages; reasoning_content only where the text has an analysis message)."""
    stream = HarmonyStream()
    fields: dict[str, str] = {CONTENT: ""}
    for field, piece in [*stream.feed(text), *stream.finish()]:
        fields[field] = fields.get(field, "") + piece
    return fields


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style chat messages as the harmony template takes them: an assistant's
    `reasoning_content` as its `thinking` (the analysis message the template renders before a
    call), joined with its text where it has calls too (the template holds one analysis message
    there), and an assistant turn of several calls split into one turn per call, each followed by
    its result (the template names a result after the latest call)."""
    out: list[dict] = []
    pending: list[dict] = []  # the split turn's calls, each with its result once that comes
    for m in messages:
        waiting = [e for e in pending if "result" not in e]
        if m.get("role") == "tool" and (entry := _of_call(waiting, m.get("tool_call_id"))):
            entry["result"] = m
            continue
        out.extend(_flushed(pending))
        m = dict(m)
        thinking = m.pop("reasoning_content", None)
        calls = m.get("tool_calls") or []
        if thinking and calls and m.get("content"):
            thinking, m["content"] = f"{thinking}\n\n{m['content']}", ""
        if thinking:
            m["thinking"] = thinking
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        pending = [{"call": c} for c in calls]
        pending[0]["message"] = {**m, "tool_calls": calls[:1]}
    return out + _flushed(pending)


def _of_call(entries: list[dict], call_id) -> dict | None:
    return next((e for e in entries if call_id and e["call"].get("id") == call_id), None)


def _flushed(pending: list[dict]) -> list[dict]:
    """The turns of a split multi-call message: each call, then its result where one came."""
    out = []
    for entry in pending:
        out.append(entry.get("message") or {"role": "assistant", "content": "",
                                             "tool_calls": [entry["call"]]})  # fmt: skip
        if "result" in entry:
            out.append(entry["result"])
    pending.clear()
    return out
