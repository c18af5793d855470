"""Our token ids against llama.cpp's on random texts, for whole vocabulary files.

Random joins of pieces that part tokenizers (spaces, newline runs, tabs, CR LF, contractions,
digits, decomposed accents, CJK, emoji and ZWJ sequences, chat markers of several families, '▁',
control characters) and random code points; llama.cpp (llama-cpp-python, vocab_only, in this
process) tokenizes with special tokens parsed and no BOS. Prints each text whose ids differ (the
first few) and the count; exit status 1 when any differ. Run from the repository root in a venv
with llama-cpp-python, on llama.cpp's models/ggml-vocab-NAME.gguf files:

    PYTHONPATH=. python tools/tokenizer_vs_llama_cpp.py DIR/ggml-vocab-qwen35.gguf \
        DIR/ggml-vocab-gemma-4.gguf --texts 500
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from llama_cpp import Llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer_jax.files.gguf import open_reader, read_metadata  # noqa: E402
from minfer_jax.files.tokenizer import Tokenizer  # noqa: E402

PIECES = [
    *(" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", "Hello", "world", "'s", "'T", "123", "4567"),
    *("é", "e\u0301", "東京", "日本語", "😀", "👨\u200d👩\u200d👧", "<|im_start|>", "<|turn>"),
    *("<turn|>", "<bos>", "def", "(", ")", ":", "{", "}", "==", "//", "...", "--", "Ω", "ñ"),
    *("ß", "\u200b", "▁", "x", "Z", "ǅ", "١٢٣", "ไทย", "\x00", "\x7f", "\ufffd"),
]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    joined = ["".join(rng.choices(PIECES, k=rng.randint(1, 12))) for _ in range(n - n // 5)]
    ranges = [(32, 0x2FF), (0x3000, 0x9FFF), (0x1F300, 0x1F6FF), (10, 10), (32, 32)]
    points = [
        "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 20)))
        for _ in range(n // 5)
    ]
    return joined + points


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("vocab", nargs="+", help="whole vocabulary GGUF files")
    ap.add_argument("--texts", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    texts = random_texts(args.texts, args.seed)
    differing = 0
    for path in args.vocab:
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
        tok = Tokenizer.from_metadata(read_metadata(open_reader(path)), source=path)
        bad = 0
        for text in texts:
            want = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            got = tok.encode(text, add_special=False)
            if got != want:
                bad += 1
                if bad <= 5:
                    print(f"{text!r}\n  ours {got}\n  llama.cpp {want}")
        print(f"{os.path.basename(path)}: {bad} of {len(texts)} texts differ")
        differing += bad
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
