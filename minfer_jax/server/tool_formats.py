"""Tool-call formats, one per model family (server/tools.py picks one from the chat template):
each parses a reply (whole; server/tools.py's CallStream streams around it) and writes the grammar
that forces a call.

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

Mistral's, Gemma 4's and DeepSeek's markers are control tokens in the models' vocabularies:
`markers` binds them to ids so that a grammar matches the token, not its spelling.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from minfer_jax.server.tool_call import (
    CallsBase,
    ToolCall,
    arguments_text,
    call_schema,
    json_call,
    json_value,
    loaded,
    object_params,
)


@dataclasses.dataclass(frozen=True)
class Markers:
    """How a grammar writes a format's marker texts: a control token of the model's vocabulary
    by its id (llguidance lets only that token match it; `[TOOL_CALLS]` cannot be named in
    Lark), any other text as a literal."""

    control: tuple[tuple[str, int], ...] = ()

    def __call__(self, text: str) -> str:
        ids = dict(self.control)
        return f"<[{ids[text]}]>" if text in ids else json.dumps(text)


def markers(texts: tuple[str, ...], tokenizer: Any) -> Markers:
    found = []
    for text in texts:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None and tokenizer.is_control(token_id):
            found.append((text, token_id))
    return Markers(tuple(found))


def _mistral_id(value: Any) -> str:
    """The call's id as Mistral's templates take it back: 9 letters and digits."""
    if isinstance(value, str) and len(value) == 9 and value.isascii() and value.isalnum():
        return value
    return uuid.uuid4().hex[:9]


@dataclasses.dataclass(frozen=True)
class MistralCalls(CallsBase):
    """Mistral's [TOOL_CALLS] calls; `style` is what the template renders (and the grammar
    forces): "json" (Nemo's list), "call_id" (Small 3.2) or "args" (Devstral)."""

    style: str = "json"
    marks: Markers = Markers()
    opener = "[TOOL_CALLS]"
    marker_texts = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")
    _head = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]\s*")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.opener)
        if start < 0:
            return text, []
        calls: list[ToolCall] = []
        for part in text[start:].split(self.opener)[1:]:
            calls += self._part(part)
        return (text[:start], calls) if calls else (text, [])

    def _part(self, part: str) -> list[ToolCall]:
        decoder = json.JSONDecoder()
        if part.lstrip().startswith("["):  # Nemo: a JSON list of calls
            try:
                value = decoder.raw_decode(part.lstrip())[0]
            except (ValueError, RecursionError):  # no JSON (tool_call.loaded)
                return []
            items = [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
            named = [v for v in items if isinstance(v.get("name"), str)]
            args = [arguments_text(v.get("arguments", {})) for v in named]
            return [ToolCall(v["name"], a, _mistral_id(v.get("id"))) for v, a in zip(named, args)]
        head = self._head.match(part)
        if head is None:
            return []
        try:
            args = decoder.raw_decode(part[head.end() :])[0]
        except (ValueError, RecursionError):
            return []
        return [ToolCall(head.group(1), arguments_text(args), _mistral_id(head.group(2)))]

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        opener = self.marks(self.opener)
        if self.style == "json":
            schemas = []
            for fn in functions:
                schema = call_schema(fn, "arguments")
                schema["properties"]["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
                schemas.append({**schema, "required": ["name", "arguments", "id"]})
            items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
            calls = {"type": "array", "items": items, "minItems": 1}
            calls = calls if parallel else {**calls, "maxItems": 1}
            return f"start: {opener} {json_value(calls)}"
        call_id = ""
        if self.style == "call_id":
            call_id = f" {self.marks('[CALL_ID]')} /[a-zA-Z0-9]{{9}}/"
        rules = [
            f"f{i}: {opener} {json.dumps(fn['name'])}{call_id} {self.marks('[ARGS]')} "
            + json_value(object_params(fn))
            for i, fn in enumerate(functions)
        ]
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        return "\n".join([f"start: call{'+' if parallel else ''}", f"call: {alternatives}", *rules])


@dataclasses.dataclass(frozen=True)
class Gemma4Calls(CallsBase):
    """Gemma 4's calls: `call:f{...}` between <|tool_call> and <tool_call|>, the arguments in
    Gemma's own notation (bare keys, strings between <|"|> marks), turned into JSON here."""

    marks: Markers = Markers()
    opener = "<|tool_call>"
    marker_texts = ("<|tool_call>", "<tool_call|>", '<|"|>')
    _call = re.compile(r"<\|tool_call>\s*call:([^{\s]+)\s*(\{.*?\})\s*<tool_call\|>", re.S)
    # one pass: a marked string (taken whole, so nothing inside it is read as a key) or a bare key
    _token = re.compile(r'<\|"\|>(.*?)<\|"\|>|([{,]\s*)([^\s:{}\[\],"<]+)(\s*:)', re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.opener)
        if start < 0:
            return text, []
        calls = []
        for name, body in self._call.findall(text[start:]):
            value = loaded(self._token.sub(self._json_token, body))
            if isinstance(value, dict):
                calls.append(ToolCall(name, json.dumps(value, ensure_ascii=False)))
        return (text[:start], calls) if calls else (text, [])

    @staticmethod
    def _json_token(m: re.Match) -> str:
        if m.group(3) is None:
            return json.dumps(m.group(1), ensure_ascii=False)
        return f"{m.group(2)}{json.dumps(m.group(3))}{m.group(4)}"

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """The call's frame, its name and its required parameters (sorted, as the template
        writes them) with values of their declared simple type; nested values are any value of
        Gemma's notation, not checked against their schema."""
        quote = self.marks('<|"|>')
        rules, names = [f"gstring: {quote} /[^<]*/ {quote}", *_GEMMA_VALUE_RULES], []
        for i, fn in enumerate(functions):
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            parts = [
                f"{json.dumps(key + ':')} {self._value(props.get(key, {}), quote)}"
                for key in sorted(params.get("required") or [])
            ]
            body = ' "," '.join(parts) or '""'
            head = json.dumps(f"call:{fn['name']}{{")
            rules.append(
                f'f{i}: {self.marks(self.opener)} {head} {body} "}}" {self.marks("<tool_call|>")}'
            )
            names.append(f"f{i}")
        head = [f"start: call{'+' if parallel else ''}", f"call: {' | '.join(names)}"]
        return "\n".join(head + rules)

    @staticmethod
    def _value(schema: dict, quote: str) -> str:
        """A parameter's value: numbers, booleans and null are written as JSON writes them, so
        JSON's grammar holds them to their schema (bounds too); a string keeps its enum and
        maxLength; anything nested is any value of Gemma's notation."""
        if schema.get("type") in ("integer", "number", "boolean", "null"):
            return json_value(schema)
        if schema.get("type") != "string":
            return "gvalue"
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            words = " | ".join(json.dumps(str(word)) for word in schema["enum"])
            return f"{quote} ({words}) {quote}"
        most = schema.get("maxLength")
        return f"{quote} /[^<]{{0,{most}}}/ {quote}" if isinstance(most, int) else "gstring"


_GEMMA_VALUE_RULES = (
    "gnumber: /-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?([eE][-+]?[0-9]{1,3})?/",
    'gbool: "true" | "false"',
    'gvalue: gstring | gnumber | gbool | "null" | "[" (gvalue ("," gvalue)*)? "]" '
    '| "{" (/[A-Za-z_][A-Za-z0-9_]*/ ":" gvalue ("," /[A-Za-z_][A-Za-z0-9_]*/ ":" gvalue)*)? "}"',
)


@dataclasses.dataclass(frozen=True)
class DeepSeekCalls(CallsBase):
    """DeepSeek R1's calls (its distills' templates render them; V3.1 drops `function` and the
    fence: <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>)."""

    marks: Markers = Markers()
    opener = "<｜tool▁calls▁begin｜>"
    marker_texts = (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    )
    _call = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(self.opener)
        if start < 0:
            return text, []
        calls = []
        for kind, rest in self._call.findall(text[start:]):
            fenced = _unfenced(rest) if kind.strip() == "function" else None
            name, body = fenced or (kind.strip(), rest)
            value = loaded(body.strip())
            if isinstance(value, dict) and name:
                calls.append(ToolCall(name, json.dumps(value, ensure_ascii=False)))
        return (text[:start], calls) if calls else (text, [])

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        m = self.marks
        rules = [
            f'f{i}: {m("<｜tool▁call▁begin｜>")} "function" {m("<｜tool▁sep｜>")} '
            f"{json.dumps(fn['name'] + chr(10) + '```json' + chr(10))} "
            f'{json_value(object_params(fn))} "\\n```" {m("<｜tool▁call▁end｜>")}'
            for i, fn in enumerate(functions)
        ]
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        calls = "call+" if parallel else "call"
        head = f"start: {m(self.opener)} {calls} {m('<｜tool▁calls▁end｜>')}"
        return "\n".join([head, f"call: {alternatives}", *rules])


def _unfenced(rest: str) -> tuple[str, str] | None:
    """(name, arguments' text) of an R1 call's body: the name on a line, then the arguments
    fenced in ```json ... ``` (string operations: a backtracking pattern took quadratic time on
    a long run of spaces, on the server's loop)."""
    name, _, fence = rest.strip().partition("\n")
    name, fence = name.strip(), fence.strip()
    if not name or "`" in name or len(fence) < 6 or fence[:3] != "```" or fence[-3:] != "```":
        return None
    body = fence[3:-3]
    return name, body[4:] if body.startswith("json") else body


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
            value = loaded(body)
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                args = value.get(self.args_key, value.get("parameters", {}))
                calls.append(ToolCall(value["name"], arguments_text(args)))
        if not calls:
            return text, []
        return text[:start], calls

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        call = json_call([call_schema(f, self.args_key) for f in functions])
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
                value = None if (name.strip(), key.strip()) in self.text_params else loaded(raw)
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
        return json_value(schema)
    most = schema.get("maxLength")
    return "/[^<]*/" if not isinstance(most, int) else f"/[^<]{{0,{most}}}/"


@dataclasses.dataclass(frozen=True)
class Llama3JsonCalls(CallsBase):
    opener = "<|python_tag|>"
    args_key = "parameters"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.split(self.opener, 1)[1] if self.opener in text else text
        value = loaded(body.strip())
        # a call names its arguments: a bare JSON answer with a "name" field is no call
        if not isinstance(value, dict):
            return text, []
        args = value.get("parameters", value.get("arguments"))
        named = isinstance(args, dict) or (isinstance(args, str) and isinstance(loaded(args), dict))
        if isinstance(value.get("name"), str) and named:  # arguments as JSON text count too
            prefix = text.split(self.opener, 1)[0] if self.opener in text else ""
            return prefix, [ToolCall(value["name"], arguments_text(args))]
        return text, []

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        return "start: " + json_call([call_schema(f, self.args_key) for f in functions])

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
            value = loaded(m.group(2).strip())
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
                + json_value(object_params(fn))
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
