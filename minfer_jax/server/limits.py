"""What one request may cost, each limit checked before the work it would cause.

    body      --max-body-bytes: read in pieces and refused (413) as soon as it passes the limit,
              before any JSON is parsed (parsing holds the interpreter: ~0.07 s per MB here).
              Default: BODY_BYTES_PER_CHAR bytes per allowed prompt character, at least
              MIN_BODY_BYTES.
    messages  --max-messages (default 2048, OpenAI's own limit): counted on the parsed JSON, before
              each message is validated.
    prompt    --max-prompt-chars: a text prompt, or the chat messages' content summed, refused (400)
              before it is tokenized or rendered. Default: the slot's context times the longest
              token of the vocabulary (128 characters for Qwen2), so a prompt that could fit is
              never refused.
    tokens    the slot's context: a token-id prompt by its length, before its ids are checked; a
              text prompt as soon as a prefix of it holds more tokens (files/prompts.py).
    stop      validate.MAX_STOP_STRINGS strings of validate.MAX_STOP_CHARS characters (schemas.py).

A client that disconnects before its body is complete ends its request quietly (ClientGone: one
log line, no traceback).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request

from minfer_jax.errors import MinferError
from minfer_jax.server.schemas import BadRequest

DEFAULT_MAX_MESSAGES = 2048  # OpenAI's limit on a chat request's messages
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_CHAR = 8  # room for JSON escapes (\u00e9 is 6 bytes) and the rest of the body
DRAIN_BYTES = (
    64 << 20
)  # past the limit, a body is still read (and dropped) up to this, so its client sees the 413

_log = logging.getLogger("uvicorn.error")


class LimitsError(MinferError, ValueError):
    """A request-limit flag out of range (the CLI exits with 2)."""


class RequestTooLarge(BadRequest):
    """A request over a size limit (HTTP 413)."""

    status = 413


class ClientGone(Exception):
    """The client disconnected before its request body was complete: nobody to answer."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 0  # 0: BODY_BYTES_PER_CHAR x max_prompt_chars, at least MIN_BODY_BYTES
    max_prompt_chars: int = 0  # 0: the slot's context x the longest token's characters
    max_messages: int = DEFAULT_MAX_MESSAGES

    def __post_init__(self):
        for flag, value, lo in (
            ("--max-body-bytes", self.max_body_bytes, 0),
            ("--max-prompt-chars", self.max_prompt_chars, 0),
            ("--max-messages", self.max_messages, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise LimitsError(
                    f"{flag} must be an int >= "
                    f"{lo}{' (0: derived from the context)' if lo == 0 else ''}, got {value!r}"
                )

    def for_model(self, slot_ctx: int, longest_token_chars: int) -> RequestLimits:
        """These limits with each 0 resolved for a model's slot context and vocabulary."""
        chars = self.max_prompt_chars or slot_ctx * longest_token_chars
        body = self.max_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_CHAR * chars)
        return dataclasses.replace(self, max_body_bytes=body, max_prompt_chars=chars)

    # -- checks, in the order a request meets them -------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The request body, or RequestTooLarge once it passes max_body_bytes
        (ClientGone if the client left)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > DRAIN_BYTES:
            raise self._too_large()
        chunks: list[bytes] | None = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    chunks = None  # dropped: only the count goes on
                    if size > DRAIN_BYTES:
                        break
                elif chunks is not None:
                    chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        if chunks is None or (declared.isdigit() and int(declared) > limit):
            raise self._too_large()
        return b"".join(chunks)

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"the request body is over the limit of {self.max_body_bytes} bytes (--max-body-bytes)"
        )

    def check_json(self, data: dict, slot_ctx: int) -> None:
        """What can be counted on the parsed JSON before validation spends time per item."""
        messages, prompt = data.get("messages"), data.get("prompt")
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise BadRequest(
                f"messages: {len(messages)} messages, more than the limit of {self.max_messages} "
                "(--max-messages)",
                "messages",
            )
        if isinstance(prompt, list) and len(prompt) >= slot_ctx:
            raise BadRequest(
                f"prompt: {len(prompt)} token ids but the context holds {slot_ctx}, which leaves "
                "no room to generate; use a larger context (-c) or a shorter prompt",
                "prompt",
            )
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise BadRequest(
                f"{param}: {chars} characters, more than the limit of {self.max_prompt_chars} "
                "(--max-prompt-chars; the default is what the slot's context can hold)",
                param,
            )


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (its bytes: a token never holds more
    characters)."""
    return max(len(tokenizer.token_bytes([i])) for i in range(tokenizer.vocab_size))


def client_gone(request: Request) -> None:
    """The log line of a client that hung up mid-body (instead of an ASGI traceback)."""
    client = request.client
    who = f"{client.host}:{client.port}" if client else "a client"
    _log.info(
        '%s - "%s %s": disconnected before sending the whole request body',
        who,
        request.method,
        request.url.path,
    )
