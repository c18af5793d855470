"""Thinking models' replies: the text inside <think>...</think> (Gemma 4: its thought channel,
<|channel>thought...<channel|>) split out as `reasoning_content` (OpenAI-style, as llama-server
and vLLM return it), whole or streamed. A reply is reasoning from its start when it opens with a
block's opener, or when the prompt itself ended inside an open block (DeepSeek-R1's template,
Qwen3's with thinking on); reasoning ends at the block's closer."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
# every think block's (opener, closer): DeepSeek / Qwen's, Gemma 4's thought channel
BLOCKS = ((OPEN, CLOSE), ("<|channel>thought", "<channel|>"))
CLOSERS = tuple(close for _, close in BLOCKS)


def thinks(template: str) -> bool:
    """The chat template is a thinking model's (it knows a think block)."""
    return any(close in template for close in CLOSERS)


def prompt_opens_think(prompt_tail: str) -> bool:
    """The prompt's last text leaves a think block open (the reply starts inside it)."""
    return any(prompt_tail.rfind(op) > prompt_tail.rfind(close) for op, close in BLOCKS)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of markers."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply; inside: the prompt opened the block."""
    stream = ReasoningStream(inside)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning.strip() if stream.reasoned else None), content


class ReasoningStream:
    """Streamed pieces -> (reasoning piece, content piece); a tail that could begin a marker is
    held back until it cannot."""

    def __init__(self, inside: bool):
        self.buffer = ""
        # start -> reasoning -> after (newlines after </think> dropped) -> content
        self.state = "reasoning" if inside else "start"
        self.reasoned = inside
        self.closers = CLOSERS  # the block's own closer once its opener is seen

    def feed(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        if self.state == "start":
            head = self.buffer.lstrip()
            if any(len(head) < len(op) and op.startswith(head) for op, _ in BLOCKS):
                return "", ""  # could still be an opener
            opened = next(((op, close) for op, close in BLOCKS if head.startswith(op)), None)
            if opened is not None:
                self.state, self.reasoned = "reasoning", True
                self.buffer, self.closers = head[len(opened[0]) :], (opened[1],)
            else:
                self.state = "content"
        if self.state == "after":
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return "", ""
            self.state = "content"
        if self.state == "content":
            out, self.buffer = self.buffer, ""
            return "", out
        ends = [(self.buffer.find(c), c) for c in self.closers if c in self.buffer]
        if ends:
            at, close = min(ends)
            reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(close) :]
            self.state = "after"
            return reasoning, self.feed("")[1]
        cut = len(self.buffer) - _held(self.buffer, self.closers)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What is still held, as (reasoning, content)."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "reasoning" else ("", rest.lstrip("\n"))


def reply_thinks(model, ids: list[int]) -> bool | None:
    """None for a model that does not think; else whether its reply starts inside the think
    block (the prompt's tail left one open)."""
    tok = model.tokenizer
    if tok is None or not thinks(tok.chat_template):
        return None
    return prompt_opens_think(tok.decode(ids[-8:]))
