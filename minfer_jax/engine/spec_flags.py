"""The CLI's speculative-decoding flags, as llama.cpp spells them: --spec-type (its type names;
the prompt lookup `ngram-simple`, alias `lookup`, and the file's MTP block `draft-mtp`, alias
`mtp`, have drafters here), -md / --model-draft (a draft model: --spec-type draft-simple,
implied), --spec-draft-p-min (--draft-p-min), --spec-draft-n-max (older --draft-max / --draft-n /
--draft) and --spec-draft-n-min (--draft-min / --draft-n-min); turned into a lookup.Speculation,
or once the target is loaded a draft_model.DraftSpeculation."""

from __future__ import annotations

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
from minfer_jax.engine.plan import MAX_DRAFT
from minfer_jax.errors import InvalidArgumentError


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
    group.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        "--draft-n",
        "--draft",
        dest="draft_max",
        type=int,
        default=None,
        metavar="N",
        help=f"most tokens drafted per step, 1..{MAX_DRAFT} (default {DEFAULT_DRAFT_MAX}: 8 rows, "
        "the few-token GEMV's largest)",
    )
    group.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        "--draft-n-min",
        dest="draft_min",
        type=int,
        default=None,
        metavar="N",
        help="fewest drafted tokens worth a verification step (default 1)",
    )
    group.add_argument(
        "-md",
        "--model-draft",
        dest="model_draft",
        default=None,
        metavar="FNAME",
        help="draft model for speculative decoding (a smaller GGUF of the same vocabulary, "
        "loaded with this model's options; implies --spec-type draft-simple)",
    )
    group.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        dest="draft_p_min",
        type=float,
        default=None,
        metavar="P",
        help=f"-md: the draft stops before a token the draft model gives less than P, 0..1 "
        f"(default {DEFAULT_P_MIN})",
    )


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
