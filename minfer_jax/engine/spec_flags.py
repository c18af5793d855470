"""The CLI's speculative-decoding flags, as llama.cpp spells them: --spec-type (its type names;
the prompt lookup `ngram-simple`, alias `lookup`, and the file's MTP block `draft-mtp`, alias
`mtp`, have drafters here), -md / --model-draft (a draft model: --spec-type draft-simple,
implied), --spec-draft-p-min (--draft-p-min), --spec-draft-n-max (older --draft-max / --draft-n /
--draft) and --spec-draft-n-min (--draft-min / --draft-n-min); turned into a lookup.Speculation,
or once the target is loaded a draft_model.DraftSpeculation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from minfer_jax import validate
from minfer_jax.engine.draft_model import (
    DEFAULT_P_MIN,
    DRAFT_TYPES,
    DraftSpeculation,
    load_draft,
    speculation_for,
)
from minfer_jax.engine.lookup import (
    DEFAULT_DRAFT_MAX,
    LLAMA_CPP_SPEC_TYPES,
    SPEC_TYPES,
    Speculation,
    speculation_of,
)
from minfer_jax.engine.spec_plan import MAX_DRAFT
from minfer_jax.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class SpecFlag:
    """One draft flag: its spellings (llama.cpp's first, then its older ones), value type,
    metavar and what it means (its default said)."""

    names: tuple[str, ...]
    type: Callable[[str], Any] | None
    metavar: str
    meaning: str


# the one place these flags are spelled (the CLIs here, the server and minfer_bench's bench.py)
SPEC_FLAGS = {
    "draft_max": SpecFlag(
        ("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft"),
        int,
        "N",
        f"most tokens drafted per step, 1..{MAX_DRAFT} (default {DEFAULT_DRAFT_MAX}: 8 rows, the "
        "few-token GEMV's largest)",
    ),
    "draft_min": SpecFlag(
        ("--spec-draft-n-min", "--draft-min", "--draft-n-min"),
        int,
        "N",
        "fewest drafted tokens worth a verification step (default 1)",
    ),
    "model_draft": SpecFlag(
        ("-md", "--model-draft"),
        None,
        "FNAME",
        "draft model for speculative decoding (a smaller GGUF of the same vocabulary, loaded "
        "with this model's options; implies --spec-type draft-simple)",
    ),
    "draft_p_min": SpecFlag(
        ("--spec-draft-p-min", "--draft-p-min"),
        float,
        "P",
        "the draft stops before a token the draft model gives less than P, 0..1 (default "
        f"{DEFAULT_P_MIN})",
    ),
}


def add_spec_flag(group: Any, dest: str, help: str | None = None) -> None:
    """SPEC_FLAGS[dest] on group (default None: the setting's own default applies); help: the
    caller's words for it, else its meaning."""
    flag = SPEC_FLAGS[dest]
    group.add_argument(
        *flag.names,
        dest=dest,
        type=flag.type,
        default=None,
        metavar=flag.metavar,
        help=flag.meaning if help is None else help,
    )


def add_speculative_flags(group: Any) -> None:
    group.add_argument(
        "--spec-type",
        default="none",
        choices=list(dict.fromkeys(LLAMA_CPP_SPEC_TYPES + SPEC_TYPES)),
        metavar="TYPE",
        help="speculative decoding: ngram-simple (alias lookup: drafts copied from the prompt "
        "and the output so far, verified several per step; the same output), draft-simple "
        "(with -md), draft-mtp (alias mtp: a Qwen3.5 / 3.6 file's MTP block drafts, default 3 "
        "a step) or none (default); llama.cpp's EAGLE type is not implemented",
    )
    for dest in ("draft_max", "draft_min", "model_draft"):
        add_spec_flag(group, dest)
    add_spec_flag(group, "draft_p_min", "-md: " + SPEC_FLAGS["draft_p_min"].meaning)


def speculation_from_args(args: Any) -> Speculation | None:
    """The flags as a Speculation (None: off, or a draft model's, which draft_speculation makes
    once the target is loaded); a bad value is an InvalidArgumentError."""
    if args.draft_p_min is not None:
        validate.number("--draft-p-min", args.draft_p_min, 0.0, 1.0)
    drafts = args.model_draft is not None
    if drafts and args.spec_type not in ("none", *DRAFT_TYPES):
        raise InvalidArgumentError(
            f"-md drafts with a model; --spec-type {args.spec_type} is the n-gram drafter: pick one"
        )
    if args.spec_type in DRAFT_TYPES and not drafts:
        raise InvalidArgumentError(f"--spec-type {args.spec_type} needs a draft model (-md)")
    if drafts:  # the sizes checked before any model loads
        top = MAX_DRAFT if args.draft_max is None else args.draft_max
        validate.integer("--draft-max", top, 1, MAX_DRAFT)
        if args.draft_min is not None:
            validate.integer("--draft-min", args.draft_min, 0, top)
        return None
    if args.spec_type == "none":
        return None  # llama.cpp ignores draft sizes without a type
    return speculation_of(args.spec_type, args.draft_max, args.draft_min)


def draft_speculation(args: Any, target: Any) -> DraftSpeculation | None:
    """-md's draft model, loaded beside the target with its options, as the request's
    speculation (None without -md)."""
    if args.model_draft is None:
        return None
    draft = load_draft(target, args.model_draft)
    spec = speculation_for(
        target, "draft", args.draft_max, args.draft_min, draft_model=draft, p_min=args.draft_p_min
    )
    assert isinstance(spec, DraftSpeculation)
    return spec
