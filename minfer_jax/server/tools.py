"""A request's tool calls: the call format its model's chat template teaches (the formats live in
server/tool_formats.py), the tools as the template reads them, the grammar that constrains the
reply (a forced call, calls or a schema answer, strict calls under auto), and the reply's calls
parsed whole or streamed (CallStream, parse_reply)."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.grammar import GrammarSpec
from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import MARKERS as HARMONY_MARKERS
from minfer_jax.server.schemas import BadRequest, NamedToolChoice
from minfer_jax.server.tool_call import ToolCall
from minfer_jax.server.tool_formats import (
    DeepSeekCalls,
    Gemma4Calls,
    HarmonyCalls,
    Llama3JsonCalls,
    Markers,
    MistralCalls,
    QwenJsonCalls,
    XmlCalls,
    markers,
)

_log = logging.getLogger("uvicorn.error")  # the server's log, as backend.py writes it

__all__ = [
    "ENDED_EARLY",
    "CallFormat",
    "CallStream",
    "DeepSeekCalls",
    "Gemma4Calls",
    "HarmonyCalls",
    "Llama3JsonCalls",
    "Markers",
    "MistralCalls",
    "QwenJsonCalls",
    "ToolCall",
    "XmlCalls",
    "call_format",
    "call_or_answer",
    "call_or_answer_grammar",
    "forced_grammar",
    "lazy_call_grammar",
    "offered_functions",
    "parse_reply",
    "strict_calls",
    "template_tool",
    "text_params",
    "tool_constraint",
    "tool_grammar",
    "tool_setup",
    "unsupported_tools_message",
]

# a reply ended before the model ended it: a call it was in is unfinished
ENDED_EARLY = (StopReason.LENGTH, StopReason.CONTEXT, StopReason.STOP)


CallFormat = (
    QwenJsonCalls
    | XmlCalls
    | Llama3JsonCalls
    | HarmonyCalls
    | MistralCalls
    | Gemma4Calls
    | DeepSeekCalls
)


def call_format(template: str) -> CallFormat | None:
    """The tool-call format a chat template teaches its model (None: it knows no tools)."""
    if "to=functions." in template or "<|call|>" in template:  # harmony's (gpt-oss)
        return HarmonyCalls()
    if "[TOOL_CALLS]" in template:  # Mistral's; the template shows which variant
        style = "call_id" if "[CALL_ID]" in template else "args" if "[ARGS]" in template else "json"
        return MistralCalls(style)
    if "<|tool_call>" in template:
        return Gemma4Calls()
    if "tool▁call▁begin" in template:
        return DeepSeekCalls()
    if "<function=" in template:
        return XmlCalls()
    if "<tool_call>" in template:
        return QwenJsonCalls()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonCalls()
    return None


def forced_grammar(fmt: CallFormat, functions: list[dict], parallel: bool) -> str:
    """llguidance Lark text that makes the reply one call (or several, parallel) of these
    functions, their arguments valid against their JSON Schemas."""
    if not functions:
        raise ConstraintError("tool_choice asks for a call but no function is given")
    return "%llguidance {}\n" + fmt.grammar(functions, parallel)


def _calls_rules(fmt: CallFormat, functions: list[dict], parallel: bool) -> str:
    """The format's forced-call grammar with its start rule named `calls` (to be one part of
    another grammar)."""
    head, _, rules = fmt.grammar(functions, parallel).partition("\n")
    if not head.startswith("start: "):  # every format's grammar opens with its start rule
        raise AssertionError(f"{type(fmt).__name__}'s grammar opens with {head!r}")
    return "calls: " + head[len("start: ") :] + "\n" + rules


def call_or_answer_grammar(fmt: CallFormat, functions: list[dict], parallel: bool, schema) -> str:
    """llguidance Lark text for tool_choice auto with a response schema (OpenAI's rule: the
    model either calls or answers in the schema): the format's calls, or JSON valid against
    the schema."""
    answer = GrammarSpec.json_schema(schema).text  # True/False/non-objects refused as alone
    calls = _calls_rules(fmt, functions, parallel)
    return f"%llguidance {{}}\nstart: calls | answer\n{calls}\nanswer: %json {answer}"


def lazy_call_grammar(fmt: CallFormat, functions: list[dict], parallel: bool) -> str:
    """llguidance Lark text for strict functions under tool_choice auto (llama.cpp's lazy
    grammar): any tokens but the format's opener, then, once the opener comes, calls valid
    against the functions' schemas."""
    if fmt.opener_id is None:
        raise AssertionError("a lazy call grammar needs the opener's token")
    calls = _calls_rules(fmt, functions, parallel)
    return f"%llguidance {{}}\nstart: free_text calls?\nfree_text: <[^{fmt.opener_id}]>*\n{calls}"


_OPENS_JSON = re.compile(r"\s*\{")


class CallStream:
    """Streamed text with tool calls: content goes out as it comes until a call may have begun
    (the opener, or a reply opening with '{' for Llama's bare JSON), then everything is held and
    parsed at the end."""

    def __init__(self, fmt: CallFormat):
        self.fmt, self.text, self.sent, self.holding = fmt, "", 0, False
        self.call_at: int | None = None  # where the opener of the held call stands

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(self.fmt.opener, self.sent)  # what was sent holds no opener
        bare_json = isinstance(self.fmt, Llama3JsonCalls) and bool(_OPENS_JSON.match(self.text))
        if at >= 0 or bare_json:
            self.holding = True
            end = 0 if bare_json else at
            self.call_at = None if bare_json else at  # bare JSON may be an answer, no framing
        else:  # a tail that could still become the opener stays
            end = len(self.text)
            for k in range(min(len(self.fmt.opener) - 1, len(self.text)), 0, -1):
                if self.fmt.opener.startswith(self.text[-k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self, reason: StopReason | None = None) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls); reason: how the reply ended. A call that max_tokens,
        the context or a stop string cut off is unfinished: its framing is no content (a model's
        own malformed call, ended by itself, stays content, as llama-server shows it)."""
        content, calls = self.fmt.parse(self.text)
        if not calls:
            cut_call = self.call_at if reason in ENDED_EARLY else None
            end = len(self.text) if cut_call is None else cut_call
            return self.text[self.sent : end], []
        return content[self.sent :], calls[: self.fmt.most_calls]


def parse_reply(fmt: CallFormat, text: str, reason: StopReason) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply, as its stream gives them (reason: how it ended)."""
    if isinstance(fmt, HarmonyCalls):  # its calls are messages: the channels drop a cut one
        content, calls = fmt.parse(text)
        return content, calls[: fmt.most_calls]
    stream = CallStream(fmt)
    shown = stream.feed(text)
    rest, calls = stream.finish(reason)
    return shown + rest, calls


def tool_setup(model, body) -> tuple[CallFormat | None, dict]:
    """The tool-call format to parse the reply with, and the template's `tools` (none for
    tool_choice none); a 400 when the model's template knows no tool calls."""
    if not getattr(body, "tools", None) or body.tool_choice == "none":
        return None, {}
    template = "" if model.tokenizer is None else model.tokenizer.chat_template
    fmt = call_format(template)
    if fmt is None:
        raise BadRequest(unsupported_tools_message(template), "tools")
    if isinstance(fmt, MistralCalls | Gemma4Calls | DeepSeekCalls):
        fmt = dataclasses.replace(fmt, marks=markers(fmt.marker_texts, model.tokenizer))
    offered = [template_tool(t.model_dump(exclude_none=True)) for t in body.tools]
    if isinstance(fmt, HarmonyCalls):
        found = tuple(model.tokenizer.token_to_id(text) for text in HARMONY_MARKERS)
        if None not in found:  # a vocabulary short of one: no whole-reply grammar
            fmt = dataclasses.replace(fmt, marker_ids=found)
    if isinstance(fmt, XmlCalls):
        fmt = dataclasses.replace(fmt, text_params=text_params(t["function"] for t in offered))
    if not body.parallel_tool_calls:  # a model that calls twice anyway: its first call only
        fmt = dataclasses.replace(fmt, most_calls=1)
    fmt = dataclasses.replace(fmt, opener_id=model.tokenizer.token_to_id(fmt.opener))
    return fmt, {"tools": offered}


def offered_functions(body) -> list[dict]:
    """The request's tools' functions as their JSON (name, parameters, ...)."""
    return [t.function.model_dump(exclude_none=True) for t in body.tools]


def text_params(functions: Iterable[dict]) -> frozenset[tuple[str, str]]:
    """(function, parameter) pairs whose JSON Schema type is (or allows) a string."""
    pairs = set()
    for fn in functions:
        for key, schema in ((fn.get("parameters") or {}).get("properties") or {}).items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if kind == "string" or (isinstance(kind, list) and "string" in kind):
                pairs.add((fn["name"], key))
    return frozenset(pairs)


def template_tool(tool: dict) -> dict:
    """A tool as templates read it, llama-server's shape: description and parameters always
    there ('' and {} when the request left them out: gpt-oss's template adds "// " to the
    description and fails on a missing one)."""
    fn = tool["function"]
    function = {
        "name": fn["name"],
        "description": fn.get("description", ""),
        "parameters": fn.get("parameters", {}),
    }
    return {"type": "function", "function": function}


def unsupported_tools_message(template: str) -> str:
    """Why tools are refused: a template that knows no tools, or one whose call format this
    server cannot read (its calls would come back as plain text, so none are offered)."""
    if "tool" not in template:
        return "this model's chat template has no tool-call format (it renders no tools)"
    return (
        "this model's chat template renders tools, but its tool-call format is not one this "
        "server parses (Qwen/Hermes <tool_call>, Qwen3-Coder <function=...>, Llama 3.x JSON, "
        "Mistral [TOOL_CALLS], Gemma 4 <|tool_call>, DeepSeek R1, gpt-oss harmony)"
    )


def tool_constraint(fmt: CallFormat | None, body, asked: list[tuple[str, dict]]):
    """What constrains a reply with tools, as body.output_constraint gives it ([(field,
    Model.constraint keywords)]): a forced call's grammar (with no schema beside it); under
    tool_choice auto the asked schema widened to a call or an answer in it, else where a
    function is strict the lazy grammar that holds calls to their schemas."""
    forced = tool_grammar(fmt, body)
    if forced is not None:
        if asked:
            raise BadRequest(f"a forced tool call and {asked[0][0]} do not mix", "tool_choice")
        return [("tool_choice", {"grammar": forced})]
    if fmt is not None and asked:  # tool_choice auto
        return [call_or_answer(fmt, body, *asked[0])]
    if fmt is not None and any(t.function.strict for t in body.tools):
        grammar = strict_calls(fmt, body)
        return asked if grammar is None else [("tools", {"grammar": grammar})]
    return asked


def strict_calls(fmt: CallFormat, body) -> str | None:
    """The grammar that holds the calls of tool_choice auto to their schemas where a function
    is strict: the whole reply's for Llama 3's bare JSON and harmony (calls with no opener token
    to wait for); another format's lazy grammar, waiting for its opener token. None for harmony
    in a vocabulary without its framing tokens, or an opener that is no token: agent SDKs send
    strict by default, so a 400 would refuse them outright; the server's log says the calls are
    parsed as written."""
    functions = offered_functions(body)
    if isinstance(fmt, Llama3JsonCalls) or (isinstance(fmt, HarmonyCalls) and fmt.marker_ids):
        return fmt.whole_reply_grammar(functions)
    if isinstance(fmt, HarmonyCalls) or fmt.opener_id is None:
        _log.warning(
            "strict functions under tool_choice auto: %s calls have no token a grammar can "
            "wait for, so they are parsed as generated, not held to their schemas (tool_choice "
            '"required" or a named function holds them)',
            type(fmt).__name__,
        )
        return None
    return lazy_call_grammar(fmt, functions, body.parallel_tool_calls)


def call_or_answer(fmt: CallFormat, body, field: str, keywords: dict) -> tuple[str, dict]:
    """The constraint (field, Model.constraint keywords) of tools under tool_choice auto with a
    response schema: the format's calls or JSON valid against the schema. A grammar with tools
    is refused, as llama-server refuses it (no call could follow it)."""
    if "grammar" in keywords:
        raise BadRequest(
            "grammar and tools do not mix: a tool call could not follow the grammar "
            '(give response_format or json_schema instead, or tool_choice "none")',
            "grammar",
        )
    functions, parallel = offered_functions(body), body.parallel_tool_calls
    try:
        grammar = call_or_answer_grammar(fmt, functions, parallel, keywords["json_schema"])
    except ConstraintError as e:  # a schema that is no JSON Schema object
        raise BadRequest(str(e), field) from None
    return field, {"grammar": grammar}


def tool_grammar(fmt: CallFormat | None, body) -> str | None:
    """The grammar that forces a call (tool_choice required, or a named function), else None."""
    choice = getattr(body, "tool_choice", None)
    if fmt is None or choice in (None, "auto", "none"):
        return None
    functions = offered_functions(body)
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f["name"] == choice.function.name]
        if not functions:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, not in tools", "tools")
    return forced_grammar(fmt, functions, body.parallel_tool_calls)
