"""Chat templates: the real Qwen format, the HF dialect, and hostile templates in the sandbox."""

from __future__ import annotations

import pytest

from minfer_jax.errors import TemplateError
from minfer_jax.files import chat_template, template_sandbox
from minfer_jax.files.chat_template import render_chat_template
from minfer_jax.files.tokenizer import Tokenizer

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(real_model) -> Tokenizer:
    return Tokenizer.from_metadata(real_model.metadata, source=real_model.path)


# --- the real model's template --------------------------------------------------------------


def test_real_template_default_system_prompt(tok):
    assert tok.apply_chat_template(USER) == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_real_template_turns_without_generation_prompt(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
    )


def test_real_template_tools_use_hf_tojson(tok):
    tool = {
        "type": "function",
        "function": {"name": "weather", "description": "Wetter für Köln <b>"},
    }
    text = tok.apply_chat_template(USER, tools=[tool])
    # not HTML-escaped, not ASCII-escaped, keys in insertion order
    # (jinja's own tojson fails all three)
    assert (
        '\n{"type": "function", "function": {"name": "weather", "description": "Wetter für Köln '
        '<b>"}}\n' in text
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_real_template_tool_calls_and_responses(tok):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"city": "Köln"}}}],
        },
        {"role": "tool", "content": "12C"},
    ]
    text = tok.apply_chat_template(messages)
    assert (
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        '{"name": "f", "arguments": {"city": "Köln"}}\n'
        "</tool_call><|im_end|>\n" in text
    )
    assert "<|im_start|>user\n<tool_response>\n12C\n</tool_response><|im_end|>\n" in text


def test_limits_leave_room_for_long_conversations(tok):
    """The sandbox budgets must not trip on big but legitimate prompts."""
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": f"{i} " + "word " * 2000}
        for i in range(300)
    ]
    text = tok.apply_chat_template(messages)
    assert text.count("<|im_start|>") == 302 and len(text) > 3_000_000


def test_rendered_prompt_tokenizes_to_control_ids(tok):
    ids = tok.encode(tok.apply_chat_template(USER))
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(ids[-3:]) == "<|im_start|>assistant\n"


# --- the transformers dialect ----------------------------------------------------------------


def test_tojson_matches_transformers():
    out = render_chat_template(
        "{{ x|tojson }}|{{ x|tojson(indent=2) }}", [], x={"b": 1, "a": "ü<&>'"}
    )
    assert out == '{"b": 1, "a": "ü<&>\'"}|{\n  "b": 1,\n  "a": "ü<&>\'"\n}'


def test_trim_and_lstrip_blocks():
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    assert render_chat_template(template, USER * 2) == "[hi]\n[hi]\n"


def test_undefined_is_lenient_like_hf():
    """Real templates test missing keys (`message.tool_calls`); that must not raise."""
    out = render_chat_template(
        "{% if messages[0].tool_calls %}T{% endif %}{{ messages[0].nope }}|{{ bos_token }}", USER
    )
    assert out == "|"


def test_variables_and_extra():
    out = render_chat_template(
        "{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ enable_thinking }}",
        USER,
        add_generation_prompt=False,
        bos_token="<s>",
        eos_token="</s>",
        enable_thinking=True,
    )
    assert out == "<s></s>FalseTrue"


def test_large_numbers_as_data_still_render():
    """Size limits apply to widths and counts, not to numbers that are content."""
    template = (
        "{% set ns = namespace(v=ts) %}{{ ts }}|{{ ts|string }}|{{ ts|tojson }}|{{ '%d' % ts }}|"
        "{{ '%d'|format(ts) }}|{{ '{}'.format(ts) }}|{{ [ts]|join(',') }}|{{ ns.v }}|{{ ts * 2 }}"
    )
    out = render_chat_template(template, USER, ts=1_700_000_000)
    assert out == "|".join(["1700000000"] * 8 + ["3400000000"])


def test_loopcontrols_and_strftime():
    assert render_chat_template("{% for m in messages %}{% break %}x{% endfor %}ok", USER) == "ok"
    assert len(render_chat_template("{{ strftime_now('%Y') }}", [])) == 4


def test_raise_exception_surfaces_as_template_error():
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        render_chat_template("{{ raise_exception('Conversation roles must alternate') }}", USER)


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        render_chat_template("ok\n{% if %}", USER)


def test_template_compiled_once():
    template = "{{ messages|length }} cached-template-test"
    render_chat_template(template, USER)
    before = chat_template._compile.cache_info()
    assert render_chat_template(template, USER) == "1 cached-template-test"
    after = chat_template._compile.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_messages_not_mutated():
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError):
        render_chat_template("{{ messages[0].update({'content': 'pwned'}) }}", messages)
    assert messages == [{"role": "user", "content": "hi"}]


# --- hostile templates -----------------------------------------------------------------------

SANDBOX_ESCAPES = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "tuple_base": "{{ ().__class__.__base__.__subclasses__() }}",
    "cycler_globals": "{{ cycler.__init__.__globals__ }}",
    "lipsum_globals": "{{ lipsum.__globals__['os'] }}",
    "mro_call": "{{ dict.mro() }}",
    "format_attr": "{{ '{0.__class__}'.format('') }}",
    "attr_filter": "{{ messages|attr('__class__') }}",
    "map_attribute": "{{ messages|map(attribute='__class__')|list }}",
    "template_reference": "{{ self._TemplateReference__context }}",
    "messages_append": "{{ messages.append({'role': 'system'}) }}",
    "messages_pop": "{{ messages.pop() }}",
    "dict_update": "{{ messages[0].update({'role': 'system'}) }}",
    "namespace_dunder": "{% set ns = namespace() %}{{ ns.__init__ }}",
    "namespace_class": "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}{{ ns.__class__ }}",
}

RESOURCE_BOMBS = {
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "nested_ranges": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "string_repeat": ("{{ 'x' * 10**9 }}", "sequence"),
    "huge_power": ("{{ 2 ** (10 ** 10) }}", "power"),
    "ljust": ("{{ ''.ljust(10**9) }}", "1000000000"),
    "center_filter": ("{{ 'x'|center(10**9) }}", "1000000000"),
    "namespace_doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% "
        "endfor %}",
        "with ~",
    ),
    "list_doubling": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% "
        "endfor %}",
        "sequence",
    ),
    "macro_doubling": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}", "with ~"),
    "output_flood": ("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}", "output"),
    "printf_width": ("{{ '%999999999d' % 1 }}", "width"),
    "printf_star": ("{{ '%*d'|format(10**9, 1) }}", "1000000000"),
    "format_spec_width": ("{{ '{:>999999999}'.format(1) }}", "width"),
    "expandtabs": ("{{ '\t'.expandtabs(10**9) }}", "1000000000"),
    "str_replace_product": ("{{ ('a' * 4000000).replace('', 'b' * 4000000) }}", "str.replace"),
    "replace_filter_product": ("{{ ('a' * 4000000)|replace('a', 'b' * 4000000) }}", "filter"),
    "join_product": ("{{ (['a'] * 4000000)|join('x' * 4000000) }}", "sequence"),
    "lipsum": ("{{ lipsum(n=10**6) }}", "size"),
    "lipsum_string_count": ("{{ lipsum('x' * 20000) }}", "lipsum a str n"),  # 200 MB before
}

# Issue 25: bombs through a filter's or method's argument (each past 4 GB in ~2 s before), and
# filters that ran for seconds on a few MB. Each must stop within the render budget, small.
ARGUMENT_BOMBS = {
    "indent_width": ("{{ ('a\n' * 4000)|indent(1000000) }}", "indent"),
    "expandtabs_product": ("{{ ('\t' * 4000).expandtabs(1000000) }}", "expandtabs"),
    "nested_format_spec": ("{{ '{:{}{}}'.format('x', 99999, 99999) }}", "9999999999"),
    "format_fields": ("{{ ('{:1000000}' * 4000).format(*(['x'] * 4000)) }}", "str.format"),
    "printf_filter_sum": ("{{ ('%-1000000s' * 4000)|format(*(['x'] * 4000)) }}", "with %"),
    "printf_operator_sum": ("{{ ('%-1000000s' * 4000) % (('x',) * 4000) }}", "with %"),
    "printf_big_ints": ("{{ ('%d' * 4000) % ((7 ** 4000,) * 4000) }}", "with %"),
    "tojson_separator": (
        "{{ (range(4000)|list)|tojson(separators=('x' * 40000, ':')) }}",
        "separator",
    ),
    "tojson_indent": ("{{ [[[[[[[[1]]]]]]]]|tojson(indent=1000000) }}", "indent"),
    "tojson_escapes": (
        "{{ ('\u00e9' * 1000000)|tojson(ensure_ascii=True) }}",
        "tojson",
    ),  # 6 characters each
    "translate_table": ("{{ ('abc' * 1000000).translate({97: 'x' * 1000}) }}", "translate"),
    "wordwrap_string": ("{{ ('abc ' * 10000)|wordwrap(1, wrapstring='x' * 100000) }}", "wordwrap"),
    "bytes_repeat": ("{{ (('x' * 4000000).encode('utf-8') * 100)|length }}", "sequence"),
    "slice_count": ("{{ [1, 2, 3]|slice(1000000)|list|length }}", "slices"),
    "striptags_brackets": ("{{ ('<>' * 2000000)|striptags }}", "striptags"),
    "striptags_comments": ("{{ ('<!---->' * 500000)|striptags }}", "striptags"),
    "urlize_big": ("{{ ('a.com ' * 100000)|urlize }}", "urlize"),
    "title_4mb": ("{{ ('abc ' * 1000000)|title }}", "title"),
    "max_4mb": ("{{ ('a' * 4000000)|max }}", "max"),
}


@pytest.mark.parametrize("template", SANDBOX_ESCAPES.values(), ids=SANDBOX_ESCAPES.keys())
def test_sandbox_escape_is_a_clear_template_error(template):
    with pytest.raises(TemplateError, match="blocked by the sandbox") as info:
        render_chat_template(template, USER)
    assert type(info.value.__cause__).__name__ == "SecurityError"


@pytest.mark.parametrize(("template", "match"), RESOURCE_BOMBS.values(), ids=RESOURCE_BOMBS.keys())
def test_resource_bombs_are_stopped(template, match):
    with pytest.raises(TemplateError, match=match):
        render_chat_template(template, USER)


@pytest.mark.parametrize(("template", "match"), ARGUMENT_BOMBS.values(), ids=ARGUMENT_BOMBS.keys())
def test_argument_bombs_stop_within_the_budget(template, match):
    from fuzz_support import bounded

    with pytest.raises(TemplateError, match=match):
        bounded(
            lambda: render_chat_template(template, USER),
            seconds=chat_template.MAX_SECONDS,
            megabytes=200,
            rss=True,
        )


def test_filters_within_their_bounds_still_work():
    out = render_chat_template(
        "{{ 'a\nb'|indent(2, first=True) }}|{{ '\tx'.expandtabs(4) }}|"
        "{{ '{:>{}}'.format('x', 3) }}|"
        "{{ '%-3s|%05.1f' % ('k', 2.5) }}|{{ {'a': [1]}|tojson(separators=(',', ':')) }}|"
        "{{ ('<b>bold</b> ' * 3)|striptags }}|{{ 'see https://a.com'|urlize }}",
        USER,
    )
    assert out == (
        '  a\n  b|    x|  x|k  |002.5|{"a":[1]}|bold bold bold|'
        'see <a href="https://a.com" rel="noopener">https://a.com</a>'
    )


def test_striptags_matches_markupsafe_3():
    """Ours is markupsafe 3's algorithm, linear whatever markupsafe is installed; compare the
    two."""
    import importlib.metadata

    import markupsafe
    from hypothesis import given
    from hypothesis import strategies as st

    from fuzz_support import fuzz_settings

    if int(importlib.metadata.version("markupsafe").split(".")[0]) < 3:
        pytest.skip("markupsafe < 3 strips with another algorithm")

    @fuzz_settings(300)
    @given(text=st.text(alphabet="<>!-a &;", max_size=40))
    def same(text):
        assert template_sandbox._striptags(text) == markupsafe.Markup(text).striptags()

    same()


@pytest.mark.parametrize(
    "template",
    [
        "{{ cycler.__init__.__globals__.os.system('touch ' ~ path) }}",
        "{{ ''.__class__.__mro__[1].__subclasses__()[0].__init__.__globals__['os'].system('touch "
        "' ~ path) }}",
        "{{ self.__init__.__globals__.__builtins__.open(path, 'w').write('x') }}",
        "{{ namespace.__init__.__globals__['os'].system('touch ' ~ path) }}",
    ],
)
def test_no_code_runs(tmp_path, template):
    canary = tmp_path / "pwned"
    with pytest.raises(TemplateError):
        render_chat_template(template, USER, path=str(canary))
    assert not canary.exists()


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace() %}{% set messages.x = 1 %}",  # assignment to a non-namespace
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",  # unbounded recursion
        "{{ 1 / 0 }}",
        "{{ undefined_thing.attr }}",
        "{{ messages[5] + 1 }}",
    ],
)
def test_other_failures_are_template_errors(template):
    with pytest.raises(TemplateError, match="chat template failed"):
        render_chat_template(template, USER)


def test_non_string_template():
    with pytest.raises(TemplateError, match="must be a string"):
        render_chat_template(None, USER)  # type: ignore[arg-type]
