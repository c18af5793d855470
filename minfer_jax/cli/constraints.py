"""The CLI's constrained-output flags, as llama-cli spells them: -j/--json-schema,
--json-schema-file, --grammar, --grammar-file (GBNF, or llguidance's Lark opening with
%llguidance), --ignore-eos; turned into Model.constraint's keywords."""

from __future__ import annotations

import argparse
import json
from typing import Any

from minfer_jax.errors import InvalidArgumentError


class ConstraintFlagError(InvalidArgumentError):
    """A constraint flag whose value cannot be read (a usage error: exit status 2)."""


def add_constraint_flags(group: Any) -> None:
    group.add_argument(
        "-j",
        "--json-schema",
        metavar="SCHEMA",
        help="constrain the output to JSON valid against this JSON Schema (text)",
    )
    group.add_argument(
        "--json-schema-file", metavar="FILE", help="as --json-schema, the schema read from FILE"
    )
    group.add_argument(
        "--grammar", metavar="GRAMMAR", help="constrain the output to a GBNF grammar (text)"
    )
    group.add_argument(
        "--grammar-file", metavar="FILE", help="as --grammar, the grammar read from FILE"
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never end the text at an end-of-sequence token (run to -n)",
    )


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConstraintFlagError(f"{flag}: cannot read {path!r}: {e}") from None


def constraint_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """Model.constraint's keywords from the flags (at most one schema or grammar)."""
    given = {
        flag: value
        for flag, value in (
            ("--json-schema", args.json_schema),
            ("--json-schema-file", args.json_schema_file),
            ("--grammar", args.grammar),
            ("--grammar-file", args.grammar_file),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ConstraintFlagError(f"give one of {', '.join(given)}, not several")
    keywords: dict[str, Any] = {"ignore_eos": args.ignore_eos}
    for flag, value in given.items():
        text = _read(flag, value) if flag.endswith("-file") else value
        if "schema" in flag:
            try:
                keywords["json_schema"] = json.loads(text)
            except ValueError as e:
                raise ConstraintFlagError(f"{flag}: not JSON: {e}") from None
        else:
            keywords["grammar"] = text
    return keywords
