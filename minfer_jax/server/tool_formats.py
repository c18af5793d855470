"""Tool-call formats beyond the Qwen / Llama / harmony ones (server/tools.py picks the format from
the chat template): Mistral's [TOOL_CALLS], Gemma 4's <|tool_call>, DeepSeek R1's
<｜tool▁calls▁begin｜>; each parses a reply (whole; server/tools.py's CallStream streams around
it) and writes the grammar that forces a call. Their markers are control tokens in the models'
vocabularies: `markers` binds them to ids so that a grammar matches the token, not its spelling.
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
