"""The split each `tokenizer.ggml.pre` name stands for before byte-level BPE: llama.cpp's pre
types (src/llama-vocab.cpp) in the form of the model's HF tokenizer.json."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from minfer_jax.errors import UnsupportedError

# The split regex of Qwen2's tokenizer.json (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3's split regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3; Meta's tokenizer.json).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5 / 3.6's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35, the tokenizer.json original it
# quotes): Qwen2's with combining marks (\p{M}) kept in the letter run, and no NFC before it, so a
# decomposed "e\u0301" stays one pre-token of two characters.
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O split (gpt-oss's o200k_harmony): case runs split words
# ("CamelCase" -> "Camel", "Case"), contractions stay on their word, digits in threes,
# punctuation takes trailing newlines and '/'. This is llama.cpp's rewrite, not the tokenizer.json
# original it quotes: where they differ (a combining mark after a letter, an upper non-ASCII letter
# after a lower one) this follows llama.cpp (tests/data/llama_cpp/gpt-4o-tokenizer.json).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class BytePairPre:
    """How one `tokenizer.ggml.pre` splits text before byte-level BPE (llama.cpp's pre types, in
    the form of the model's HF tokenizer.json, which llama.cpp's test vectors come from)."""

    split: str | None  # a split regex (isolated), then ByteLevel without its own regex
    digits: bool = False  # single digits first (SmolLM), then ByteLevel with GPT-2's regex
    nfc: bool = False  # NFC-normalize first (Qwen2's tokenizer.json)
    ignore_merges: bool = False  # a pre-token that is itself a token is not merged (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_QWEN2 = BytePairPre(QWEN2_PATTERN, nfc=True)
_LLAMA3 = BytePairPre(LLAMA3_PATTERN, ignore_merges=True, add_bos=True)
_GPT2 = BytePairPre(None)
BPE_PRE_TOKENIZERS = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": BytePairPre(QWEN35_PATTERN),  # Qwen3.5 / 3.6; no NFC, no BOS
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smollm": BytePairPre(None, digits=True),
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "gpt-4o": BytePairPre(GPT4O_PATTERN),  # gpt-oss (o200k_harmony); no NFC, no BOS
}


def byte_pair_pre(meta: Mapping[str, Any], source: str) -> BytePairPre:
    """The pre-tokenizer tokenizer.ggml.pre names; refuse one this package does not know.

    Files converted before llama.cpp wrote the key have none; a Qwen2 file (or one without
    general.architecture) then gets the Qwen2 regex, as it always did.
    """
    arch = meta.get("general.architecture", "qwen2")
    pre = meta.get("tokenizer.ggml.pre", "qwen2" if arch == "qwen2" else None)
    if not isinstance(pre, str) or pre not in BPE_PRE_TOKENIZERS:
        raise UnsupportedError(
            f"{source}: pre-tokenizer {pre!r} is not supported "
            f"(known: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    return BPE_PRE_TOKENIZERS[pre]
