"""The CLI's speculative-decoding flags, as llama.cpp spells them: --spec-type (its type names;
the prompt lookup `ngram-simple`, alias `lookup`, and the file's MTP block `draft-mtp`, alias
`mtp`, have drafters here), --spec-draft-n-max
(older --draft-max / --draft-n / --draft) and --spec-draft-n-min (--draft-min / --draft-n-min);
turned into a lookup.Speculation."""

from __future__ import annotations

from typing import Any

from minfer_jax.engine.lookup import (
    DEFAULT_DRAFT_MAX,
    LLAMA_CPP_SPEC_TYPES,
    SPEC_TYPES,
    Speculation,
    speculation_of,
)
from minfer_jax.engine.plan import MAX_DRAFT


def add_speculative_flags(group: Any) -> None:
    group.add_argument(
        "--spec-type",
        default="none",
        choices=list(dict.fromkeys(LLAMA_CPP_SPEC_TYPES + SPEC_TYPES)),
        metavar="TYPE",
        help="speculative decoding: ngram-simple (alias lookup: drafts copied from the prompt "
        "and the output so far, verified several per step; the same output), draft-mtp (alias "
        "mtp: a Qwen3.5 / 3.6 file's MTP block drafts, default 3 a step) or none (default); "
        "llama.cpp's draft-model types are not implemented",
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


def speculation_from_args(args: Any) -> Speculation | None:
    """The flags as a Speculation (None: off); a bad value is an InvalidArgumentError."""
    if args.spec_type == "none":
        return None  # llama.cpp ignores draft sizes without a type
    return speculation_of(args.spec_type, args.draft_max, args.draft_min)
