"""Tool calls: each model family's call format, chosen from its chat template, with a parser for
the reply (whole or streamed) and a grammar that forces calls (tool_choice required or a named
function).

    QwenJsonCalls   Qwen2.5 / Qwen3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    XmlCalls        Qwen3-Coder / Qwen3.5: <tool_call>\n<function=f>\n<parameter=p>\nv\n</parameter>
                    \n</function>\n</tool_call>
    Llama3JsonCalls Llama 3.x: [<|python_tag|>]{"name": ..., "parameters": {...}}
    HarmonyCalls    gpt-oss: a harmony message addressed to a function, <|channel|>commentary
                    to=functions.f <|constrain|>json<|message|>{...}<|call|> (the recipient may
                    also stand before the channel); one call per turn, <|call|> ends it
    MistralCalls    Mistral Nemo: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}];
                    Mistral Small 3.2 / Devstral: [TOOL_CALLS]f[CALL_ID]id[ARGS]{...} (no
                    [CALL_ID] in Devstral); ids of 9 letters and digits, as the templates demand
    Gemma4Calls     Gemma 4: <|tool_call>call:f{key:value,...}<tool_call|>, strings between
                    <|"|> marks, keys bare
    DeepSeekCalls   DeepSeek R1 (and its distills): <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>
                    function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.grammar import GrammarSpec
from minfer_jax.engine.steps import StopReason
from minfer_jax.files.harmony import MARKERS as HARMONY_MARKERS
from minfer_jax.server.schemas import BadRequest, NamedToolChoice
from minfer_jax.server.tool_call import CallsBase, ToolCall, arguments_text
from minfer_jax.server.tool_call import call_schema as _call_schema
from minfer_jax.server.tool_call import json_call as _json_call
from minfer_jax.server.tool_call import json_value as _json_value
from minfer_jax.server.tool_call import loaded as _loaded
from minfer_jax.server.tool_call import object_params as _object_params
from minfer_jax.server.tool_formats import (
    DeepSeekCalls,
    Gemma4Calls,
    Markers,
    MistralCalls,
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


@dataclasses.dataclass(frozen=True)
class QwenJsonCalls(CallsBase):
    opener = "<tool_call>"
    args_key = "arguments"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.opener)
        if start < 0:
            return text, []
        calls = []
        for body in self._call.findall(text[start:]):
            value = _loaded(body)
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                args = value.get(self.args_key, value.get("parameters", {}))
                calls.append(ToolCall(value["name"], arguments_text(args)))
        if not calls:
            return text, []
        return text[:start], calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        call = _json_call([_call_schema(f, self.args_key) for f in functions])
        more = ' ("\\n" call)*' if parallel else ""
        # <tool_call> unquoted: the special token (the model emits it whole, not its bytes)
        return f'start: call{more}\ncall: <tool_call> "\\n" {call} "\\n" </tool_call>'


@dataclasses.dataclass(frozen=True)
class XmlCalls(CallsBase):
    # (function, parameter) whose schema type is string: its text stays text (a file's content
    # that happens to read as JSON, "123" or "true"); the others are JSON where they parse
    text_params: frozenset[tuple[str, str]] = frozenset()
    opener = "<tool_call>"
    _fn = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.opener)
        if start < 0:
            return text, []
        calls = []
        for name, body in self._fn.findall(text[start:]):
            args = {}
            for key, raw in self._param.findall(body):
                value = None if (name.strip(), key.strip()) in self.text_params else _loaded(raw)
                args[key.strip()] = raw if value is None else value
            calls.append(ToolCall(name.strip(), json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:start], calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        rules, names = [], []
        for i, fn in enumerate(functions):
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            parts = []
            for key in params.get("required") or []:
                schema = props.get(key, {})
                value = _xml_value(schema)
                opens = json.dumps(f"<parameter={key}>\n")
                parts.append(f'{opens} {value} "\\n</parameter>\\n"')
            rules.append(
                f'f{i}: "<function={fn["name"]}>\\n" {" ".join(parts) or chr(34) * 2} "</function>"'
            )
            names.append(f"f{i}")
        more = ' ("\\n" call)*' if parallel else ""
        alternatives = " | ".join(names)
        head = f'start: call{more}\ncall: <tool_call> "\\n" ({alternatives}) "\\n" </tool_call>'
        return "\n".join([head, *rules])


def _xml_value(schema: dict) -> str:
    """A parameter's value in the XML format: strings bare (up to maxLength), the rest JSON."""
    if schema.get("type") != "string":
        return _json_value(schema)
    most = schema.get("maxLength")
    return "/[^<]*/" if not isinstance(most, int) else f"/[^<]{{0,{most}}}/"


@dataclasses.dataclass(frozen=True)
class Llama3JsonCalls(CallsBase):
    opener = "<|python_tag|>"
    args_key = "parameters"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.split(self.opener, 1)[1] if self.opener in text else text
        value = _loaded(body.strip())
        # a call names its arguments: a bare JSON answer with a "name" field is no call
        if not isinstance(value, dict):
            return text, []
        args = value.get("parameters", value.get("arguments"))
        named = isinstance(args, dict) or (
            isinstance(args, str) and isinstance(_loaded(args), dict)
        )
        if isinstance(value.get("name"), str) and named:  # arguments as JSON text count too
            prefix = text.split(self.opener, 1)[0] if self.opener in text else ""
            return prefix, [ToolCall(value["name"], arguments_text(args))]
        return text, []

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        return "start: " + _json_call([_call_schema(f, self.args_key) for f in functions])

    def whole_reply_grammar(self, functions: list[dict]) -> str:
        """llguidance Lark text of a whole reply whose calls are held to their schemas (strict
        functions under tool_choice auto; llama.cpp triggers on a reply opening with `{"name"`):
        a call (after whitespace), or an answer whose text opens with no `{"name"`, then, where
        the vocabulary has the token, <|python_tag|> and a call. The answer's `{` is its own
        lexeme: one text lexeme from the reply's start would swallow a call's opening brace."""
        tagged = "" if self.opener_id is None else f" | answer <[{self.opener_id}]> call"
        return "\n".join(
            [
                "%llguidance {}",
                f"start: answer | WS? call{tagged}",
                'answer: WS? (TEXT | "{" BRACED)?',
                r"TEXT: /[^{\s](?s:.*)/",
                r"WS: /\s+/",
                r'BRACED: /(?s:.*)/ & ~/\s*"name"(?s:.*)/',
                "call: " + self.grammar(functions, parallel=False).removeprefix("start: "),
            ]
        )


@dataclasses.dataclass(frozen=True)
class HarmonyCalls(CallsBase):
    """gpt-oss's calls: whole harmony messages of the raw text (files/harmony.py keeps them out of
    the content), so the app parses the finished text rather than holding streamed content."""

    opener = "to=functions."
    args_key = "arguments"
    # harmony's framing tokens' ids in the model's vocabulary (no body holds them): tool_setup sets
    # them, whole_reply_grammar needs them
    marker_ids: tuple[int, ...] = ()
    # one message: its header (after <|start|> or the text's start) up to <|message|>, its body
    _message = re.compile(
        r"(?:^|<\|start\|>)((?:(?!<\|start\|>|<\|message\|>).)*)<\|message\|>"
        r"((?:(?!<\|start\|>|<\|end\|>|<\|call\|>|<\|return\|>).)*)"
        r"(?:<\|end\|>|<\|call\|>|<\|return\|>)?",
        re.S,
    )
    _recipient = re.compile(r"\bto=functions\.([^\s<]+)")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text without its call messages, the calls)."""
        calls, kept, at = [], [], 0
        for m in self._message.finditer(text):
            name = self._recipient.search(m.group(1))
            if name is None:
                continue
            value = _loaded(m.group(2).strip())
            arguments = m.group(2).strip() if value is None else json.dumps(value)
            calls.append(ToolCall(name.group(1), arguments))
            kept.append(text[at : m.start()])
            at = m.end()
        if not calls:
            return text, []
        return "".join(kept) + text[at:], calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """One call (harmony ends the turn at <|call|>): the commentary channel addressed to the
        function, its arguments JSON valid against its schema."""
        rules, names = [], []
        for i, fn in enumerate(functions):
            head = json.dumps(f"commentary to=functions.{fn['name']} ")
            rules.append(
                f'f{i}: <|channel|> {head} <|constrain|> "json" <|message|> '
                + _json_value(_object_params(fn))
            )
            names.append(f"f{i}")
        return "\n".join([f"start: {' | '.join(names)}", *rules])

    def whole_reply_grammar(self, functions: list[dict]) -> str:
        """llguidance Lark text of a whole reply whose calls are held to their schemas (strict
        functions under tool_choice auto; llama.cpp waits for the ` to=functions.` text): its
        messages (after the template's `<|start|>assistant`) each `<|channel|>` header
        `<|message|>` body, joined by `<|end|><|start|>assistant`; a header addressed to a
        function only as the forced call (then `<|call|>` ends the turn), any other one (no
        `to=`) with a body free of framing tokens; <|return|> (the end token) ends the last."""
        if not self.marker_ids:
            raise AssertionError("a harmony reply grammar needs the framing tokens' ids")
        free = ",".join(map(str, sorted(self.marker_ids)))
        calls, _, rules = self.grammar(functions, parallel=False).partition("\n")
        return "\n".join(
            [
                "%llguidance {}",
                'start: (message <|end|> <|start|> "assistant")* (message | call <|call|>)',
                "message: <|channel|> HEADER <|message|> body",
                f"body: <[^{free}]>*",
                # any header text but a recipient's: a call's header is the call rule's
                r"HEADER: /[^<]*/ & ~/(?s:.*)to=(?s:.*)/",
                "call: " + calls.removeprefix("start: "),
                rules,
            ]
        )


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
