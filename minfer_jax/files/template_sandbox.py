"""The Jinja2 sandbox chat templates render in: resource bounds, guarded operators and filters.

A chat template is code that came with a model file from the internet, so it is treated as hostile
(chat_template.py's docstring lists what is bounded and why). This module holds the environment
(`environment()`), the per-render budget (`RenderGuard`, installed in `current_guard` by the
renderer) and the limits; chat_template.py compiles and renders with it.
"""

from __future__ import annotations

import datetime
import functools
import json
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from minfer_jax.files.template_budget import (
    MAX_BATCH_INPUT,
    MAX_INT_ARG,
    MAX_JSON_SPACING,
    MAX_OUTPUT,
    MAX_SEQUENCE,
    MAX_SLOW_INPUT,
    SIZED,
    SPEC_NUMBER,
    TEXT,
    built,
    check_binop,
    check_ints,
    check_printf,
    check_sizes,
    check_str_method,
    current_guard,
    is_int,
    item_count,
    spend,
)

_LOOP_GUARD, _CONCAT_GUARD = "_minfer_loop", "_minfer_concat"  # globals the compiled template calls


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
        spend()
        yield item


def _guarded_concat(*values: Any) -> str:
    size = sum(item_count(v) for v in values)
    if size > MAX_SEQUENCE:
        raise SecurityError(f"chat template tried to build a {size}-item string with ~")
    return built("".join(map(str, values)))


def _finalize(value: Any) -> Any:
    """Every `{{ }}` value before it becomes text: a list standing for gigabytes is refused here."""
    if (
        isinstance(value, (list, tuple, dict))
        and (size := item_count(value, MAX_OUTPUT)) > MAX_OUTPUT
    ):
        raise SecurityError(f"chat template tried to print a value of {size}+ characters")
    return value


class _BoundedFormatter(SandboxedFormatter):
    """str.format for templates: every field's spec as resolved
    (`'{:{}{}}'.format('x', 99999, 99999)` nests a width of 9999999999) is bounded, and so is the
    string built, field by field as it runs."""

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self.built = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        for number in SPEC_NUMBER.findall(format_spec):
            if len(number) > 7 or int(number) > MAX_INT_ARG:
                raise SecurityError(
                    f"chat template used a format width of {number} (limit {MAX_INT_ARG})"
                )
        spend()
        text = super().format_field(value, format_spec)
        self.built += len(text)
        if self.built > MAX_SEQUENCE:
            raise SecurityError(
                f"chat template tried to build a {self.built}+-item string with str.format"
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
        spend()
        check_sizes((*args, *kwargs.values()))
        # str.format arrives wrapped by the sandbox; __wrapped__ is the bound method.
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, TEXT):
            check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
        return built(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        spend()
        size = check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        guard = current_guard.get(None)
        if guard is not None and size is not None and isinstance(result, (list, tuple)):
            guard.sizes[id(result)] = (
                result,
                size,
            )  # known without walking it: list doubling stays linear
        return built(result)


class _BoundedNamespace(Namespace):
    """`namespace()` whose attributes cannot grow without bound.

    `{% set ns.s = ns.s ~ ns.s %}` in a loop doubles a string per iteration; `~` cannot be
    intercepted, but the store into the namespace can, and that is the only way such growth
    survives an iteration.
    """

    def __setitem__(self, name: str, value: Any) -> None:
        spend()
        if isinstance(value, (*SIZED, dict)) and item_count(value) > MAX_SEQUENCE:
            raise SecurityError(
                f"chat template stored a {item_count(value)}-item value in a namespace"
            )
        super().__setitem__(name, value)


def _bounded_range(*args: int) -> range:
    """`range` for templates: jinja's per-range cap plus a charge against the render's budget."""
    try:
        result = safe_range(*args)
    except OverflowError as e:  # jinja's MAX_RANGE: a sandbox limit, reported as one
        raise SecurityError(str(e)) from None
    spend(len(result))
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
        spend()
        check_sizes((*args, *kwargs.values()))
        if name != "format":  # format's arguments are data, checked by check_printf
            check_ints((*args[skip:], *kwargs.values()))
        if name == "attr" and len(args) > skip and _private(args[skip]):
            raise SecurityError(f"access to private attribute {args[skip]!r} is not allowed")
        if len(args) >= skip:
            _check_filter_input(name, args[skip - 1], args[skip:], kwargs)
        return built(fn(*args, **kwargs))

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
    if name in ("batch", "slice") and isinstance(value, SIZED) and len(value) > MAX_BATCH_INPUT:
        raise SecurityError(
            f"chat template split a {len(value)}-item value (limit {MAX_BATCH_INPUT})"
        )
    if (
        name == "slice"
        and is_int(slices := _param(args, kwargs, 0, "slices"))
        and slices > MAX_BATCH_INPUT
    ):
        raise SecurityError(f"chat template asked for {slices} slices (limit {MAX_BATCH_INPUT})")
    if name == "format" and isinstance(value, str):
        check_printf(value, tuple(args) or dict(kwargs))
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
    return len(value) if isinstance(value, TEXT) else len(str(value))


def _width_len(width: Any) -> int:
    return width if is_int(width) else len(width) if isinstance(width, str) else 0


# Filters whose output can be (value size) x (parameter size): an upper bound on what each builds.
_FILTER_SIZES: dict[str, Callable[[Any, Sequence[Any], Mapping[str, Any]], int]] = {
    "replace": lambda v, a, k: (
        _text_len(v)
        + str(v).count(str(_param(a, k, 0, "old", ""))) * len(str(_param(a, k, 1, "new", "")))
    ),
    "join": lambda v, a, k: (
        (len(v) * len(str(_param(a, k, 0, "d", ""))) + item_count(v)) if isinstance(v, SIZED) else 0
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
    "pprint": lambda v: item_count(v, MAX_SEQUENCE),
}


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja's lorem-ipsum global, with its paragraph and word counts bounded (integers first:
    `n * 10_000` of a string argument would itself build the bomb)."""
    for name, value in (("n", n), ("min", min), ("max", max)):
        if not is_int(value):
            raise SecurityError(f"chat template passed lipsum a {type(value).__name__} {name}")
    check_ints((n * 10_000, min, max * 10_000))
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
def environment() -> _ChatTemplateEnvironment:
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
