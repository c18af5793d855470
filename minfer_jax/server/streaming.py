"""Streamed replies of the OpenAI-compatible endpoints: each choice's chunks (its text pieces with
their tokens' logprobs, reasoning split off, tool calls held back and parsed), the n choices of a
request merged as they come, the usage chunk and [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from minfer_jax.server.backend import Handle
from minfer_jax.server.openai_format import LogprobFormat, Reply, error_body, sse
from minfer_jax.server.reasoning import ReasoningStream
from minfer_jax.server.speculation import timings
from minfer_jax.server.tools import CallFormat, CallStream, HarmonyCalls, parse_reply


class ChoiceFailed:
    """A choice ended with an error: the stream ends with this error event."""

    def __init__(self, error: BaseException):
        self.error = error


async def choice_chunks(
    handle: Handle,
    reply: Reply,
    index: int,
    calls: CallFormat | None,
    think: bool | None,
    logprobs: LogprobFormat | None,
):
    """The chunks (dicts) of choice `index` after its role chunk, then its final chunk, or a
    ChoiceFailed. calls: the tool-call format the reply is parsed with (text that may be a call is
    held back); think: a thinking model's reply (reasoning_content split out; True: it starts
    inside the think block); logprobs: the tokens' logprobs go with the first chunk after them."""
    # harmony's calls are whole messages of the raw text, parsed once it is done
    whole = isinstance(calls, HarmonyCalls)
    held = None if calls is None or whole else CallStream(calls)
    thought = None if think is None else ReasoningStream(think)
    pending: list = []  # token logprobs not sent yet

    def chunk(*args, **kwargs) -> dict:
        final = kwargs.get("reason") is not None
        if logprobs is not None and (pending or (final and logprobs.held)):
            kwargs["logprobs"] = logprobs(pending, final=final)
            pending.clear()
        return reply.chunk(*args, index=index, **kwargs)

    def content_chunks(field: str, text: str, split: bool = True):
        """Chunks of one piece: reasoning split off (thinking models), text that may begin a tool
        call held back."""
        if field == "content" and split and thought is not None:
            reasoning, text = thought.feed(text)
            yield from content_chunks("reasoning_content", reasoning)
        if field == "content" and held is not None and text:
            text = held.feed(text)
        if text:
            yield chunk(text, field=field)

    async for piece, entries in handle.items():
        pending.extend(entries)
        for field, text in reply.deltas(piece) if piece else ():
            for event in content_chunks(field, text):
                yield event
    for field, text in reply.deltas(None):  # what a harmony chat held back
        for event in content_chunks(field, text):
            yield event
    if thought is not None:
        reasoning, text = thought.finish()
        for event in content_chunks("reasoning_content", reasoning):
            yield event
        for event in content_chunks("content", text, split=False):
            yield event
    req = handle.req
    if req.error is not None:
        yield ChoiceFailed(req.error)
        return
    result = req.result()
    rest, made = held.finish(result.stop_reason) if held is not None else ("", [])
    if whole:
        made = parse_reply(calls, result.text, result.stop_reason)[1]
    if rest:
        yield chunk(rest)
    for call_index, call in enumerate(made):
        yield chunk(call=call, call_index=call_index)
    yield chunk(reason=result.stop_reason, called=bool(made))


async def merged(generators):
    """The items of several async generators as they come (one task each)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(gen):
        try:
            async for item in gen:
                await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def stream_choices(
    handles: list[Handle],
    reply: Reply,
    include_usage: bool,
    calls: CallFormat | None,
    think: bool | None,
    logprobs: Callable[[], LogprobFormat] | None,
    failed: Callable[[BaseException], Any],
):
    """SSE events of one request's choices (each choice's chunks in order, the choices
    interleaved); leaving early (client gone) cancels them all. calls, think: as choice_chunks
    takes them; logprobs: a new LogprobFormat per choice (None: no logprobs); failed: the
    error (message, kind, code) a choice's exception ends the stream with."""

    def event(obj: dict) -> str:
        if include_usage:  # OpenAI: every chunk but the usage one says "usage": null
            obj["usage"] = None
        return sse(obj)

    try:
        if reply.kind == "chat":
            for index in range(len(handles)):
                yield event(reply.chunk(role=True, index=index))
        choices = [
            choice_chunks(
                h,
                reply if i == 0 else reply.sibling(),
                i,
                calls,
                think,
                None if logprobs is None else logprobs(),
            )
            for i, h in enumerate(handles)
        ]
        async for item in merged(choices):
            if isinstance(item, ChoiceFailed):
                f = failed(item.error)
                yield sse(error_body(f.message, f.kind, code=f.code))
                return
            yield event(item)
        if include_usage:
            results = [h.req.result() for h in handles]
            last = reply.usage_chunk(*choices_usage(results))
            spec_timings = timings(results)
            if spec_timings is not None:  # llama-server's draft counts
                last["timings"] = spec_timings
            yield sse(last)
        yield sse("[DONE]")
    finally:
        for handle in handles:
            handle.cancel()


def choices_usage(results) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt tokens) of a request's choices: the prompt once."""
    first = results[0]
    return len(first.prompt_tokens), sum(len(r.tokens) for r in results), first.cached_tokens
