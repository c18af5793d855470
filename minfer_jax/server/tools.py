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
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from minfer_jax.engine.constraint import ConstraintError
from minfer_jax.engine.steps import StopReason
from minfer_jax.server.schemas import BadRequest, NamedToolChoice

# a reply ended before the model ended it: a call it was in is unfinished
ENDED_EARLY = (StopReason.LENGTH, StopReason.CONTEXT, StopReason.STOP)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call_schema(fn: dict, args_key: str) -> dict:
    params = fn.get("parameters") or {"type": "object"}
    if params.get("type") == "object":  # as OpenAI's strict mode: the declared properties only
        params = {"additionalProperties": False, **params}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _json_call(fn_schemas: list[dict]) -> str:
    schema = fn_schemas[0] if len(fn_schemas) == 1 else {"anyOf": fn_schemas}
    # compact JSON: no whitespace the model could run on in
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return "%json " + json.dumps(schema)


def _loaded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class _Calls:
    most_calls: int | None = None  # 1: parallel_tool_calls false (the first call is kept)


class QwenJsonCalls(_Calls):
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
                calls.append(ToolCall(value["name"], json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return text[:start], calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        call = _json_call([_call_schema(f, self.args_key) for f in functions])
        more = ' ("\\n" call)*' if parallel else ""
        # <tool_call> unquoted: the special token (the model emits it whole, not its bytes)
        return f'start: call{more}\ncall: <tool_call> "\\n" {call} "\\n" </tool_call>'


class XmlCalls(_Calls):
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
                value = _loaded(raw)
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
                parts.append(f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
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
        return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    most = schema.get("maxLength")
    return "/[^<]*/" if not isinstance(most, int) else f"/[^<]{{0,{most}}}/"


class Llama3JsonCalls(_Calls):
    opener = "<|python_tag|>"
    args_key = "parameters"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.split(self.opener, 1)[1] if self.opener in text else text
        value = _loaded(body.strip())
        # a call names its arguments: a bare JSON answer with a "name" field is no call
        if not isinstance(value, dict):
            return text, []
        args = value.get("parameters", value.get("arguments"))
        if isinstance(value.get("name"), str) and isinstance(args, dict):
            prefix = text.split(self.opener, 1)[0] if self.opener in text else ""
            return prefix, [ToolCall(value["name"], json.dumps(args, ensure_ascii=False))]
        return text, []

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        return "start: " + _json_call([_call_schema(f, self.args_key) for f in functions])


class HarmonyCalls(_Calls):
    """gpt-oss's calls: whole harmony messages of the raw text (files/harmony.py keeps them out of
    the content), so the app parses the finished text rather than holding streamed content."""

    opener = "to=functions."
    args_key = "arguments"
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
            params = fn.get("parameters") or {"type": "object"}
            if params.get("type") == "object":
                params = {"additionalProperties": False, **params}
            schema = {**params, "x-guidance": {"whitespace_flexible": False}}
            head = json.dumps(f"commentary to=functions.{fn['name']} ")
            rules.append(
                f'f{i}: <|channel|> {head} <|constrain|> "json" <|message|> '
                f"%json {json.dumps(schema)}"
            )
            names.append(f"f{i}")
        return "\n".join([f"start: {' | '.join(names)}", *rules])


CallFormat = QwenJsonCalls | XmlCalls | Llama3JsonCalls | HarmonyCalls


def call_format(template: str) -> CallFormat | None:
    """The tool-call format a chat template teaches its model (None: it knows no tools)."""
    if "to=functions." in template or "<|call|>" in template:  # harmony's (gpt-oss)
        return HarmonyCalls()
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
        at = self.text.find(self.fmt.opener)
        bare_json = isinstance(self.fmt, Llama3JsonCalls) and self.text.lstrip().startswith("{")
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
    fmt = None if model.tokenizer is None else call_format(model.tokenizer.chat_template)
    if fmt is None:
        raise BadRequest("this model's chat template has no tool-call format", "tools")
    if not body.parallel_tool_calls:  # a model that calls twice anyway: its first call only
        fmt.most_calls = 1
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(fmt, HarmonyCalls):  # its template writes "// " + description, given or not
        for tool in tools:
            tool["function"].setdefault("description", "")
    return fmt, {"tools": tools}


def tool_grammar(fmt: CallFormat | None, body) -> str | None:
    """The grammar that forces a call (tool_choice required, or a named function), else None."""
    choice = getattr(body, "tool_choice", None)
    if fmt is None or choice in (None, "auto", "none"):
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f["name"] == choice.function.name]
        if not functions:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, not in tools", "tools")
    return forced_grammar(fmt, functions, body.parallel_tool_calls)
