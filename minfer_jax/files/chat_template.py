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
  a step budget and a time limit (1 s of the render's own CPU time, so that a loaded server's
  GIL and cores do not fail real templates; 10 s of wall clock at most) are checked on
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

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError

from minfer_jax.errors import TemplateError
from minfer_jax.files.template_budget import (
    MAX_OUTPUT,
    MAX_SECONDS,
    MAX_TEMPLATE_CHARS,
    RenderGuard,
    current_guard,
)
from minfer_jax.files.template_sandbox import environment

__all__ = ["CHATML_TEMPLATE", "MAX_OUTPUT", "MAX_SECONDS", "render_chat_template"]

# Used when a file has no chat template, whatever its family: Qwen2-family instruct models speak
# ChatML; for another family's base model it is a plain, readable layout of the messages.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template text; generation renders the same one every turn."""
    try:
        return environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # a compile-time crash is still the template's fault
        raise TemplateError(f"chat template failed to compile: {type(e).__name__}: {e}") from None


def _render(compiled: jinja2.Template, context: dict[str, Any]) -> str:
    """Stream the output so the size cap applies before a bomb is fully built."""
    guard = RenderGuard()
    token = current_guard.set(guard)
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
        current_guard.reset(token)


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
