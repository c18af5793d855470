"""Checks for the values a user hands to a public call: plain functions, one InvalidArgumentError
each.

Every public boundary (load, generate, Model.logits, Sampler, Config, Impl, the tokenizer, the
CLI, and a server translating JSON requests) checks its arguments here, so one message style names
the argument, the value and the limit: "top_k must be an int in 0..2147483647, got 2.5 (float)".
Each function returns the checked value in its canonical type (a Python int or float).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from minfer_jax.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Choices:
    """One setting's values, each with what it means, in the order help lists them: Impl and
    load() validate against it; the CLIs take their argparse choices and help text from it."""

    meanings: tuple[tuple[str, str], ...]  # (value, one-line meaning)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.meanings)

    def describe(self) -> str:
        """'a (meaning), b (meaning) or c (meaning)': for a --help line."""
        parts = [f"{name} ({meaning})" for name, meaning in self.meanings]
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


INT32_MAX = 2**31 - 1  # positions, ids and counts reach the device as int32
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what jax.random.PRNGKey accepts
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024


def _shown(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    """An int (numpy ints too; not bool, not float) in lo..hi."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an int in {lo}..{hi}, got {_shown(value)}")
    value = int(value)
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be an int in {lo}..{hi}, got {value}")
    return value


def clamped_count(name: str, value: Any, limit: int, *, all_of: str, minus_one: bool = True) -> int:
    """An extreme but meaningful count, clamped like llama.cpp: any int >= 0
    (and -1 with minus_one), where -1 and anything above `limit` mean all of it
    (`all_of` names what: "the vocabulary").

    The one policy of the API, the CLI and the server for top_k, max_new_tokens / -n / max_tokens
    and repeat_last_n: a value past what exists is what exists, never an error."""
    lo = -1 if minus_one else 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        more = (
            f"; -1 or more than {all_of} means all of it"
            if minus_one
            else f"; more than {all_of} means all of it"
        )
        raise InvalidArgumentError(f"{name} must be an int >= {lo}{more}, got {_shown(value)}")
    value = int(value)
    return limit if value == -1 or value > limit else value


def number(
    name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False
) -> float:
    """A finite real number (not bool) in [lo, hi], or (lo, hi] with lo_open."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a finite number, got {_shown(value)}")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        where = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidArgumentError(f"{name} must be a finite number in {where}, got {value!r}")
    return value


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in options:
        raise InvalidArgumentError(
            f"{name} must be one of {', '.join(map(repr, options))}, got {_shown(value)}"
        )
    return value


def text(name: str, value: Any) -> str:
    """A str that is valid Unicode (no lone surrogates: they cannot be encoded to UTF-8)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a str, got {_shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{name} is not valid UTF-8 text: {value[e.start : e.end]!r} at character {e.start} "
            "is a lone surrogate (undecodable input bytes?)"
        ) from None
    return value


def token_ids(value: Any, vocab_size: int, name: str = "token ids") -> list[int]:
    """A non-empty sequence of ints, each a token id in 0..vocab_size-1: a list or tuple, or a
    one-dimensional integer array (NumPy, JAX: anything with __array__)."""
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        array = np.asarray(value)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise InvalidArgumentError(
                f"{name} must be a one-dimensional array of ints, got shape {array.shape} of "
                f"{array.dtype}"
            )
        value = array.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {_shown(value)}")
    ids = list(value)
    if not ids:
        raise InvalidArgumentError(f"{name} are empty: give at least one token")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidArgumentError(f"{name}: token id #{i} must be an int, got {_shown(t)}")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise InvalidArgumentError(
                f"{name}: token id #{i} is {t}, outside the vocabulary 0..{vocab_size - 1} "
                f"({vocab_size} tokens)"
            )
        out.append(t)
    return out


def stop_strings(value: Any) -> tuple[str, ...]:
    """A sequence of at most MAX_STOP_STRINGS str, each at most MAX_STOP_CHARS long."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(
            f"stop must be a list of strings (not one string), got {_shown(value)}"
        )
    items = list(value)
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(
            f"stop has {len(items)} strings, at most {MAX_STOP_STRINGS} are allowed"
        )
    for i, s in enumerate(items):
        text(f"stop[{i}]", s)
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgumentError(
                f"stop[{i}] has {len(s)} characters, at most {MAX_STOP_CHARS} are allowed"
            )
    return tuple(items)


def seed(value: Any) -> int:
    return integer("seed", value, SEED_MIN, SEED_MAX)


def kv_cache_bytes(n_layers: int, ctx: int, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of a K and a V cache of ctx slots (model/cache.py's layout)."""
    return 2 * n_layers * ctx * n_kv_heads * head_dim * itemsize


def memory_limit_bytes(device: Any = None) -> int | None:
    """What the device can hold: its allocator's limit on an accelerator, physical RAM on a CPU."""
    stats = None
    if device is not None and getattr(device, "platform", "cpu") != "cpu":
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001  backends without memory stats: no device bound
            stats = None
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(what: str, nbytes: int, limit: int | None, already: int = 0) -> None:
    """Refuse an allocation of nbytes (plus `already` resident bytes) that exceeds limit."""
    if limit is not None and nbytes + already > limit:
        raise InvalidArgumentError(
            f"{what} needs {nbytes} bytes ({nbytes / 2**30:.1f} GiB)"
            f"{f' on top of {already / 2**30:.1f} GiB of weights' if already else ''}, "
            f"more than the device's {limit} bytes ({limit / 2**30:.1f} GiB); "
            "use a smaller context (ctx_size / -c)"
        )


def generate_arguments(
    *, max_new_tokens: Any, seed: Any, stop: Any, chat: Any, on_text: Any
) -> None:
    """runtime.generate's settings besides the sampler (Sampler checks its own fields) and
    decode_steps (Plan checks it against plan.MAX_DECODE_STEPS)."""
    clamped_count(
        "max_new_tokens", max_new_tokens, INT32_MAX, all_of="the context"
    )  # generate() clamps to it
    globals()["seed"](seed)
    stop_strings(stop)
    if not isinstance(chat, bool):
        raise InvalidArgumentError(f"chat must be a bool, got {_shown(chat)}")
    if on_text is not None and not callable(on_text):
        raise InvalidArgumentError(f"on_text must be a callable or None, got {_shown(on_text)}")
