"""The server's speculative decoding per request: llama-server's `speculative.*` fields against the
server's own setting (serve.py's --spec-type, --spec-draft-n-max / --draft-max, ...), and the
reply's `timings` with llama-server's draft counts.

The server's flags decide the drafter and the most it drafts (its plan compiles verification for
that much, engine/plan.py); a request may draft less or not at all:
- `speculative.n_max`: most tokens drafted per step, 0 = off for this request; past the server's
  --draft-max it is the server's (a count past what exists means all of it);
- `speculative.n_min`: fewest drafted tokens worth a verification (clamped to n_max);
- `speculative.p_min`: the least draft-model probability a drafted token needs; prompt lookup's
  drafts have no probability, so it changes nothing here (llama.cpp's n-gram drafters ignore it
  too); checked for its range only.
A request the engine cannot speculate for (logprobs, a grammar or schema) decodes
plainly under the server's default, and is refused (400 naming speculative.n_max) where it asked
for drafts itself. Without --spec-type a request asking for drafts is refused the same way.
"""

from __future__ import annotations

import dataclasses

from minfer_jax.engine.lookup import Speculation, check_speculation
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.server.schemas import BadRequest

N_MAX = "speculative.n_max"


def request_speculation(
    server: Speculation | None, body, cfg, constraint, logprobs: int | None
) -> Speculation | None:
    """The request's Speculation (None: it decodes plainly); server: the server's setting."""
    asked = body.spec_n_max
    if server is None:
        if asked:
            raise BadRequest(
                f"{N_MAX}={asked}: speculative decoding is off on this server (start it with "
                "--spec-type ngram-simple)",
                N_MAX,
            )
        return None
    if asked == 0:
        return None
    try:
        check_speculation(cfg, constraint, logprobs)
    except InvalidArgumentError as e:
        if asked is None:  # the server's default applies where it can
            return None
        raise BadRequest(f"{N_MAX}={asked}: {e}", N_MAX) from None
    draft_max = server.draft_max if asked is None else min(asked, server.draft_max)
    n_min = server.draft_min if body.spec_n_min is None else body.spec_n_min
    return dataclasses.replace(server, draft_max=draft_max, draft_min=min(n_min, draft_max))


def timings(results) -> dict | None:
    """llama-server's `timings` of a request's choices (summed), with its draft counts; None
    where none speculated."""
    stats = [r.speculation for r in results if r.speculation is not None]
    if not stats:
        return None
    first = results[0]
    predicted = sum(len(r.tokens) for r in results)
    decode_ms = 1000 * sum(r.decode_s for r in results)
    return {
        "prompt_n": first.n_prompt - first.cached_tokens,
        "prompt_ms": 1000 * first.prefill_s,
        "predicted_n": predicted,
        "predicted_ms": decode_ms,
        "predicted_per_second": 1000 * predicted / decode_ms if decode_ms > 0 else 0.0,
        "draft_n": sum(s.drafted for s in stats),
        "draft_n_accepted": sum(s.accepted for s in stats),
    }
