r"""Cut llama.cpp's ggml-vocab-NAME.gguf test vocabularies down to what their test vectors need.

    PYTHONPATH=. python tools/extract_vocab.py DIR/ggml-vocab-llama-bpe.gguf \
        --out tests/data/tokenizer/
    PYTHONPATH=. python tools/extract_vocab.py DIR/ggml-vocab-qwen35.gguf \
        --also tests/data/llama_cpp/qwen35-tokenizer.json --out tests/data/tokenizer/

Writes NAME.vocab.json (+ copies NAME's .inp / .out beside it): the tokens (by id) that are
substrings of some expected output token (of the .out, and of the cases of the --also JSON files
that tools/llama_cpp_reference.py's tokenize mode wrote), every byte token, every CONTROL /
USER_DEFINED token, their scores and types, and the merges among kept tokens, in the file's order.
Ids are kept; the tests fill the missing ids with unreachable placeholders.

Why the cut vocabulary tokenizes the vectors exactly like the whole one: every merge BPE applies
while tokenizing a text builds a piece of one of the output tokens, so it is among the kept merges;
with a subset of the merges that still contains all applied ones, BPE (lowest rank first) applies
the same merges in the same order. SentencePiece merges are derived from the vocabulary by the
same rule (tokenizer_models.py's _spm_merges), so the kept ones keep their relative order.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from minfer_jax.files.gguf import open_reader, read_metadata
from minfer_jax.files.vocabulary import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_USER_DEFINED

KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("vocab", help="ggml-vocab-NAME.gguf (its .inp / .out beside it)")
    ap.add_argument("--out", required=True, help="directory")
    ap.add_argument("--also", nargs="*", default=[], help="JSON files of more expected ids")
    args = ap.parse_args(argv)
    meta = read_metadata(open_reader(args.vocab))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    lines = open(args.vocab + ".out", encoding="utf-8").read().split("\n")
    final = {tokens[int(i)] for line in lines for i in line.split()}
    for path in args.also:
        with open(path, encoding="utf-8") as f:
            final.update(tokens[i] for case in json.load(f)["cases"] for i in case["ids"])
    pieces = {t[a:b] for t in final for a in range(len(t)) for b in range(a + 1, len(t) + 1)}
    keep = [
        i
        for i, (t, k) in enumerate(zip(tokens, types))
        if t in pieces or k in (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    kept = {tokens[i] for i in keep}
    if meta["tokenizer.ggml.model"] == "gpt2":
        kept.update(t for t in tokens[:256])  # never needed by the merges, cheap to keep
        keep = sorted(set(keep) | set(range(256)))
    merges = [
        m
        for m in meta.get("tokenizer.ggml.merges", [])
        if all(p in kept for p in (*m.split(" ", 1), m.replace(" ", "", 1)))
    ]
    out = {
        "source": os.path.basename(args.vocab),
        "n_vocab": len(tokens),
        "meta": {k: meta[k] for k in KEYS if k in meta},
        "tokens": {str(i): tokens[i] for i in keep},
        "types": {str(i): types[i] for i in keep if types[i] != 1},
        "merges": merges,
    }
    if "tokenizer.ggml.scores" in meta:
        out["scores"] = {str(i): meta["tokenizer.ggml.scores"][i] for i in keep}
    name = os.path.basename(args.vocab).removesuffix(".gguf")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".vocab.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
    for ext in (".inp", ".out"):
        shutil.copyfile(args.vocab + ext, os.path.join(args.out, name + ".gguf" + ext))
    print(f"{name}: kept {len(keep)} of {len(tokens)} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main()
