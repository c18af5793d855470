"""The budget of one chat-template render: limits, the per-render guard and the size checks.

chat_template.py's docstring says what is bounded and why; template_sandbox.py's environment calls
these checks from its operators, str methods, filters and loops.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jinja2.exceptions import SecurityError

# Bounds for one render. Generous for real templates (a few operations per message), small
# enough that a hostile one fails in well under a second of work or a few tens of MB.
MAX_STEPS = 2_000_000  # calls + operator uses + range items, summed over the render
# the render's own CPU time (time.thread_time): waiting for the GIL or a core is not its work (a
# server's renders of a 20 ms template under 16 clients on 2 busy cores passed 1 s of wall clock)
MAX_SECONDS = 1.0
# wall clock, the backstop: a chat request waits this long at most, however starved its thread
MAX_WALL_SECONDS = 10.0
CLOCK_EVERY = 64  # steps between two readings of the clocks (a thread-time reading is a syscall)
MAX_SEQUENCE = 1 << 22  # longest str/list an operator may build, in items (4M chars >> any context)
MAX_INT_ARG = 1 << 20  # largest size-like int for str methods/filters (ljust, center, ...)
MAX_EXPONENT = 4096  # largest int exponent for `**`
MAX_OUTPUT = 1 << 24  # characters of rendered output
MAX_BUILT = (
    1 << 25
)  # items all operators, calls and filters of one render may build, summed (a memory bound)
MAX_INT_BITS = 1 << 16  # largest int `*` / `**` may build (~20k digits)
MAX_TEMPLATE_CHARS = (
    1 << 16
)  # template source: real ones are 1-20 KB; 64K compiles in ~1.5 s on a busy CPU
MAX_BATCH_INPUT = (
    1 << 16
)  # items `batch`/`slice` may split, and slices `slice` may make (each becomes a list)
MAX_SLOW_INPUT = (
    1 << 19
)  # input size of the filters that spend Python time per character or item (_SLOW_FILTERS)
MAX_JSON_SPACING = 64  # characters of a `tojson` separator or indent (real templates use 1-4)

SIZED = (str, bytes, list, tuple)
TEXT = (str, bytes)

# The budget of the render running in this thread/task; templates cannot name it.
current_guard: contextvars.ContextVar[RenderGuard] = contextvars.ContextVar("minfer_chat_guard")


class RenderGuard:
    """Step, time and output budget of one render; hostile templates hit these, real ones don't."""

    def __init__(self) -> None:
        self.steps = 0
        self.next_clock = 0  # the step count at which the clocks are read next
        self.cpu_deadline = time.thread_time() + MAX_SECONDS
        self.deadline = time.monotonic() + MAX_WALL_SECONDS
        self.built_items = 0
        self.sizes: dict[
            int, tuple[Any, int]
        ] = {}  # id -> (container, size): kept alive, so ids stay unique

    def built(self, value: Any) -> Any:
        """Charge a value an operator, call or filter built; the sum over a render bounds its
        memory."""
        if isinstance(value, (*SIZED, dict)):
            self.built_items += item_count(value)
            if self.built_items > MAX_BUILT:
                raise SecurityError(
                    f"chat template built more than {MAX_BUILT} items in one render"
                )
        return value

    def spend(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise SecurityError(f"chat template exceeded {MAX_STEPS} steps (runaway loop?)")
        if self.steps < self.next_clock:
            return
        self.next_clock = self.steps + CLOCK_EVERY
        if time.thread_time() > self.cpu_deadline:
            raise SecurityError(f"chat template ran longer than {MAX_SECONDS:g} s of CPU time")
        if time.monotonic() > self.deadline:
            raise SecurityError(f"chat template ran longer than {MAX_WALL_SECONDS:g} s")


def built(value: Any) -> Any:
    guard = current_guard.get(None)
    return value if guard is None else guard.built(value)


def spend(n: int = 1) -> None:
    """Charge the current render; a no-op outside `render_chat_template` (e.g. compile time)."""
    guard = current_guard.get(None)
    if guard is not None:
        guard.spend(n)


def item_count(value: Any, limit: int = MAX_SEQUENCE) -> int:
    """Items `value` stands for when printed or joined: a str its length, a container its items and
    their contents (`['x' * 4000000] * 1000` is 4e9, not 1000); stops counting once past limit."""
    if isinstance(value, TEXT):
        return len(value)
    if not isinstance(value, (list, tuple, dict)):
        return 1
    guard = current_guard.get(None)
    known = guard.sizes.get(id(value)) if guard is not None else None
    if known is not None and known[0] is value:
        return known[1]
    total = len(value)
    for item in value.items() if isinstance(value, dict) else value:
        if isinstance(item, TEXT):
            total += len(item)
        elif isinstance(item, (list, tuple, dict)):
            total += item_count(item, limit - total)
        if total > limit:
            return total
    if guard is not None:  # containers cannot change inside the immutable sandbox: walk each once
        guard.sizes[id(value)] = (value, total)
    return total


def check_sizes(values: Iterable[Any]) -> None:
    """Refuse oversized strings/lists as arguments: they only exist to amplify further."""
    for value in values:
        if isinstance(value, (*SIZED, dict)) and (size := item_count(value)) > MAX_SEQUENCE:
            raise SecurityError(
                f"chat template passed a value of {size}+ items to a call (limit {MAX_SEQUENCE})"
            )


def check_ints(values: Iterable[Any]) -> None:
    """Refuse huge widths/counts where an int parameter sizes the result (`' '.ljust(10**10)`).

    Only applied to str methods and filter parameters: a large int as data (a timestamp in a
    message, a tool argument) is fine and must render.
    """
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise SecurityError(f"chat template passed {value} as a size (limit {MAX_INT_ARG})")


_PRINTF_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
SPEC_NUMBER = re.compile(r"\d+")


def _printed_size(value: Any) -> int:
    """An upper bound on the characters `value` prints as (`%s`, `{}`)."""
    if is_int(value):
        return value.bit_length() // 3 + 2  # >= its decimal digits and sign
    if isinstance(value, float):
        return 330  # '%f' % 1e308
    if isinstance(value, (list, tuple, dict)):
        return 4 * item_count(value)  # quotes, commas and spaces of its repr
    return item_count(value)


def check_printf(fmt: str, args: Any) -> None:
    """`'%999999999d' % 1`, `'%*d' % (10**9, 1)` and `'%-1000000s' * 4000 % ...` build gigabytes
    from a few characters: every conversion counts its width or precision and the largest
    argument."""
    values = (
        list(args.values())
        if isinstance(args, Mapping)
        else list(args)
        if isinstance(args, tuple)
        else [args]
    )
    largest_value = max((_printed_size(v) for v in values), default=0)
    largest_int = max((abs(v) for v in values if is_int(v)), default=0)
    total = len(fmt)
    for width, precision in _PRINTF_WIDTH.findall(fmt):
        w, p = (largest_int if n == "*" else int(n or 0) for n in (width, precision))
        if max(w, p) > MAX_INT_ARG:
            raise SecurityError(
                f"chat template used a format width of {max(w, p)} (limit {MAX_INT_ARG})"
            )
        total += max(w, p) + largest_value
        if total > MAX_SEQUENCE:
            raise SecurityError(f"chat template tried to build a {total}+-item string with %")


def check_str_method(
    text: str | bytes, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> None:
    """Bound the str/bytes methods whose result can be far larger than their inputs (str.format is
    bounded field by field by _BoundedFormatter as it runs)."""
    if name in ("format", "format_map"):
        return
    check_ints((*args, *kwargs.values()))
    size = _STR_METHOD_SIZES.get(name, lambda *_: 0)(text, args, kwargs)
    if size > MAX_SEQUENCE:
        raise SecurityError(f"chat template tried to build a {size}-item string with str.{name}")


def _replace_size(text, args, kwargs) -> int:
    old, new = (list(args) + [kwargs.get("old"), kwargs.get("new")])[:2]
    if isinstance(old, TEXT) and isinstance(new, TEXT):
        return len(text) + text.count(old) * len(new)
    return 0


def _join_size(text, args, kwargs) -> int:
    items = args[0] if args else None
    return len(text) * len(items) + item_count(items) if isinstance(items, SIZED) else 0


def _expandtabs_size(text, args, kwargs) -> int:
    tabsize = args[0] if args else kwargs.get("tabsize", 8)
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * tabsize if is_int(tabsize) else 0


def _translate_size(text, args, kwargs) -> int:
    table = args[0] if args else None
    if not isinstance(table, Mapping):
        return 0
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    return len(text) * max(longest, 1)


_STR_METHOD_SIZES: dict[str, Callable[[Any, Sequence[Any], Mapping[str, Any]], int]] = {
    "replace": _replace_size,
    "join": _join_size,
    "expandtabs": _expandtabs_size,
    "translate": _translate_size,
}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_binop(operator: str, left: Any, right: Any) -> int | None:
    """Refuse `'x' * 10**9`, `10 ** 10 ** 9`, runaway `+` and big-int growth before computing them;
    the size of the sequence `*` or `+` is about to build (None: not a sequence)."""
    if operator == "*":
        if is_int(left) and is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, SIZED) and is_int(count):
                if (size := item_count(seq) * max(count, 0)) > MAX_SEQUENCE:
                    raise SecurityError(f"chat template tried to build a {size}-item sequence")
                return size
    elif operator == "**":
        if is_int(right) and abs(right) > MAX_EXPONENT and is_int(left) and abs(left) > 1:
            raise SecurityError(f"chat template tried to raise to the power {right}")
        if (
            is_int(left)
            and is_int(right)
            and right > 0
            and left.bit_length() * right > MAX_INT_BITS
        ):
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, SIZED) and isinstance(right, SIZED):
            if (size := item_count(left) + item_count(right)) > MAX_SEQUENCE:
                raise SecurityError(f"chat template tried to build a {size}-item sequence")
            return size
    elif operator == "%" and isinstance(left, TEXT):
        check_printf(left, right)
    return None
