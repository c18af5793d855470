"""What the scheduler (scheduler.py) has dispatched and not read yet: one item per executable run
whose tokens the host still has to take, and how each is read (`read`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax

from minfer_jax.engine import slot_spec
from minfer_jax.engine.request import Request, on_host
from minfer_jax.engine.sampling import Sampled, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """In flight: the token a prompt's last prefill chunk sampled."""

    req: Request
    token: jax.Array | Sampled  # [] int32 (LOGPROBS_MODE: with its logprobs)


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """In flight: one decode chunk's tokens for its rows, each with how many of them count."""

    rows: list[tuple[Request, int]]  # (request, valid tokens) per row, in row order
    tokens: jax.Array | Sampled  # [decode_steps, rows] int32 (LOGPROBS_MODE: with logprobs)


Item = FirstToken | DecodeChunk | slot_spec.VerifyBatch


def read(item: Item, compile_s: float) -> Iterator[tuple[Request, list[int], TokenLogprobs | None]]:
    """(request, its tokens, their logprobs as host arrays or None) per request of item that is
    not done yet, checked as each comes (the one before may have ended it); waits for the step.
    compile_s: the loop's compile seconds so far (a first token's clock)."""
    if isinstance(item, slot_spec.VerifyBatch):  # no logprobs
        for req, tokens in slot_spec.verified(item):
            if not req.done.is_set():
                yield req, tokens, None
        return
    if isinstance(item, FirstToken):
        req = item.req
        token, lps = on_host(item.token, req.logprobs is not None)  # waits for the prefill
        if not req.done.is_set():
            req.timing.first_read(compile_s)
            yield req, [int(token)], jax.tree.map(lambda a: a[None], lps)
        return
    # waits for this chunk (the next one is already queued)
    out, lps = on_host(item.tokens, any(r.logprobs is not None for r, _ in item.rows))
    for i, (req, valid) in enumerate(item.rows):
        if not req.done.is_set():
            row = jax.tree.map(lambda a: a[:valid, i], lps)  # noqa: B023  used at once
            yield req, out[:valid, i].tolist(), row
