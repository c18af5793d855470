"""The table of hostile or broken JSON Schemas and grammars (issue 54): each is either refused
(`says`: words the error must contain, so it names the problem) or compiles within the bounds the
test sets. Giant cases are built by a function, so the table stays small to read.

Run by tests/test_hostile_grammars.py (the engine's Grammars, and a few through the server)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "json_schema" (a JSON value) or "grammar" (GBNF, or Lark after %llguidance)
    value: Any  # the schema or grammar, or a function that builds it
    says: str | None = None  # None: it compiles; else words of the refusal, lower case

    def build(self) -> Any:
        return self.value() if isinstance(self.value, Callable) else self.value


def _nest_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _nest_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1}
    return schema


def _nest_any_of(depth: int) -> dict:
    schema: dict = {"type": "null"}
    for i in range(depth):
        schema = {"anyOf": [schema, {"const": i}]}
    return schema


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "boolean"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _property_ref_chain(n: int) -> dict:
    """Each definition an object holding the next: llguidance recurses once per level (~1000
    levels overflow a default 8 MiB thread stack)."""
    defs = {f"d{i}": _schema(properties={"x": {"$ref": f"#/$defs/d{i + 1}"}}) for i in range(n)}
    defs[f"d{n}"] = {"type": "boolean"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _lark_chain(n: int) -> str:
    rules = [f'r{i}: "x" r{i + 1}' for i in range(n)]
    return "%llguidance {}\nstart: r0\n" + "\n".join(rules) + f'\nr{n}: "."'


def _gbnf_chain(n: int) -> str:
    rules = [f'r{i} ::= "x" r{i + 1}' for i in range(n)]
    return "root ::= r0\n" + "\n".join(rules) + f'\nr{n} ::= "."'


def _gbnf_chain_to_root(n: int) -> str:
    """A chain that comes back to its start: no finite text, found at the first token."""
    rules = [f'r{i} ::= "x" r{i + 1}' for i in range(n)]
    return "root ::= r0\n" + "\n".join(rules) + f"\nr{n} ::= root"


def _gbnf_parens(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def _schema(**kw: Any) -> dict:
    return {"type": "object", **kw}


def _string(**kw: Any) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", **kw}}, "required": ["s"]}


JSON = "json_schema"
GBNF = "grammar"
MIB = 1 << 20

CASES: list[Case] = [
    # -- nesting ---------------------------------------------------------------------------------
    Case("objects nested 10 deep", JSON, lambda: _nest_objects(10)),
    Case("objects nested 100 deep", JSON, lambda: _nest_objects(100), "recursion limit"),
    Case("objects nested 500 deep", JSON, lambda: _nest_objects(500), "nested too deeply"),
    Case("objects nested 5000 deep", JSON, lambda: _nest_objects(5000), "nested too deeply"),
    Case("arrays nested 200 deep", JSON, lambda: _nest_arrays(200), "recursion limit"),
    Case("arrays nested 5000 deep", JSON, lambda: _nest_arrays(5000), "nested too deeply"),
    Case("anyOf nested 300 deep", JSON, lambda: _nest_any_of(300), "recursion limit"),
    Case("anyOf nested 5000 deep", JSON, lambda: _nest_any_of(5000), "nested too deeply"),
    # -- size ------------------------------------------------------------------------------------
    Case("enum of 1000 strings", JSON, {"enum": [f"v{i}" for i in range(1000)]}),
    Case("enum of 15000 strings", JSON, lambda: {"enum": [f"value{i}" for i in range(15000)]}),
    Case(
        "enum of 1000 long strings",
        JSON,
        lambda: {"enum": ["x" * 200 + str(i) for i in range(1000)]},
    ),
    Case("enum of mixed values", JSON, {"enum": [1, "a", None, True, 2.5, [1], {"k": 1}]}),
    Case("empty enum", JSON, {"enum": []}, "unsatisfiable"),
    Case(
        "2000 properties",
        JSON,
        lambda: _schema(properties={f"p{i}": {"type": "integer"} for i in range(2000)}),
    ),
    Case(
        "2000 required properties",
        JSON,
        lambda: _schema(
            properties={f"p{i}": {"type": "integer"} for i in range(2000)},
            required=[f"p{i}" for i in range(2000)],
        ),
    ),
    Case(
        "5000 properties (too many items per token)",
        JSON,
        lambda: _schema(properties={f"p{i}": {"type": "integer"} for i in range(5000)}),
        "past the parser's limits at its first token",
    ),
    Case(
        "oneOf of 1000 objects",
        JSON,
        lambda: {
            "oneOf": [
                _schema(properties={f"k{i}": {"const": i}}, required=[f"k{i}"]) for i in range(1000)
            ]
        },
        "oneof",
    ),
    Case(
        "anyOf of 3000 consts", JSON, lambda: {"anyOf": [{"const": f"c{i}"} for i in range(3000)]}
    ),
    Case(
        "allOf of 200 parts",
        JSON,
        lambda: {"allOf": [_schema(properties={f"a{i}": {"type": "string"}}) for i in range(200)]},
    ),
    Case(
        "prefixItems of 1000",
        JSON,
        lambda: {"type": "array", "prefixItems": [{"const": i} for i in range(1000)]},
    ),
    Case(
        "a property name of 100k characters",
        JSON,
        lambda: _schema(properties={"n" * 100_000: {"type": "integer"}}, required=["n" * 100_000]),
    ),
    Case("a const string of 200k characters", JSON, lambda: {"const": "c" * 200_000}),
    Case("a description of 200k characters", JSON, lambda: _schema(description="d" * 200_000)),
    Case(
        "a schema over the size limit",
        JSON,
        lambda: _schema(description="d" * (MIB // 4 + 10)),
        "at most",
    ),
    Case(
        "a 5000-key $defs never used",
        JSON,
        lambda: {"$defs": {f"d{i}": {"type": "string"} for i in range(5000)}, "type": "integer"},
    ),
    # -- references ------------------------------------------------------------------------------
    Case(
        "a recursive list",
        JSON,
        {
            "$defs": {
                "node": _schema(
                    properties={
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]},
                    },
                    required=["v", "next"],
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    Case(
        "a recursive tree",
        JSON,
        {
            "$defs": {
                "t": _schema(properties={"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}})
            },
            "$ref": "#/$defs/t",
        },
    ),
    Case("the root referring to itself", JSON, {"$ref": "#"}, "admits no text"),
    Case(
        "a property that is the root",
        JSON,
        _schema(properties={"me": {"$ref": "#"}}, required=["me"]),
        "past the parser's limits at its first token",
    ),
    Case(
        "two definitions referring to each other only",
        JSON,
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "admits no text",
    ),
    Case(
        "a required self-reference (no finite value)",
        JSON,
        {
            "$defs": {"x": _schema(properties={"x": {"$ref": "#/$defs/x"}}, required=["x"])},
            "$ref": "#/$defs/x",
        },
        "past the parser's limits at its first token",
    ),
    Case(
        "a reference to nowhere",
        JSON,
        {"$ref": "#/$defs/missing"},
        "/$defs/missing' does not exist",
    ),
    Case("a remote reference", JSON, {"$ref": "https://example.com/schema.json"}, "example.com"),
    Case("a reference chain of 300", JSON, lambda: _ref_chain(300)),
    Case("a reference chain of 3000", JSON, lambda: _ref_chain(3000), "3001 $refs (at most 1000)"),
    Case("an object reference chain of 990 (a deep stack)", JSON, lambda: _property_ref_chain(990)),
    Case(
        "an object reference chain of 1500",
        JSON,
        lambda: _property_ref_chain(1500),
        "$refs (at most 1000)",
    ),
    Case("a $ref that is not a string", JSON, {"$ref": 5}, "$ref must be a string"),
    Case("a $dynamicRef", JSON, {"$dynamicRef": "#meta"}, 'unimplemented keys: ["$dynamicref"]'),
    # -- patterns --------------------------------------------------------------------------------
    Case("pattern (a+)+$", JSON, _string(pattern="^(a+)+$")),
    Case("pattern (a|aa)*b", JSON, _string(pattern="^(a|aa)*b$")),
    Case("pattern (.*a){20}", JSON, _string(pattern="^(.*a){20}$")),
    Case("pattern (\\w+\\s?)*", JSON, _string(pattern="^(\\w+\\s?)*$")),
    Case("pattern ((a*)*)*", JSON, _string(pattern="^((a*)*)*$")),
    Case("pattern (x+x+)+y", JSON, _string(pattern="^(x+x+)+y$")),
    Case("pattern [a-z]{1000}", JSON, _string(pattern="^[a-z]{1000}$")),
    Case("pattern a{100000}", JSON, _string(pattern="^a{100000}$")),
    Case("pattern (a{100}){100}", JSON, _string(pattern="^(a{100}){100}$")),
    Case("pattern (.{0,50}){50}", JSON, _string(pattern="^(.{0,50}){50}$")),
    Case("pattern with a lookahead", JSON, _string(pattern="^(?=a)a+$"), "look-around"),
    Case(
        "pattern with a backreference",
        JSON,
        _string(pattern="^(a)\\1$"),
        "backreferences are not supported",
    ),
    Case("pattern that does not parse", JSON, _string(pattern="(abc"), "unclosed group"),
    Case(
        "pattern with a reversed range",
        JSON,
        _string(pattern="^[z-a]$"),
        "invalid character class range",
    ),
    Case(
        "pattern of 3000 alternatives",
        JSON,
        lambda: _string(pattern="^(" + "|".join(f"w{i}x" for i in range(3000)) + ")$"),
    ),
    Case("pattern \\p{L}+", JSON, _string(pattern="^\\p{L}+$")),
    Case("pattern that matches nothing", JSON, _string(pattern="[^\\s\\S]"), "unsatisfiable"),
    Case("pattern that is not a string", JSON, _string(pattern=5), "expected string for 'pattern'"),
    Case("patternProperties", JSON, _schema(patternProperties={"^x": {"type": "integer"}})),
    # -- bounds ----------------------------------------------------------------------------------
    Case("minLength of a billion", JSON, _string(minLength=10**9)),
    Case("maxLength of a billion", JSON, _string(maxLength=10**9)),
    Case("minLength over maxLength", JSON, _string(minLength=5, maxLength=2), "unsatisfiable"),
    Case("minLength 100000", JSON, _string(minLength=100_000)),
    Case(
        "negative maxLength",
        JSON,
        _string(maxLength=-1),
        "expected positive integer for 'maxlength'",
    ),
    Case(
        "minimum over maximum",
        JSON,
        {"type": "integer", "minimum": 10, "maximum": 1},
        "minimum (10) is greater than maximum (1)",
    ),
    Case(
        "integer bounds of 1e300",
        JSON,
        {"type": "integer", "minimum": -1e300, "maximum": 1e300},
        "integer range",
    ),
    Case("number range of 1e-300 width", JSON, {"type": "number", "minimum": 0, "maximum": 1e-300}),
    Case("multipleOf 0", JSON, {"type": "integer", "multipleOf": 0}, "invalid multiple of"),
    Case("multipleOf 1e-12", JSON, {"type": "number", "multipleOf": 1e-12}, "too many digits"),
    Case("minItems of a billion", JSON, {"type": "array", "minItems": 10**9}),
    Case(
        "minItems over maxItems",
        JSON,
        {"type": "array", "minItems": 3, "maxItems": 1},
        "minitems (3) is greater than maxitems (1)",
    ),
    Case(
        "maxItems of a million",
        JSON,
        {"type": "array", "items": {"type": "integer"}, "maxItems": 10**6},
    ),
    Case(
        "minProperties over the properties",
        JSON,
        _schema(properties={"a": {}}, additionalProperties=False, minProperties=5),
        "min/maxproperties",
    ),
    # -- unsupported keywords --------------------------------------------------------------------
    Case(
        "if / then / else",
        JSON,
        _schema(**{"if": {"required": ["a"]}, "then": {"required": ["b"]}}),
        'unimplemented keys: ["if", "then"]',
    ),
    Case("not", JSON, {"not": {"type": "string"}}, 'unimplemented keys: ["not"]'),
    Case(
        "dependentRequired",
        JSON,
        _schema(properties={"a": {}}, dependentRequired={"a": ["b"]}),
        "dependentrequired",
    ),
    Case("propertyNames", JSON, _schema(propertyNames={"pattern": "^x"}), "propertynames"),
    Case(
        "unevaluatedProperties", JSON, _schema(unevaluatedProperties=False), "unevaluatedproperties"
    ),
    Case("uniqueItems", JSON, {"type": "array", "uniqueItems": True}, "uniqueitems"),
    Case("contains", JSON, {"type": "array", "contains": {"const": 1}}, "contains"),
    Case("format date-time", JSON, _string(format="date-time")),
    Case(
        "format of an unknown name",
        JSON,
        _string(format="klingon-date"),
        "unknown format: klingon-date",
    ),
    Case("an unknown keyword", JSON, _schema(frobnicate=True)),
    # -- wrong types -----------------------------------------------------------------------------
    Case("type 5", JSON, {"type": 5}, "type must be a string or array of strings"),
    Case("type 'nope'", JSON, {"type": "nope"}, "invalid type: nope"),
    Case("type list with a number", JSON, {"type": ["string", 5]}, "type must be a string"),
    Case(
        "properties as a list",
        JSON,
        {"type": "object", "properties": []},
        "properties must be an object",
    ),
    Case(
        "required as a string",
        JSON,
        _schema(properties={"a": {}}, required="a"),
        "expected array for 'required'",
    ),
    Case("enum as a string", JSON, {"enum": "abc"}, "enum must be an array"),
    Case(
        "items as a number",
        JSON,
        {"type": "array", "items": 3},
        "schema must be an object or boolean",
    ),
    Case("the schema a string", JSON, "string", "a json schema is an object"),
    Case("the schema a number", JSON, 5, "a json schema is an object"),
    Case("the schema a list", JSON, [{"type": "string"}], "a json schema is an object"),
    Case("the schema false", JSON, False, "false admits no value"),
    Case("the schema true", JSON, True),
    Case("the schema empty", JSON, {}),
    # -- GBNF ------------------------------------------------------------------------------------
    Case("GBNF unterminated string", GBNF, 'root ::= "a', "unexpected end of input"),
    Case("GBNF undefined rule", GBNF, "root ::= missing", "rule 'missing' not found"),
    Case("GBNF no root", GBNF, 'start ::= "a"', "no 'root' rule"),
    Case("GBNF empty", GBNF, "", "no 'root' rule"),
    Case("GBNF garbage", GBNF, "@@@ ::= ::= ???", "expected name"),
    Case("GBNF unclosed group", GBNF, 'root ::= ("a" | "b"', "expected ')'"),
    Case("GBNF unclosed class", GBNF, "root ::= [a-z", "unexpected end of input"),
    Case("GBNF bad escape", GBNF, 'root ::= "\\q"', "invalid escape sequence"),
    Case("GBNF root is only itself", GBNF, "root ::= root", "admits no text"),
    Case("GBNF two rules with no terminal", GBNF, "root ::= a\na ::= root", "admits no text"),
    Case("GBNF left recursion", GBNF, 'root ::= root "a" | "a"'),
    Case("GBNF nested stars", GBNF, 'root ::= ("a"*)* "b"', "expected value"),
    Case(
        "GBNF repetition of a million",
        GBNF,
        'root ::= "a"{1000000}',
        "past the parser's limits at its first token",
    ),
    Case("GBNF repetition {2,1}", GBNF, 'root ::= "a"{2,1}', "range end must be >= start"),
    Case("GBNF 500 rules chained", GBNF, lambda: _gbnf_chain(500)),
    Case(
        "GBNF 500 rules chained back to the root",
        GBNF,
        lambda: _gbnf_chain_to_root(500),
        "past the parser's limits at its first token",
    ),
    Case("GBNF 3000 rules chained", GBNF, lambda: _gbnf_chain(3000), "3002 rules (at most 512)"),
    Case("GBNF parens 5000 deep", GBNF, lambda: _gbnf_parens(5000), "nested too deeply"),
    Case(
        "GBNF 10000 alternatives",
        GBNF,
        lambda: "root ::= " + " | ".join(f'"w{i}"' for i in range(10000)),
    ),
    Case("GBNF the whole of Unicode", GBNF, "root ::= [\\x00-\\U0010FFFF]*", "invalid regex"),
    Case(
        "GBNF a grammar over the size limit",
        GBNF,
        lambda: 'root ::= "' + "a" * (MIB // 8 + 10) + '"',
        "at most 131072",
    ),
    # -- Lark (llguidance's) ---------------------------------------------------------------------
    Case("Lark syntax error", GBNF, "%llguidance {}\nstart: (", "expected token"),
    Case("Lark catastrophic regex", GBNF, "%llguidance {}\nstart: /(a|a)*(b|b)*c/"),
    Case("Lark lookahead regex", GBNF, "%llguidance {}\nstart: /(?!a)b/", "look-around"),
    Case("Lark %import", GBNF, "%llguidance {}\n%import common.WORD\nstart: WORD"),
    Case("Lark huge repetition", GBNF, "%llguidance {}\nstart: /[0-9]{1,200000}/"),
    Case("Lark 3000 rules chained (a deep stack)", GBNF, lambda: _lark_chain(3000)),
    Case("Lark 5000 rules chained", GBNF, lambda: _lark_chain(5000), "rules (at most 4096)"),
    Case(
        "Lark parens 5000 deep",
        GBNF,
        lambda: "%llguidance {}\nstart: " + "(" * 5000 + '"a"' + ")" * 5000,
        "too deeply nested",
    ),
    Case(
        "Lark 21000 alternatives (too many items per token)",
        GBNF,
        lambda: "%llguidance {}\nstart: " + " | ".join(f'"w{i}"' for i in range(21000)),
        "past the parser's limits at its first token",
    ),
    Case(
        "Lark %json with a bad schema",
        GBNF,
        '%llguidance {}\nstart: %json {"type": 7}',
        "type must be a string",
    ),
]
