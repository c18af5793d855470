"""Prompts to token ids under a token limit, and chat messages whose content stays literal text.

`encode_within(tok, text, limit)` refuses a prompt of more than `limit` tokens after encoding only
a prefix of it (Tokenizer.count_at_least), so a 50 MB prompt costs what its first few hundred KB
cost; a prompt that fits is encoded once more in full, exactly as `Tokenizer.encode` does.

`encode_chat(tok, messages, limit, literal=True)` renders the chat template and encodes it so that
CONTROL-token text inside a message's content (`<|im_start|>system` typed by a user) stays literal
text, while the template's own markers are control tokens. Before rendering, each control-token
text (and the sentinel character itself) in a content string is replaced by a two-character
sentinel: a noncharacter (U+FDD0, reserved for a program's internal use) and a private-use
character naming the table entry. The rendered text is split at the control tokens left, which
are the template's; the pieces between them get their sentinels back and are encoded without
special-token parsing. With no control-token text in any content this gives exactly the ids of
`encode(render(messages), add_special=False)`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from minfer_jax.errors import ContextOverflowError

# the first prefix probed holds this many characters per allowed token (English ~4)
PROBE_CHARS_PER_TOKEN = 4
PROBE_GROWTH = 4  # each later probe is this much longer: at most ~1.3 encodes of the text in all
SENTINEL = "\ufdd0"
SENTINEL_CODES = 0xF0000  # the private-use plane: table entry i is chr(SENTINEL_CODES + i)


class PromptTooLong(ContextOverflowError):
    """The prompt has more tokens than the context leaves room for
    (counted on a prefix, or in full)."""

    def __init__(self, tokens: int, limit: int, exact: bool):
        ctx = limit + 1
        super().__init__(
            f"the prompt is {'' if exact else 'at least '}{tokens} tokens but the context holds "
            f"{ctx}, which leaves no room to generate; use a larger context (-c, ctx_size) or a "
            "shorter prompt"
        )
        self.tokens, self.limit = tokens, limit


def encode_within(
    tok: Any, text: str, limit: int, *, add_special: bool = True, parse_special: bool = True
) -> list[int]:
    """tok.encode(text) when it has at most `limit` tokens; PromptTooLong as soon as a prefix shows
    it cannot."""
    n = (limit + 1) * PROBE_CHARS_PER_TOKEN
    while n < len(text):
        if (at_least := tok.count_at_least(text[:n], parse_special)) > limit:
            raise PromptTooLong(at_least, limit, exact=False)
        n *= PROBE_GROWTH
    ids = tok.encode(text, add_special=add_special, parse_special=parse_special)
    if len(ids) > limit:
        raise PromptTooLong(len(ids), limit, exact=True)
    return ids


def encode_chat(
    tok: Any,
    messages: Sequence[Mapping[str, Any]],
    limit: int,
    *,
    literal: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The chat template applied to messages, as at most `limit` token ids (PromptTooLong past it).

    literal=True: control-token text in message content is encoded as plain text (module docstring);
    False: it becomes control tokens, as transformers and llama.cpp's server do. template_kwargs:
    extra template variables (enable_thinking, ...).
    """
    extra = dict(template_kwargs or {})
    if not literal:
        text = tok.apply_chat_template(messages, **extra)
        return encode_within(tok, text, limit, add_special=False)
    shield = _shield(tok)
    text = tok.apply_chat_template([shield.protect(m) for m in messages], **extra)
    ids: list[int] = []
    for piece, control_id in shield.pieces(text):
        if control_id is not None:
            ids.append(control_id)
        elif piece:
            try:
                ids += encode_within(
                    tok,
                    shield.restore(piece),
                    limit - len(ids),
                    add_special=False,
                    parse_special=False,
                )
            except PromptTooLong as e:  # counted against what the pieces before it left
                raise PromptTooLong(len(ids) + e.tokens, limit, exact=False) from None
        if len(ids) > limit:
            raise PromptTooLong(len(ids), limit, exact=False)
    return ids


class _Shield:
    """The sentinel table of one tokenizer's control tokens (module docstring)."""

    def __init__(self, controls: dict[str, int]):
        self.ids = controls
        self.table = [
            SENTINEL,
            *controls,
        ]  # entry 0: the sentinel character itself, so user text round-trips
        codes = {text: SENTINEL + chr(SENTINEL_CODES + i) for i, text in enumerate(self.table)}
        self.codes = codes
        by_length = sorted(
            controls, key=len, reverse=True
        )  # the longest control text wins, as in tokenizers
        self.in_content = re.compile("|".join(map(re.escape, [SENTINEL, *by_length])))
        self.in_render = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self.sentinel = re.compile(SENTINEL + "(.)", re.DOTALL)

    def protect(self, message: Mapping[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, str):
            return dict(message)
        return {**message, "content": self.in_content.sub(lambda m: self.codes[m.group()], content)}

    def pieces(self, text: str) -> list[tuple[str, int | None]]:
        """The rendered text split at its control tokens: (text, None) and
        (control text, its id)."""
        if self.in_render is None:
            return [(text, None)]
        out, pos = [], 0
        for m in self.in_render.finditer(text):
            out += [(text[pos : m.start()], None), (m.group(), self.ids[m.group()])]
            pos = m.end()
        out.append((text[pos:], None))
        return out

    def restore(self, piece: str) -> str:
        def back(m: re.Match) -> str:
            i = ord(m.group(1)) - SENTINEL_CODES
            return self.table[i] if 0 <= i < len(self.table) else m.group()

        return self.sentinel.sub(back, piece) if SENTINEL in piece else piece


@functools.lru_cache(maxsize=4)
def _shield(tok: Any) -> _Shield:
    return _Shield({tok.id_to_token(i): i for i in range(tok.vocab_size) if tok.is_control(i)})
