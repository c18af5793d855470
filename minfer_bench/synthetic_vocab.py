"""The placeholder tokenizer of a synthetic model: each family's tokenizer kind and pre-tokenizer
as its real files have them, over a small vocabulary that spells any text.

- byte-level BPE (`gpt2`) for every family but gemma4: ids 0..255 the byte-level alphabet, three
  merges whose result shows the pre-tokenizer (placeholder_vocab), Qwen2.5's end tokens at their
  real ids (or the last id in a tiny vocabulary); the pre-tokenizer the family's real files name
  (PRE_TOKENIZERS: Qwen3.5 / 3.6's `qwen35`, gpt-oss's `gpt-4o`; `qwen2` for the rest, Qwen2.5's
  and Qwen3's own).
- gemma4 (`tokenizer.ggml.model = gemma4`, as Gemma 4's files): <pad> <eos> <bos> <unk> at ids
  0..3 as there, the 256 <0xXX> byte tokens (byte fallback), '▁' (a space), '\\n', '▁▁' (one
  merge) and as many printable ASCII characters as the vocabulary holds.

Every other id is an unreachable '<|synthetic_N|>' token.
"""

from __future__ import annotations

import string

from minfer_jax.files.vocabulary import (
    SPM_SPACE,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    bytes_to_unicode,
)

BOS_ID, EOS_ID, PAD_ID = 151643, 151645, 151643  # Qwen2.5's
SPECIAL_TOKENS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
# tokenizer.ggml.pre of the real files, by family (the others: Qwen2.5's)
PRE_TOKENIZERS = {"qwen35": "qwen35", "qwen35moe": "qwen35", "gpt-oss": "gpt-4o"}
# Gemma 4's special tokens at their real ids
GEMMA4_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
_GEMMA4_PAD, _GEMMA4_EOS, _GEMMA4_BOS, _GEMMA4_UNK = range(4)
_GEMMA4_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


def special_tokens_metadata(vocab: int, family: str = "qwen2") -> dict:
    """tokenizer.ggml bos / eos / padding ids of a synthetic model: gemma4's real ones; else
    Qwen2.5's where the vocab holds them, else its last id, and no BOS added."""
    if family == "gemma4":
        return {
            "tokenizer.ggml.bos_token_id": _GEMMA4_BOS,
            "tokenizer.ggml.eos_token_id": _GEMMA4_EOS,
            "tokenizer.ggml.padding_token_id": _GEMMA4_PAD,
            "tokenizer.ggml.unknown_token_id": _GEMMA4_UNK,
            "tokenizer.ggml.add_bos_token": True,
        }
    bos, eos, pad = (BOS_ID, EOS_ID, PAD_ID) if vocab > EOS_ID else (vocab - 1,) * 3
    return {
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": pad,
        "tokenizer.ggml.add_bos_token": False,
    }


def placeholder_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte-level placeholder vocabulary of `vocab_size`.

    Ids 0..255: the byte-level alphabet, id b being byte b's character (so every byte, '\\n'
    included, has a token); then 'ĠĠ', 'oW' and 'e' + U+0301's first byte (their merges);
    Qwen2.5's <|endoftext|> /
    <|im_start|> / <|im_end|> at their real ids (CONTROL); every other id a unique
    '<|synthetic_N|>' NORMAL token.
    """
    byte_chars = bytes_to_unicode()
    alphabet = [byte_chars[b] for b in range(256)]
    tokens = [f"<|synthetic_{i}|>" for i in range(vocab_size)]
    types = [TOKEN_NORMAL] * vocab_size
    tokens[: min(256, vocab_size)] = alphabet[:vocab_size]
    # pairs a pre-tokenizer keeps together or splits: a space run (all), a lower letter before an
    # upper one (one word in qwen2 / qwen35, two in gpt-4o), a letter and its combining accent
    # (one piece in qwen35 only)
    pairs = [("Ġ", "Ġ"), ("o", "W"), ("e", byte_chars[0xCC])][: max(0, vocab_size - 256)]
    merges = [f"{a} {b}" for a, b in pairs]
    tokens[256 : 256 + len(pairs)] = [a + b for a, b in pairs]
    for i, text in SPECIAL_TOKENS.items():
        if i < vocab_size:
            tokens[i], types[i] = text, TOKEN_CONTROL
    if vocab_size <= EOS_ID:  # tiny configs: the last id is the (control) end token
        tokens[-1], types[-1] = "<|endoftext|>", TOKEN_CONTROL
    return tokens, types, merges


def gemma4_placeholder_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of gemma4's placeholder vocabulary (module docstring)."""
    pieces = [SPM_SPACE, "\n", SPM_SPACE * 2, *_GEMMA4_CHARS]
    head = [*GEMMA4_SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    if vocab_size < len(head) + 3:
        raise ValueError(f"a gemma4 placeholder vocabulary needs {len(head) + 3} ids")
    tokens = [*head, *pieces][:vocab_size]
    types = [TOKEN_CONTROL] * 4 + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * (len(tokens) - len(head))
    tokens += [f"<|synthetic_{i}|>" for i in range(len(tokens), vocab_size)]
    types += [TOKEN_NORMAL] * (vocab_size - len(types))
    return tokens, types, [f"{SPM_SPACE} {SPM_SPACE}"]


def placeholder_tokenizer(vocab_size: int, family: str = "qwen2") -> dict:
    """The tokenizer.* metadata of a synthetic model of `family` (module docstring)."""
    if family == "gemma4":
        tokens, token_types, merges = gemma4_placeholder_vocab(vocab_size)
        kind = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.add_space_prefix": False}
    else:
        tokens, token_types, merges = placeholder_vocab(vocab_size)
        kind = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": PRE_TOKENIZERS.get(family, "qwen2"),
        }
    return {
        **kind,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
        **special_tokens_metadata(vocab_size, family),
    }
