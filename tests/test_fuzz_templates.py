"""Fuzz: generated hostile chat templates render (bounded output) or raise TemplateError, in bounded
time and memory.

Templates are built from fragments of the known bomb families (string and list amplification,
format widths, big-int growth, nested loops over long iterables, namespace doubling, recursion,
private attributes, filters with size parameters) combined and nested at random. CI runs a fixed
derandomized set; MINFER_FUZZ_EXAMPLES=5000 runs a long random one.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import FUZZ_EXAMPLES_ENV, bounded, fuzz_settings
from minfer_jax.errors import TemplateError
from minfer_jax.files import template_budget
from minfer_jax.files.chat_template import MAX_OUTPUT, render_chat_template

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi " * 50},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "ok"},
]
SIZES = [
    "0",
    "1",
    "3",
    "1000",
    "100000",
    "4000000",
    "3000000000",
    "10**9",
    "2**31",
    "-1",
    "(10**6)",
]
NAMES = [
    "__class__",
    "__dict__",
    "_x",
    "__init__",
    "__globals__",
    "mro",
    "items",
    "role",
    "content",
    "format",
    "__subclasses__",
    "append",
    "upper",
]
ATOMS = [
    "'x'",
    "'ab'",
    "messages",
    "messages[0]",
    "messages[0]['content']",
    "[1, 2]",
    "['x' * 1000]",
    "7",
    "2**4000",
    "loop",
    "namespace(a=1)",
    "range(5)",
    "'%s%s'",
    "'{0}{0}'",
    "none",
    "bos_token",
    "{}",
]
FILTERS = [
    "join",
    "list",
    "string",
    "length",
    "tojson",
    "upper",
    "center({n})",
    "indent({n})",
    "batch({n})",
    "replace('x', 'x' * {n})",
    "format({n})",
    "attr('{name}')",
    "map(attribute='{name}')",
    "selectattr('{name}')",
    "sort(attribute='{name}')",
    "join('x' * {n})",
    "truncate({n})",
    "wordwrap({n})",
    "first",
    "last",
    "unique",
    "reverse",
    "sum",
    "slice({n})",
    "int",
    "float",
    "pprint",
    "items",
    "e",
]


@st.composite
def expressions(draw, depth: int = 0):
    n, name = draw(st.sampled_from(SIZES)), draw(st.sampled_from(NAMES))
    if depth >= 3:
        return draw(st.sampled_from(ATOMS))
    sub = expressions(depth + 1)
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return f"({draw(sub)} {draw(st.sampled_from(['*', '**', '+', '~', '%', '//', '-']))} {n})"
    if kind == 1:
        return f"({draw(sub)} {draw(st.sampled_from(['*', '+', '~', '%']))} {draw(sub)})"
    if kind == 2:
        return f"({draw(sub)}|{draw(st.sampled_from(FILTERS)).format(n=n, name=name)})"
    if kind == 3:
        return f"{draw(sub)}.{name}" if draw(st.booleans()) else f"{draw(sub)}['{name}']"
    if kind == 4:
        return (
            f"'{{:{{}}}}'.format({draw(sub)}, {n})"
            if draw(st.booleans())
            else f"{draw(sub)}.ljust({n})"
        )
    if kind == 5:
        return f"[{draw(sub)}] * {n}"
    if kind == 6:
        return f"range({n})"
    return draw(st.sampled_from(ATOMS))


@st.composite
def templates(draw, depth: int = 0):
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 7 if depth < 2 else 2))
        expr = draw(expressions())
        if kind <= 2:
            parts.append(f"{{{{ {expr} }}}}")
        elif kind == 3:
            parts.append(f"{{% for v in {expr} %}}{draw(templates(depth + 1))}{{% endfor %}}")
        elif kind == 4:
            parts.append(
                f"{{% set ns = namespace(s={expr}) %}}"
                f"{{% for i in range({draw(st.sampled_from(SIZES))}) %}}"
                f"{{% set ns.s = ns.s {draw(st.sampled_from(['~', '+', '*']))} ns.s %}}"
                "{% endfor %}{{ ns.s|length }}"
            )
        elif kind == 5:
            parts.append(
                f"{{% macro f(s) %}}{{{{ f(s ~ {expr}) }}}}{{% endmacro %}}{{{{ f('x') }}}}"
            )
        elif kind == 6:
            parts.append(f"{{% if {expr} %}}{draw(templates(depth + 1))}{{% else %}}y{{% endif %}}")
        else:
            parts.append(f"{{% set t = {expr} %}}{{{{ t ~ t }}}}")
    return "".join(parts)


@fuzz_settings(120, deadline_ms=None)
@given(template=templates())
def test_fuzz_templates(template, monkeypatch_steps):
    try:
        out = bounded(
            lambda: render_chat_template(template, MESSAGES),
            seconds=template_budget.MAX_SECONDS + 2,
            megabytes=400,
            rss=True,
        )
    except TemplateError:
        event("refused")
        return
    event("rendered")
    assert isinstance(out, str) and len(out) <= MAX_OUTPUT


@fuzz_settings(60, deadline_ms=None)
@given(
    template=st.text(
        alphabet=st.sampled_from(list("{}%#-+~*()[]'\".|, _=!<>abcxsetforinendifmacro0123456789")),
        max_size=80,
    )
)
def test_fuzz_template_syntax(template, monkeypatch_steps):
    """Arbitrary template text: rendered or TemplateError (syntax errors, undefined calls ...),
    never anything else."""
    try:
        out = bounded(
            lambda: render_chat_template(template, MESSAGES),
            seconds=template_budget.MAX_SECONDS + 2,
            megabytes=400,
            rss=True,
        )
    except TemplateError:
        return
    assert isinstance(out, str)


@pytest.fixture(scope="module")
def monkeypatch_steps():
    """CI: a 100k-step, 3 s budget (the real 2M steps under tracemalloc take ~9 s a case); long runs
    keep the real one."""
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get(FUZZ_EXAMPLES_ENV):
            mp.setattr(template_budget, "MAX_STEPS", 100_000)
            mp.setattr(template_budget, "MAX_SECONDS", 3.0)
        yield
