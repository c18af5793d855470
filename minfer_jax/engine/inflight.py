"""What the scheduler (scheduler.py) has dispatched and not read yet: one item per executable run
whose tokens the host still has to take."""

from __future__ import annotations

import dataclasses

import jax

from minfer_jax.engine.request import Request
from minfer_jax.engine.sampling import Sampled


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
