"""Render a GGUF's chat template (Jinja2, HF `apply_chat_template` dialect) inside a sandbox.

A chat template is code that came with a model file from the internet, so it is treated as
hostile:
- `ImmutableSandboxedEnvironment` keeps it away from Python internals (dunder attributes,
  `str.format` tricks, mutating `messages`); any such attempt, and any private name asked of
  an object that lacks it (`messages['__dict__']`, `|attr('_x')`), raises at once instead of
  rendering as an empty Undefined, so a probe cannot fail silently and keep probing;
- resource bombs are bounded: `range` (jinja's 100k per range, plus a per-render total), the
  `*`, `**`, `+`, `%` and `~` operators (sizes count nested contents: `['x' * 4000000] * 1000`
  is 4e9 items), int growth in bits, size parameters of str methods and filters, and what one
  call can build from them before it runs (`indent` and `expandtabs` widths times lines or
  tabs, every printf conversion's width, `str.format` fields as resolved, nested specs too,
  `tojson` separators and indent, `translate` tables, `wordwrap` strings), namespace stores;
  filters whose cost grows per item in Python (`urlize`, `wordwrap`, `striptags`, `sort`, ...)
  take a bounded input, and `striptags` runs in linear time whatever markupsafe is installed;
  a step budget and a wall-clock limit (1 s: a chat request waits for it) are checked on
  every call, operator, range item and loop iteration (the parsed template is rewritten so each
  `{% for %}` and `~` passes through a guard), every value printed is size-checked, and the items
  built over the whole render are summed and capped (a memory bound). The source itself is
  limited to MAX_TEMPLATE_CHARS before compiling. This bounds the known bombs; it is not a hard
  CPU/memory limit (only a separate process gives that);
- every failure, whatever Python or Jinja raised, leaves as `minfer_jax.errors.TemplateError`.

The dialect matches transformers: trim_blocks/lstrip_blocks, `loopcontrols`, a `tojson` filter
that does not HTML-escape or sort keys, `raise_exception`, `strftime_now`, `bos_token` and
`eos_token`.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
    safe_range,
)
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from minfer_jax.errors import TemplateError

# Used when a file has no chat template, whatever its family: Qwen2-family instruct models speak
# ChatML; for another family's base model it is a plain, readable layout of the messages.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Bounds for one render. Generous for real templates (a few operations per message), small
# enough that a hostile one fails in well under a second of work or a few tens of MB.
MAX_STEPS = 2_000_000  # calls + operator uses + range items, summed over the render
# wall clock, checked whenever a step is spent: a chat request waits this long at most
MAX_SECONDS = 1.0
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
_LOOP_GUARD, _CONCAT_GUARD = "_minfer_loop", "_minfer_concat"  # globals the compiled template calls

_SIZED = (str, bytes, list, tuple)
_TEXT = (str, bytes)

# The budget of the render running in this thread/task; templates cannot name it.
_current_guard: contextvars.ContextVar[_RenderGuard] = contextvars.ContextVar("minfer_chat_guard")


class _RenderGuard:
    """Step, time and output budget of one render; hostile templates hit these, real ones don't."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.built_items = 0
        self.sizes: dict[
            int, tuple[Any, int]
        ] = {}  # id -> (container, _size): kept alive, so ids stay unique

    def built(self, value: Any) -> Any:
        """Charge a value an operator, call or filter built; the sum over a render bounds its
        memory."""
        if isinstance(value, (*_SIZED, dict)):
            self.built_items += _size(value)
            if self.built_items > MAX_BUILT:
                raise SecurityError(
                    f"chat template built more than {MAX_BUILT} items in one render"
                )
        return value

    def spend(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise SecurityError(f"chat template exceeded {MAX_STEPS} steps (runaway loop?)")
        if time.monotonic() > self.deadline:
            raise SecurityError(f"chat template ran longer than {MAX_SECONDS:g} s")


def _built(value: Any) -> Any:
    guard = _current_guard.get(None)
    return value if guard is None else guard.built(value)


def _spend(n: int = 1) -> None:
    """Charge the current render; a no-op outside `render_chat_template` (e.g. compile time)."""
    guard = _current_guard.get(None)
    if guard is not None:
        guard.spend(n)


def _size(value: Any, limit: int = MAX_SEQUENCE) -> int:
    """Items `value` stands for when printed or joined: a str its length, a container its items and
    their contents (`['x' * 4000000] * 1000` is 4e9, not 1000); stops counting once past limit."""
    if isinstance(value, _TEXT):
        return len(value)
    if not isinstance(value, (list, tuple, dict)):
        return 1
    guard = _current_guard.get(None)
    known = guard.sizes.get(id(value)) if guard is not None else None
    if known is not None and known[0] is value:
        return known[1]
    total = len(value)
    for item in value.items() if isinstance(value, dict) else value:
        if isinstance(item, _TEXT):
            total += len(item)
        elif isinstance(item, (list, tuple, dict)):
            total += _size(item, limit - total)
        if total > limit:
            return total
    if guard is not None:  # containers cannot change inside the immutable sandbox: walk each once
        guard.sizes[id(value)] = (value, total)
    return total


def _check_sizes(values: Iterable[Any]) -> None:
    """Refuse oversized strings/lists as arguments: they only exist to amplify further."""
    for value in values:
        if isinstance(value, (*_SIZED, dict)) and (size := _size(value)) > MAX_SEQUENCE:
            raise SecurityError(
                f"chat template passed a value of {size}+ items to a call (limit {MAX_SEQUENCE})"
            )


def _check_ints(values: Iterable[Any]) -> None:
    """Refuse huge widths/counts where an int parameter sizes the result (`' '.ljust(10**10)`).

    Only applied to str methods and filter parameters: a large int as data (a timestamp in a
    message, a tool argument) is fine and must render.
    """
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise SecurityError(f"chat template passed {value} as a size (limit {MAX_INT_ARG})")


_PRINTF_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_SPEC_NUMBER = re.compile(r"\d+")


def _printed_size(value: Any) -> int:
    """An upper bound on the characters `value` prints as (`%s`, `{}`)."""
    if _is_int(value):
        return value.bit_length() // 3 + 2  # >= its decimal digits and sign
    if isinstance(value, float):
        return 330  # '%f' % 1e308
    if isinstance(value, (list, tuple, dict)):
        return 4 * _size(value)  # quotes, commas and spaces of its repr
    return _size(value)


def _check_printf(fmt: str, args: Any) -> None:
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
    largest_int = max((abs(v) for v in values if _is_int(v)), default=0)
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


def _check_str_method(
    text: str | bytes, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> None:
    """Bound the str/bytes methods whose result can be far larger than their inputs (str.format is
    bounded field by field by _BoundedFormatter as it runs)."""
    if name in ("format", "format_map"):
        return
    _check_ints((*args, *kwargs.values()))
    size = _STR_METHOD_SIZES.get(name, lambda *_: 0)(text, args, kwargs)
    if size > MAX_SEQUENCE:
        raise SecurityError(f"chat template tried to build a {size}-item string with str.{name}")


def _replace_size(text, args, kwargs) -> int:
    old, new = (list(args) + [kwargs.get("old"), kwargs.get("new")])[:2]
    if isinstance(old, _TEXT) and isinstance(new, _TEXT):
        return len(text) + text.count(old) * len(new)
    return 0


def _join_size(text, args, kwargs) -> int:
    items = args[0] if args else None
    return len(text) * len(items) + _size(items) if isinstance(items, _SIZED) else 0


def _expandtabs_size(text, args, kwargs) -> int:
    tabsize = args[0] if args else kwargs.get("tabsize", 8)
    tab = "\t" if isinstance(text, str) else b"\t"
    return len(text) + text.count(tab) * tabsize if _is_int(tabsize) else 0


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_binop(operator: str, left: Any, right: Any) -> int | None:
    """Refuse `'x' * 10**9`, `10 ** 10 ** 9`, runaway `+` and big-int growth before computing them;
    the size of the sequence `*` or `+` is about to build (None: not a sequence)."""
    if operator == "*":
        if (
            _is_int(left)
            and _is_int(right)
            and left.bit_length() + right.bit_length() > MAX_INT_BITS
        ):
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and _is_int(count):
                if (size := _size(seq) * max(count, 0)) > MAX_SEQUENCE:
                    raise SecurityError(f"chat template tried to build a {size}-item sequence")
                return size
    elif operator == "**":
        if _is_int(right) and abs(right) > MAX_EXPONENT and _is_int(left) and abs(left) > 1:
            raise SecurityError(f"chat template tried to raise to the power {right}")
        if (
            _is_int(left)
            and _is_int(right)
            and right > 0
            and left.bit_length() * right > MAX_INT_BITS
        ):
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, _SIZED) and isinstance(right, _SIZED):
            if (size := _size(left) + _size(right)) > MAX_SEQUENCE:
                raise SecurityError(f"chat template tried to build a {size}-item sequence")
            return size
    elif operator == "%" and isinstance(left, _TEXT):
        _check_printf(left, right)
    return None


def _private(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("_")


class _Guards(NodeTransformer):
    """Rewrites a parsed template so loops and `~` pass through the render budget.

    `{% for %}` over a long string or list calls nothing per item, so a nested loop would never
    reach a step check; `a ~ b` joins in one C call. Each loop's iterable is wrapped in
    _LOOP_GUARD (one step per item) and each `~` becomes _CONCAT_GUARD (size checked first).
    """

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Call(
            nodes.Name(_LOOP_GUARD, "load"), [node.iter], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(
            nodes.Name(_CONCAT_GUARD, "load"), list(node.nodes), [], None, None, lineno=node.lineno
        )


def _guarded_loop(iterable: Any) -> Iterator[Any]:
    for item in iterable:
        _spend()
        yield item


def _guarded_concat(*values: Any) -> str:
    size = sum(_size(v) for v in values)
    if size > MAX_SEQUENCE:
        raise SecurityError(f"chat template tried to build a {size}-item string with ~")
    return _built("".join(map(str, values)))


def _finalize(value: Any) -> Any:
    """Every `{{ }}` value before it becomes text: a list standing for gigabytes is refused here."""
    if isinstance(value, (list, tuple, dict)) and (size := _size(value, MAX_OUTPUT)) > MAX_OUTPUT:
        raise SecurityError(f"chat template tried to print a value of {size}+ characters")
    return value


class _BoundedFormatter(SandboxedFormatter):
    """str.format for templates: every field's spec as resolved
    (`'{:{}{}}'.format('x', 99999, 99999)` nests a width of 9999999999) is bounded, and so is the
    string built, field by field as it runs."""

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._built = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        for number in _SPEC_NUMBER.findall(format_spec):
            if len(number) > 7 or int(number) > MAX_INT_ARG:
                raise SecurityError(
                    f"chat template used a format width of {number} (limit {MAX_INT_ARG})"
                )
        _spend()
        text = super().format_field(value, format_spec)
        self._built += len(text)
        if self._built > MAX_SEQUENCE:
            raise SecurityError(
                f"chat template tried to build a {self._built}+-item string with str.format"
            )
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    """The same for Markup.format (its fields are escaped)."""


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with unsafe access made fatal and with operator and call budgets."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guards().visit(super()._parse(source, name, filename))

    def getitem(self, obj: Any, argument: Any) -> Any:
        # `messages['__dict__']`: the stock sandbox falls back to an attribute and, finding none,
        # renders ''. A private name is refused unless obj really holds that key.
        if _private(argument):
            try:
                return obj[argument]
            except (TypeError, LookupError):
                raise SecurityError(
                    f"access to private attribute {argument!r} is not allowed"
                ) from None
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        # Private names are refused even where they do not exist (`namespace().__init__` would
        # otherwise render as an empty Undefined), so every probe fails loudly.
        if isinstance(attribute, str) and attribute.startswith("_"):
            raise SecurityError(f"access to private attribute {attribute!r} is not allowed")
        return super().getattr(obj, attribute)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that only raises when used; rendering it prints
        # nothing, which hides the attempt. Fail at the access instead.
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # jinja's own, with _BoundedFormatter in place of SandboxedFormatter
        if (
            not isinstance(value, (types.MethodType, types.BuiltinMethodType))
            or value.__name__ not in ("format", "format_map")
            or not isinstance(value.__self__, str)
        ):
            return None
        text, is_format_map = value.__self__, value.__name__ == "format_map"
        formatter = (
            _BoundedEscapeFormatter(self, escape=text.escape)
            if isinstance(text, Markup)
            else _BoundedFormatter(self)
        )

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keywords")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _spend()
        _check_sizes((*args, *kwargs.values()))
        # str.format arrives wrapped by the sandbox; __wrapped__ is the bound method.
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, _TEXT):
            _check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
        return _built(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend()
        size = _check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        guard = _current_guard.get(None)
        if guard is not None and size is not None and isinstance(result, (list, tuple)):
            guard.sizes[id(result)] = (
                result,
                size,
            )  # known without walking it: list doubling stays linear
        return _built(result)


class _BoundedNamespace(Namespace):
    """`namespace()` whose attributes cannot grow without bound.

    `{% set ns.s = ns.s ~ ns.s %}` in a loop doubles a string per iteration; `~` cannot be
    intercepted, but the store into the namespace can, and that is the only way such growth
    survives an iteration.
    """

    def __setitem__(self, name: str, value: Any) -> None:
        _spend()
        if isinstance(value, (*_SIZED, dict)) and _size(value) > MAX_SEQUENCE:
            raise SecurityError(f"chat template stored a {_size(value)}-item value in a namespace")
        super().__setitem__(name, value)


def _bounded_range(*args: int) -> range:
    """`range` for templates: jinja's per-range cap plus a charge against the render's budget."""
    try:
        result = safe_range(*args)
    except OverflowError as e:  # jinja's MAX_RANGE: a sandbox limit, reported as one
        raise SecurityError(str(e)) from None
    _spend(len(result))
    return result


def _guarded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the filter registered as `name` so its size parameters are checked (`'x'|center(10**9)`
    bypasses `call`) and what it would build is bounded before it runs.

    The filtered value itself (first argument after any context jinja passes) is data and is
    only size-checked, not int-checked.
    """
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is None else 2  # pass_context & co.

    @functools.wraps(fn)  # also copies jinja's pass_context/pass_eval_context marker
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _spend()
        _check_sizes((*args, *kwargs.values()))
        if name != "format":  # format's arguments are data, checked by _check_printf
            _check_ints((*args[skip:], *kwargs.values()))
        if name == "attr" and len(args) > skip and _private(args[skip]):
            raise SecurityError(f"access to private attribute {args[skip]!r} is not allowed")
        if len(args) >= skip:
            _check_filter_input(name, args[skip - 1], args[skip:], kwargs)
        return _built(fn(*args, **kwargs))

    return guarded


def _check_filter_input(
    name: str, value: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> None:
    """Refuse a filter call whose output or running time would be out of bounds, before it runs."""
    if name in _SLOW_FILTERS and (n := _SLOW_FILTERS[name](value)) > MAX_SLOW_INPUT:
        raise SecurityError(
            f"chat template applied the filter `{name}` to a value of {n} items (limit "
            f"{MAX_SLOW_INPUT})"
        )
    if name in ("batch", "slice") and isinstance(value, _SIZED) and len(value) > MAX_BATCH_INPUT:
        raise SecurityError(
            f"chat template split a {len(value)}-item value (limit {MAX_BATCH_INPUT})"
        )
    if (
        name == "slice"
        and _is_int(slices := _param(args, kwargs, 0, "slices"))
        and slices > MAX_BATCH_INPUT
    ):
        raise SecurityError(f"chat template asked for {slices} slices (limit {MAX_BATCH_INPUT})")
    if name == "format" and isinstance(value, str):
        _check_printf(value, tuple(args) or dict(kwargs))
        return
    size = _FILTER_SIZES[name](value, args, kwargs) if name in _FILTER_SIZES else 0
    if size > MAX_SEQUENCE:
        raise SecurityError(
            f"chat template tried to build a {size}-item string with the filter `{name}`"
        )


def _param(
    args: Sequence[Any], kwargs: Mapping[str, Any], index: int, keyword: str, default: Any = None
) -> Any:
    """A filter's parameter, given by position (after the value) or by keyword."""
    return args[index] if len(args) > index else kwargs.get(keyword, default)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, _TEXT) else len(str(value))


def _width_len(width: Any) -> int:
    return width if _is_int(width) else len(width) if isinstance(width, str) else 0


# Filters whose output can be (value size) x (parameter size): an upper bound on what each builds.
_FILTER_SIZES: dict[str, Callable[[Any, Sequence[Any], Mapping[str, Any]], int]] = {
    "replace": lambda v, a, k: (
        _text_len(v)
        + str(v).count(str(_param(a, k, 0, "old", ""))) * len(str(_param(a, k, 1, "new", "")))
    ),
    "join": lambda v, a, k: (
        (len(v) * len(str(_param(a, k, 0, "d", ""))) + _size(v)) if isinstance(v, _SIZED) else 0
    ),
    "indent": lambda v, a, k: (
        _text_len(v) + (str(v).count("\n") + 1) * _width_len(_param(a, k, 0, "width", 4))
    ),
    "wordwrap": lambda v, a, k: (
        _text_len(v) * (1 + len(str(_param(a, k, 2, "wrapstring", "") or "")))
    ),
}

# Filters that spend Python time per character (text) or per item (sequences): the size they may
# take.
_SLOW_FILTERS: dict[str, Callable[[Any], int]] = {
    **{name: _text_len for name in ("urlize", "wordwrap", "title", "striptags")},
    **{
        name: (lambda v: len(v) if hasattr(v, "__len__") else 0)
        for name in ("sort", "unique", "groupby", "max", "min", "dictsort")
    },
    "pprint": lambda v: _size(v, MAX_SEQUENCE),
}


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja's lorem-ipsum global, with its paragraph and word counts bounded (integers first:
    `n * 10_000` of a string argument would itself build the bomb)."""
    for name, value in (("n", n), ("min", min), ("max", max)):
        if not _is_int(value):
            raise SecurityError(f"chat template passed lipsum a {type(value).__name__} {name}")
    _check_ints((n * 10_000, min, max * 10_000))
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own escapes <>&' and sorts keys), encoded
    piece by piece so a separator or indent repeated per item cannot build more than
    MAX_SEQUENCE."""
    spacing = [indent, *(separators if isinstance(separators, (list, tuple)) else [separators])]
    if any(_width_len(s) > MAX_JSON_SPACING for s in spacing):
        raise SecurityError(
            f"chat template passed a tojson indent or separator over {MAX_JSON_SPACING} characters"
        )
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    parts, size = [], 0
    for part in encoder.iterencode(value):
        size += len(part)
        if size > MAX_SEQUENCE:
            raise SecurityError(f"chat template's tojson output exceeded {MAX_SEQUENCE} characters")
        parts.append(part)
    return "".join(parts)


def _striptags(value: Any) -> str:
    """jinja's `striptags` (markupsafe 3's algorithm: comments, then tags, spaces collapsed,
    entities unescaped) in linear time: markupsafe 2 rebuilds the string per tag, minutes on a few
    MB of `<>`."""
    text = str(value.__html__() if hasattr(value, "__html__") else value)
    parts, pos = [], 0
    while (start := text.find("<", pos)) != -1:
        comment = text.startswith("<!--", start)
        end = text.find("-->", start + 4) if comment else text.find(">", start)
        if end == -1:  # unclosed: the rest stays
            break
        parts.append(text[pos:start])
        pos = end + (3 if comment else 1)
    if pos > 0:
        parts.append(text[pos:])
        text = "".join(parts)
    return Markup(" ".join(text.split())).unescape()


def _raise_exception(message: Any) -> None:
    """Templates call this to reject input (e.g. a bad role order); it surfaces as TemplateError."""
    raise TemplateError(f"chat template rejected the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    """transformers exposes this for templates that print today's date (Llama 3 style)."""
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _ChatTemplateEnvironment:
    """The one sandbox, built on first use (not at import) and shared: it is read-only."""
    env = _ChatTemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined,
        autoescape=False,
        finalize=_finalize,
    )
    env.filters.update(tojson=_tojson, striptags=_striptags)
    env.filters = {name: _guarded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.update(
        range=_bounded_range,
        namespace=_BoundedNamespace,
        lipsum=_bounded_lipsum,
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        **{_LOOP_GUARD: _guarded_loop, _CONCAT_GUARD: _guarded_concat},
    )
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template text; generation renders the same one every turn."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # a compile-time crash is still the template's fault
        raise TemplateError(f"chat template failed to compile: {type(e).__name__}: {e}") from None


def _render(compiled: jinja2.Template, context: dict[str, Any]) -> str:
    """Stream the output so the size cap applies before a bomb is fully built."""
    guard = _RenderGuard()
    token = _current_guard.set(guard)
    try:
        parts: list[str] = []
        size = 0
        for chunk in compiled.generate(**context):
            size += len(chunk)
            if size > MAX_OUTPUT:
                raise SecurityError(f"chat template output exceeded {MAX_OUTPUT} characters")
            guard.spend()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _current_guard.reset(token)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render `messages` with `template` as transformers' apply_chat_template(tokenize=False) does.

    `extra` becomes template variables (bos_token, eos_token, tools, documents, ...). Raises
    TemplateError for syntax errors, sandbox violations, exhausted budgets, `raise_exception`
    and any other failure inside the template.
    """
    if not isinstance(template, str):
        raise TemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(
            f"chat template has {len(template)} characters, more than the limit of "
            f"{MAX_TEMPLATE_CHARS} (real templates have a few thousand)"
        )
    compiled = _compile(template)
    if isinstance(messages, (str, bytes, Mapping)) or not all(
        isinstance(m, Mapping) for m in messages
    ):
        raise TemplateError("messages must be a list of mappings ({'role': ..., 'content': ...})")
    context = {
        "bos_token": "",
        "eos_token": "",
        **extra,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": bool(add_generation_prompt),
    }
    try:
        return _render(compiled, context)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
    except Exception as e:  # the template is untrusted: whatever it provoked is its error
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
