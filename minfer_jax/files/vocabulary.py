"""A GGUF vocabulary read from its `tokenizer.*` metadata: token types, the bytes each id stands
for, the checked metadata readers, and the ids that end a turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minfer_jax.errors import GGUFError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

# Control tokens that end a turn in the chat formats this family uses (llama.cpp's EOG names).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<｜end▁of▁sentence｜>",
    "<end_of_turn>",
    "<EOT>",
    "<|return|>",  # gpt-oss (harmony): the final answer's end
    "<|call|>",  # gpt-oss: a tool call's end
    "<turn|>",  # Gemma 4: a turn's end
    "<|tool_response>",  # Gemma 4: a tool call waits for its answer
)
# gpt-oss's harmony framing, which llama.cpp always renders (USER_DEFINED, so skip_special keeps
# it): the output's channels are parsed from this text (files/harmony.py). Where the vocabulary
# has <|return|> and <|call|>, <|end|> ends a message, not the turn: not an end token there.
HARMONY_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
HARMONY_END = "<|end|>"
# Markers of chat formats the server reads back from a reply (tool calls, think blocks, Gemma 4's
# thought channel), decoded even where control tokens are skipped: llama.cpp's preserved_tokens.
# Real files type some of them CONTROL (Mistral's [TOOL_CALLS], Gemma 4's <|tool_call>), whose
# calls would otherwise reach the client as bare text.
FORMAT_MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
    "<|channel>",
    "<channel|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)


SPM_SPACE = "\u2581"  # SentencePiece's visible space '▁'


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE tokens are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_translation() -> dict[int, int]:
    """str.translate table: byte-level character -> code point of its byte (0..255).

    Code points below 256 that are not byte-level characters map to U+0100 so that the
    following latin-1 encode fails for tokens not spelled in the byte-level alphabet.
    """
    table = {ord(ch): b for b, ch in bytes_to_unicode().items()}
    for cp in range(256):
        table.setdefault(cp, 0x100)
    return table


def token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """The bytes each id stands for: byte-level decoded, or the raw UTF-8 of added tokens.

    A normal token that is not valid byte-level text (never in a well-formed vocab) falls back
    to its UTF-8 spelling rather than vanishing.
    """
    table = _byte_level_translation()
    out = []
    for text, kind in zip(tokens, types):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            out.append(text.encode("utf-8"))
            continue
        try:
            out.append(text.translate(table).encode("latin-1"))
        except UnicodeEncodeError:
            out.append(text.encode("utf-8"))
    return out


def spm_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """SentencePiece ids -> bytes: '▁' is a space, <0xAB> BYTE tokens their byte, the rest UTF-8."""
    out = []
    for text, kind in zip(tokens, types):
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                out.append(bytes([int(text[3:5], 16)]))
                continue
            except ValueError:
                pass
        out.append(
            (text if kind == TOKEN_CONTROL else text.replace(SPM_SPACE, " ")).encode("utf-8")
        )
    return out


def optional_bool(meta: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise GGUFError(f"{source}: metadata {key!r} must be a bool, got {value!r:.60}")
    return value


def require_list(meta: Mapping[str, Any], key: str, item_type: type, source: str) -> list:
    """A metadata array that must exist and hold `item_type` values."""
    value = meta.get(key)
    if not isinstance(value, (list, tuple)):
        raise GGUFError(
            f"{source}: metadata {key!r} must be an array of {item_type.__name__}, "
            f"got {type(value).__name__}"
        )
    for i, item in enumerate(value):
        if not isinstance(item, item_type) or isinstance(item, bool):
            raise GGUFError(
                f"{source}: metadata {key!r} must be an array of {item_type.__name__}, "
                f"but item #{i} is {type(item).__name__} {item!r:.60}"
            )
    return list(value)


def optional_id(meta: Mapping[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    """A token id from metadata, checked against the vocabulary."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        raise GGUFError(
            f"{source}: metadata {key!r} = {value!r} is not a token id "
            f"(vocabulary has {n_vocab} tokens)"
        )
    return value


def token_types(meta: Mapping[str, Any], n_vocab: int, source: str) -> list[int]:
    """Per-token types; absent means all NORMAL (llama.cpp's default)."""
    if "tokenizer.ggml.token_type" not in meta:
        return [TOKEN_NORMAL] * n_vocab
    types = require_list(meta, "tokenizer.ggml.token_type", int, source)
    if len(types) != n_vocab:
        raise GGUFError(f"{source}: {len(types)} token types for {n_vocab} tokens")
    return types


def is_harmony(tokens: list[str]) -> bool:
    """A harmony vocabulary (gpt-oss): it has <|return|> and <|call|> (llama.cpp's test)."""
    return "<|return|>" in tokens and "<|call|>" in tokens


def harmony_types(tokens: list[str], types: list[int]) -> list[int]:
    """types with llama.cpp's harmony overrides: the framing tokens USER_DEFINED (rendered), and
    <|end|> too in a harmony vocabulary (not an end token: eos_ids)."""
    rendered = set(HARMONY_RENDERED) | ({HARMONY_END} if is_harmony(tokens) else set())
    if not rendered.intersection(tokens):
        return types
    return [TOKEN_USER_DEFINED if t in rendered else k for t, k in zip(tokens, types)]


def eos_ids(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> frozenset[int]:
    """Ids that end generation: eos/eot/eom from metadata plus end-of-turn tokens in the vocab.

    Qwen2.5 instruct declares <|im_end|> as eos while its base/FIM use <|endoftext|>; stopping
    on both is what llama.cpp does (its EOG set) and what a chat loop needs.
    """
    ids = set()
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        token_id = optional_id(meta, key, len(tokens), source)
        if token_id is not None:
            ids.add(token_id)
    wanted = set(END_OF_TURN_TOKENS)
    ids.update(
        i
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t in wanted
    )
    if is_harmony(tokens):  # llama.cpp drops <|end|> however it got there (eos_token_id too)
        ids.difference_update(i for i in ids.copy() if tokens[i] == HARMONY_END)
    return frozenset(ids)
