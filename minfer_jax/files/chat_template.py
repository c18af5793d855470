"""Render a GGUF's chat template (Jinja2, HF `apply_chat_template` dialect) inside a sandbox.

A chat template is code that came with a model file from the internet, so it is treated as
hostile:
- `ImmutableSandboxedEnvironment` keeps it away from Python internals (dunder attributes,
  `str.format` tricks, mutating `messages`); any such attempt, and any private name asked of
  an object that lacks it (`messages['__dict__']`, `|attr('_x')`), raises at once instead of
  rendering as an empty Undefined, so a probe cannot fail silently and keep probing;
- resource bombs are bounded: `range` (jinja's 100k per range, plus a per-render total), the
  `*`, `**`, `+`, `%` and `~` operators (sizes count nested contents: `['x' * 4000000] * 1000`
  is 4e9 items), int growth in bits, size parameters of str methods and filters, format widths
  (nested ones too) and namespace stores; a step budget and a wall-clock limit are checked on
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
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from minfer_jax.errors import TemplateError

# Used when a file has no chat template: every Qwen2-family instruct model speaks ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Bounds for one render. Generous for real templates (a few operations per message), small
# enough that a hostile one fails in well under a second of work or a few tens of MB.
MAX_STEPS = 2_000_000  # calls + operator uses + range items, summed over the render
MAX_SECONDS = 10.0  # wall clock, checked whenever a step is spent
MAX_SEQUENCE = 1 << 22  # longest str/list an operator may build, in items (4M chars >> any context)
MAX_INT_ARG = 1 << 20  # largest size-like int for str methods/filters (ljust, center, ...)
MAX_EXPONENT = 4096  # largest int exponent for `**`
MAX_OUTPUT = 1 << 24  # characters of rendered output
MAX_BUILT = 1 << 25  # items all operators, calls and filters of one render may build, summed (a memory bound)
MAX_INT_BITS = 1 << 16  # largest int `*` / `**` may build (~20k digits)
MAX_TEMPLATE_CHARS = 1 << 16  # template source: real ones are 1-20 KB; 64K compiles in ~1.5 s on a busy CPU
MAX_BATCH_INPUT = 1 << 16  # items `batch`/`slice` may split (each item becomes a list)
_LOOP_GUARD, _CONCAT_GUARD = "_minfer_loop", "_minfer_concat"  # globals the compiled template calls

_SIZED = (str, list, tuple)

# The budget of the render running in this thread/task; templates cannot name it.
_current_guard: contextvars.ContextVar[_RenderGuard] = contextvars.ContextVar("minfer_chat_guard")


class _RenderGuard:
    """Step, time and output budget of one render; hostile templates hit these, real ones don't."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.built_items = 0
        self.sizes: dict[int, tuple[Any, int]] = {}  # id -> (container, _size): kept alive, so ids stay unique

    def built(self, value: Any) -> Any:
        """Charge a value an operator, call or filter built; the sum over a render bounds its memory."""
        if isinstance(value, (*_SIZED, dict)):
            self.built_items += _size(value)
            if self.built_items > MAX_BUILT:
                raise SecurityError(f"chat template built more than {MAX_BUILT} items in one render")
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
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple, dict)):
        return 1
    guard = _current_guard.get(None)
    known = guard.sizes.get(id(value)) if guard is not None else None
    if known is not None and known[0] is value:
        return known[1]
    total = len(value)
    for item in (value.items() if isinstance(value, dict) else value):
        if isinstance(item, str):
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
            raise SecurityError(f"chat template passed a value of {size}+ items to a call (limit {MAX_SEQUENCE})")


def _check_ints(values: Iterable[Any]) -> None:
    """Refuse huge widths/counts where an int parameter sizes the result (`' '.ljust(10**10)`).

    Only applied to str methods and filter parameters: a large int as data (a timestamp in a
    message, a tool argument) is fine and must render.
    """
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise SecurityError(f"chat template passed {value} as a size (limit {MAX_INT_ARG})")


_PRINTF_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC_NUMBER = re.compile(r"\{[^{}]*:[^{}]*?(\d+)")


def _check_printf(fmt: str, args: Any) -> None:
    """`'%999999999d' % 1` and `'%*d' % (10**9, 1)` build gigabytes from a few characters."""
    for width, precision in _PRINTF_WIDTH.findall(fmt):
        for number in (width, precision):
            if number == "*":
                _check_ints(args if isinstance(args, tuple) else (args,))
            elif number and int(number) > MAX_INT_ARG:
                raise SecurityError(f"chat template used a format width of {number}")


def _check_str_method(text: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Bound the str methods whose result can be far larger than their inputs."""
    if name in ("format", "format_map"):  # arguments are data; widths live in the string
        for number in _FORMAT_SPEC_NUMBER.findall(text):
            if int(number) > MAX_INT_ARG:
                raise SecurityError(f"chat template used a format width of {number}")
        values = (*args, *kwargs.values())
        if "{" in text.partition(":")[2] or any("{" in spec for spec in _format_specs(text)):
            _check_ints(values)  # '{:{}}'.format('x', 3000000000): the width is an argument
        size = len(text) + sum(_size(v) for v in values) * max(1, text.count("{"))
        if size > MAX_SEQUENCE:
            raise SecurityError(f"chat template tried to build a {size}-item string with str.{name}")
        return
    _check_ints((*args, *kwargs.values()))
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        size = len(text) + text.count(args[0]) * len(args[1])
    elif name == "join" and args and isinstance(args[0], _SIZED):
        size = len(text) * len(args[0]) + _size(args[0])
    else:
        return
    if size > MAX_SEQUENCE:
        raise SecurityError(f"chat template tried to build a {size}-item string with str.{name}")


def _format_specs(text: str) -> list[str]:
    try:
        return [spec or "" for _, _, spec, _ in string.Formatter().parse(text)]
    except ValueError:  # a malformed format string: str.format itself reports it
        return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse `'x' * 10**9`, `10 ** 10 ** 9`, runaway `+` and big-int growth before computing them."""
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and _is_int(count) and _size(seq) * count > MAX_SEQUENCE:
                raise SecurityError(f"chat template tried to build a {_size(seq) * count}-item sequence")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
    elif operator == "**":
        if _is_int(right) and abs(right) > MAX_EXPONENT and _is_int(left) and abs(left) > 1:
            raise SecurityError(f"chat template tried to raise to the power {right}")
        if _is_int(left) and _is_int(right) and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise SecurityError(f"chat template tried to build an int of over {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, _SIZED) and isinstance(right, _SIZED) and _size(left) + _size(right) > MAX_SEQUENCE:
            raise SecurityError(f"chat template tried to build a {_size(left) + _size(right)}-item sequence")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left, right)
        if len(left) + _size(right) * max(1, left.count("%")) > MAX_SEQUENCE:
            raise SecurityError("chat template tried to build an oversized string with %")


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
        node.iter = nodes.Call(nodes.Name(_LOOP_GUARD, "load"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT_GUARD, "load"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


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
                raise SecurityError(f"access to private attribute {argument!r} is not allowed") from None
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
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _spend()
        _check_sizes((*args, *kwargs.values()))
        # str.format arrives wrapped by the sandbox; __wrapped__ is the bound method.
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
        return _built(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend()
        _check_binop(operator, left, right)
        return _built(super().call_binop(context, operator, left, right))


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


def _guarded_filter(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter so its size parameters are checked (`'x'|center(10**9)` bypasses `call`).

    The filtered value itself (first argument after any context jinja passes) is data and is
    only size-checked, not int-checked.
    """
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is None else 2  # pass_context & co.

    @functools.wraps(fn)  # also copies jinja's pass_context/pass_eval_context marker
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _spend()
        _check_sizes((*args, *kwargs.values()))
        if fn.__name__ != "do_format":  # format's arguments are data, checked by _check_printf
            _check_ints((*args[skip:], *kwargs.values()))
        if fn.__name__ == "do_attr" and len(args) > skip and _private(args[skip]):
            raise SecurityError(f"access to private attribute {args[skip]!r} is not allowed")
        if fn.__name__ in ("do_batch", "do_slice") and len(args) >= skip and isinstance(args[skip - 1], _SIZED) \
                and len(args[skip - 1]) > MAX_BATCH_INPUT:
            raise SecurityError(f"chat template split a {len(args[skip - 1])}-item value (limit {MAX_BATCH_INPUT})")
        if len(args) >= skip:
            _check_filter_product(fn.__name__, args[skip - 1], args[skip:], kwargs)
        return _built(fn(*args, **kwargs))

    return guarded


def _check_filter_product(name: str, value: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """The filters whose output is (value size) x (parameter size): format, replace, join, indent."""
    if name == "do_format" and isinstance(value, str):
        _check_printf(value, tuple(args) or tuple(kwargs.values()))
        return
    params = [*args, *kwargs.values()]
    pieces = {"do_replace": lambda: str(value).count(str(params[0])) if params else 0,
              "do_join": lambda: len(value) if isinstance(value, _SIZED) else 0,
              "do_indent": lambda: str(value).count("\n") + 1}
    if name in pieces:
        longest = max((len(p) for p in params if isinstance(p, str)), default=0)
        size = pieces[name]() * longest + (_size(value) if name == "do_join" else 0)  # join: its items too
        if size > MAX_SEQUENCE:
            raise SecurityError(f"chat template tried to build a {size}-item string with a filter")


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja's lorem-ipsum global, with its paragraph and word counts bounded."""
    _check_ints((n * 10_000, min, max * 10_000))
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain json.dumps (jinja's own escapes <>&' and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


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
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined, autoescape=False, finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(fn) for name, fn in env.filters.items()}
    env.globals.update(range=_bounded_range, namespace=_BoundedNamespace, lipsum=_bounded_lipsum,
                       raise_exception=_raise_exception, strftime_now=_strftime_now,
                       **{_LOOP_GUARD: _guarded_loop, _CONCAT_GUARD: _guarded_concat})
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


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render `messages` with `template` as transformers' apply_chat_template(tokenize=False) does.

    `extra` becomes template variables (bos_token, eos_token, tools, documents, ...). Raises
    TemplateError for syntax errors, sandbox violations, exhausted budgets, `raise_exception`
    and any other failure inside the template.
    """
    if not isinstance(template, str):
        raise TemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"chat template has {len(template)} characters, more than the limit of "
                            f"{MAX_TEMPLATE_CHARS} (real templates have a few thousand)")
    compiled = _compile(template)
    if isinstance(messages, (str, bytes, Mapping)) or not all(isinstance(m, Mapping) for m in messages):
        raise TemplateError("messages must be a list of mappings ({'role': ..., 'content': ...})")
    context = {"bos_token": "", "eos_token": "", **extra,
               "messages": [dict(m) for m in messages],
               "add_generation_prompt": bool(add_generation_prompt)}
    try:
        return _render(compiled, context)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template blocked by the sandbox: {e}") from e
    except Exception as e:  # the template is untrusted: whatever it provoked is its error
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
