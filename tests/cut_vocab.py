"""llama.cpp's tokenizer test vocabularies as committed in tests/data/tokenizer (README there):
the cut vocabularies as GGUF tokenizer metadata and their test vectors. Shared by the tokenizer
tests and tools/llama_cpp_reference.py (its vocab mode)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data" / "tokenizer"


def cut_vocab_meta(name: str) -> dict:
    """GGUF tokenizer metadata from DATA/NAME.vocab.json: missing ids become unreachable
    placeholders."""
    cut = json.loads((DATA / f"{name}.vocab.json").read_text(encoding="utf-8"))
    n = cut["n_vocab"]
    tokens = [
        f"\ue000{i}\ue001" for i in range(n)
    ]  # private-use characters: no text or merge reaches them
    types = [1] * n
    for i, t in cut["tokens"].items():
        tokens[int(i)] = t
    for i, k in cut["types"].items():
        types[int(i)] = k
    meta = {
        **cut["meta"],
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": cut["merges"],
    }
    if "scores" in cut:
        scores = [-1e9] * n
        for i, s in cut["scores"].items():
            scores[int(i)] = s
        meta["tokenizer.ggml.scores"] = scores
    return meta


def vocab_vectors(name: str) -> list[tuple[str, list[int]]]:
    texts = (DATA / f"{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (DATA / f"{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    # one line of ids per text; the texts end with a separator (an empty last piece) or not
    # (gemma-4's)
    assert lines[-1] == "" and texts[len(lines) - 1 :] in ([""], [])
    return [
        (t, [int(x) for x in line.split()])
        for t, line in zip(texts[: len(lines) - 1], lines[:-1], strict=True)
    ]


# Merges (byte-level spellings) across the places where split regexes differ: a case change inside
# a word (CamelCase), a contraction of capitals (N'T), punctuation then a newline then '/', a
# combining mark on its letter (e + U+0301), a lower letter then an upper non-ASCII one (aÉ).
# Appended to a cut vocabulary, they make a wrong split give other ids.
PRE_TOKENIZER_MERGES = [
    "o W",
    "l C",
    "N '",
    "N' T",
    "Ċ /",
    "e Ì",
    "eÌ ģ",
    "a Ã",
    "aÃ ī",
]


def with_merges(meta: dict, merges: list[str]) -> dict:
    """meta with each merge's joined token appended to the vocabulary (a NORMAL token) and the
    merge appended to the merges (lowest priority)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    known = set(tokens)
    for merge in merges:
        a, b = merge.split(" ")
        assert a in known and b in known, merge
        tokens.append(a + b)
        known.add(a + b)
    return {
        **meta,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + [1] * len(merges),
        "tokenizer.ggml.merges": list(meta["tokenizer.ggml.merges"]) + merges,
    }
