"""Thinking models' replies: the text inside <think>...</think> split out as `reasoning_content`
(OpenAI-style, as llama-server and vLLM return it), whole or streamed. A reply is reasoning from
its start when it opens with <think>, or when the prompt itself ended inside an open think block
(DeepSeek-R1's template, Qwen3's with thinking on); reasoning ends at </think>."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """The chat template is a thinking model's (it knows the think block)."""
    return CLOSE in template


def prompt_opens_think(prompt_tail: str) -> bool:
    """The prompt's last text leaves a think block open (the reply starts inside it)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


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

    def feed(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        if self.state == "start":
            head = self.buffer.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # could still be <think>
            if head.startswith(OPEN):
                self.state, self.reasoned, self.buffer = "reasoning", True, head[len(OPEN) :]
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
        if CLOSE in self.buffer:
            reasoning, self.buffer = self.buffer.split(CLOSE, 1)
            self.state = "after"
            return reasoning, self.feed("")[1]
        keep = next(
            (
                k
                for k in range(min(len(CLOSE) - 1, len(self.buffer)), 0, -1)
                if CLOSE.startswith(self.buffer[-k:])
            ),
            0,
        )
        cut = len(self.buffer) - keep
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
