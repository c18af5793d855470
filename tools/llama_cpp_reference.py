r"""Expected values from llama.cpp (llama-cpp-python on the CPU) for the family tests.

Run from the repository root with the package's venv; llama.cpp runs in its own venv as a
subprocess (`--llama-python`, a python that can `import llama_cpp`), so nothing of llama.cpp is
imported here or by the tests. The tests read only the JSON this writes (tests/data/llama_cpp/).

    PYTHONPATH=. python tools/llama_cpp_reference.py real FILE.gguf \
        --out tests/data/llama_cpp/smollm2.json
    PYTHONPATH=. python tools/llama_cpp_reference.py synthetic qwen3-tiny:q8_0 \
        --out tests/data/llama_cpp/qwen3.json
    PYTHONPATH=. python tools/llama_cpp_reference.py synthetic llama-tiny --matrix-type IQ4_XS \
        --lengths 16,64,200 --out tests/data/llama_cpp/llama-tiny-iq4_xs.json
    PYTHONPATH=. python tools/llama_cpp_reference.py hybrid qwen35-tiny \
        --out tests/data/llama_cpp/qwen35-tiny.json

real: for each prompt (plain text, or a user message through the file's chat template), the ids
our tokenizer gives and the ids llama.cpp gives (they must agree), llama.cpp's 32 greedy tokens,
and the largest |llama.cpp logit - float64 logit| over every prompt position (the float64 forward
is minfer_bench/float64_reference.py), which bounds our own distance in the test. Plus
llama.cpp's ids of
a set of tokenizer texts. --f32-copy: the same distance for an F32 copy of the file in llama.cpp
with an f32 KV cache (the model math without llama.cpp's quantization).
logits: llama.cpp's logits (an .npz beside --out) at every position of random prompts plus its
greedy continuation, for a synthetic spec (`logits gpt-oss-tiny:f32 --f32-kv --out
tests/data/llama_cpp/gpt-oss-tiny-f32.json`).
vocab: llama.cpp's ids for a cut test vocabulary of tests/data/tokenizer with another pre-tokenizer
(`vocab ggml-vocab-llama-bpe --pre gpt-4o --out tests/data/llama_cpp/gpt-4o-tokenizer.json`).
tokenize: llama.cpp's ids of natural text and code for a whole vocabulary file
(`tokenize DIR/ggml-vocab-qwen35.gguf --out tests/data/llama_cpp/qwen35-tokenizer.json`).
families: llama.cpp's ids of FAMILY_TEXTS for the synthetic qwen35, qwen35moe, gpt-oss and gemma4
files, whose vocabularies minfer_bench/synthetic_vocab.py writes
(`families --out tests/data/llama_cpp/synthetic-families-tokenizer.json`).
synthetic: the spec's model written as a GGUF (minfer_bench.synthetic, deterministic in the
seed), random prompts of token ids (one longer than Gemma's 512-token window), llama.cpp's argmax at
every position, its top-2 margin there and its distance from the float64 forward. --greedy N
appends llama.cpp's greedy continuation to each prompt; for MoE models the float64 router's
closest call (k-th minus (k+1)-th probability) is kept per position; --logits-out keeps
llama.cpp's logits (f16 .npz) for a direct comparison:

    PYTHONPATH=. python tools/llama_cpp_reference.py --llama-python /work/venv/bin/python \
        --out tests/data/llama_cpp/qwen3moe-tiny-f32.json synthetic qwen3moe-tiny:f32 \
        --lengths 16,96 --greedy 32 --f32-kv --logits-out tests/data/llama_cpp/qwen3moe-tiny-f32.npz

hybrid: a synthetic qwen35 / qwen35moe (F32, or "qwen35moe-tiny:q8_0-experts"; f32 KV cache) or
gemma4 (minfer_bench.synthetic_gemma4: `--out tests/data/llama_cpp/gemma4-tiny.json hybrid
gemma4-tiny`):
llama.cpp's greedy tokens after random prompts (one past two 64-token delta-rule chunks) and its
logits at every position of prompt + those (tests/data/llama_cpp/qwen35moe-tiny-q8_0-experts.json
from `hybrid qwen35moe-tiny:q8_0-experts`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer_bench import float64_reference  # noqa: E402

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
    "What is the boiling point of water?",
    "Name a famous painting.",
    "Why is the sky blue?",
    "Suggest a name for a cat.",
    "How many legs does a spider have?",
    "What is the largest planet?",
    "Who wrote Hamlet?",
    "Describe a rainbow in five words.",
    "What is the opposite of hot?",
    "Say hello in French.",
    "What color is grass?",
    "Recommend a good book.",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n",
]
TOKENIZER_TEXTS = [
    "Hello world",
    " Hello world",
    "Hello World!",
    "  leading spaces",
    "trailing   ",
    "numbers 1234567 and 3.14159",
    "don't won't I'm they're",
    "\n\n\ttabs\tand\nnewlines\n",
    "unicode: café naïve 東京 😀",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a" * 40,
    "print('hello')  # comment",
    "x = [1, 2, 3]\nfor i in x:\n    print(i)",
]
# Texts that part the gpt-4o split from the others: case runs, contractions in any case, digit
# triples, punctuation with newlines and slashes, combining marks, other scripts.
PRE_TOKENIZER_TEXTS = [
    "HelloWorld CamelCaseString XMLHttpRequest iPhone McDonald's",
    "DON'T Don'T don't I'M YOU'RE they'Ve we'LL he'D it'S",
    "1234567890 12.5 3,141 2026-12-07 v1.2.3",
    "path/to/file.txt // comment\n/* block */\r\n<tag>",
    "e\u0301cole Cafe\u0301 n\u0303 Z\u0327 bae\u0301",
    "aÉb straÉe baÉ XaÉ",
    "end.\n/path and ?\r\n//x",
    "ÀÉÎÕÜ àéîõü ǅungla ǈ ŉ",
    "日本語のテキスト 中文 한국어 العربية עברית",
    "tabs\tand\n\nnewlines  \n   \t end",
    "!!!??? ... --- *** ''' \"\"\"",
    "<|start|>user<|message|>hi<|end|>",
]
# Natural text and code for a whole vocabulary (`tokenize` mode): prose, digits, contractions,
# CJK, emoji, newline and space runs, code, each vocabulary's own chat markers.
NATURAL_TEXTS = [
    "The committee's report, published on 7 December 2026, runs to 1,284 pages; it wasn't what "
    'anyone expected. "We\'ll see," she said -- and left.',
    'def mean(xs: list[float]) -> float:\n    """Average."""\n    if not xs:\n'
    "        raise ValueError('empty')\n    return sum(xs) / len(xs)  # O(n)\n",
    '{"id": 42, "tags": ["a", "b"], "price": 19.99, "ok": true, "next": null}\n',
    "for (int i = 0; i < n; ++i) {\n\tif (a[i] != b[i]) return -1;\n}\r\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "# Title\n\n- item one\n- item two\n\n\n\n> quoted   text   \n",
    "東京は日本の首都です。人口は約1400万人。北京是中国的首都，上海是最大的城市。",
    "한국어 문장과 Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย.",
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🦙🦙🦙 ✅✔️",
    "Café, naïve, résumé, Ångström, ﬁne, ½ + ¼ = ¾, x² ≤ 10³",
    "123 4567 89012 3.14159 -0.5e-10 1,000,000 0x1F 2026-12-07T05:40:00Z",
    "I'm, you're, he's, she'd, we've, they'll, DON'T, Can'T, o'clock, rock'n'roll",
    "    indented\n        more\n\t\ttabs\n   \n\n",
    "https://example.com/path?q=a+b&x=1#frag user@example.org C:\\Users\\me",
    "<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<bos><|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n4<turn|>",
    "e\u0301te\u0301 Vie\u0302\u0301t Nam a\u0300 n\u0303",
]
VOCAB_WORKER = r"""
import json, sys
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
ids = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in job["texts"]]
json.dump(ids, open(job["out"], "w"))
"""
LONG_TEXT = (
    "The river wound through the valley, past farms and mills, and each spring the water rose to "
    "meet the old stone bridge."
)
N_GREEDY = 32

# Runs in the llama.cpp venv: read a job JSON, write logits (.npy) and tokens (JSON).
WORKER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
kv = {"type_k": 0, "type_v": 0} if job.get("f32_kv") else {}  # GGML_TYPE_F32 cache instead of f16
llm = Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=job["n_ctx"], logits_all=True,
            n_threads=2, verbose=False, seed=0, **kv)
tokenized = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in job["texts"]]
out = {"greedy": [], "tokenized": tokenized}
for i, ids in enumerate(job["prompts"]):
    llm.reset()
    llm.eval(ids)
    if not job.get("all_logits"):
        np.save(f"{job['dir']}/logits{i}.npy", np.asarray(llm.scores[:len(ids)], np.float32))
    toks, margins = [], []
    for _ in range(job["n_greedy"]):
        row = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        tok = int(np.argmax(row))
        top2 = np.sort(row)[-2:]
        toks.append(tok)
        margins.append(float(top2[1] - top2[0]))
        llm.eval([tok])
    out["greedy"].append(toks)
    out.setdefault("margins", []).append(margins)
    if job.get("all_logits"):  # prompt + greedy tokens (the last one evaluated too)
        np.save(f"{job['dir']}/logits{i}.npy", np.asarray(llm.scores[:llm.n_tokens], np.float32))
json.dump(out, open(f"{job['dir']}/out.json", "w"))
"""


def run_llama_cpp(
    python: str,
    model: str,
    prompts: list[list[int]],
    texts: list[str],
    n_greedy: int,
    tmp: str,
    f32_kv: bool = False,
    all_logits: bool = False,
):
    n_ctx = max(len(p) for p in prompts) + n_greedy + 8
    job = {
        "model": model,
        "prompts": prompts,
        "texts": texts,
        "n_greedy": n_greedy,
        "dir": tmp,
        "n_ctx": max(256, n_ctx),
        "f32_kv": f32_kv,
        "all_logits": all_logits,
    }
    with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
    with open(os.path.join(tmp, "worker.py"), "w") as f:
        f.write(WORKER)
    subprocess.run(
        [python, os.path.join(tmp, "worker.py"), os.path.join(tmp, "job.json")], check=True
    )
    with open(os.path.join(tmp, "out.json")) as f:
        out = json.load(f)
    logits = [np.load(os.path.join(tmp, f"logits{i}.npy")) for i in range(len(prompts))]
    return logits, out


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def llama_cpp_version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def real(args) -> dict:
    from minfer_jax.files.tokenizer import Tokenizer
    from minfer_jax.model.from_gguf import load_gguf

    gm = load_gguf(args.model)
    tok = Tokenizer.from_model(gm)
    prompts = []
    for text in CHAT_PROMPTS if args.chat else []:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        ids = tok.encode(rendered, add_special=False)
        prompts.append({"text": text, "chat": True, "rendered": rendered, "ids": ids})
    plain = list(PLAIN_PROMPTS)
    if args.long_prompt:  # past a sliding window (Gemma 3: 512)
        plain.append(" ".join(LONG_TEXT for _ in range(args.long_prompt // 20 + 1)))
    for text in plain:
        ids = tok.encode(text)
        if args.long_prompt and text is plain[-1]:
            ids = ids[: args.long_prompt]
            text = tok.decode(ids[1:] if tok.add_bos else ids)
        prompts.append({"text": text, "chat": False, "rendered": text, "ids": ids})
    texts = [p["rendered"] for p in prompts] + TOKENIZER_TEXTS
    with tempfile.TemporaryDirectory() as tmp:
        logits, out = run_llama_cpp(
            args.llama_python, args.model, [p["ids"] for p in prompts], texts, N_GREEDY, tmp
        )
    for p, lg, greedy, margins, lcpp_ids in zip(
        prompts, logits, out["greedy"], out["margins"], out["tokenized"]
    ):
        ref = float64_reference.forward(gm, p["ids"])
        p["llama_cpp_ids_agree"] = lcpp_ids == p["ids"] or (
            tok.add_bos and lcpp_ids == p["ids"][1:]
        )
        p["greedy"] = greedy
        p["greedy_margins"] = margins  # llama.cpp's top-1 minus top-2 logit at each greedy step
        p["llama_cpp_f64_distance"] = float(np.max(np.abs(lg - ref)))
        p["llama_cpp_argmax_equals_f64"] = bool((lg.argmax(-1) == ref.argmax(-1)).all())
        print(
            f"{p['text'][:40]!r}: ids agree {p['llama_cpp_ids_agree']}, |llama.cpp - f64| "
            f"{p['llama_cpp_f64_distance']:.3g}, greedy {tok.decode(greedy)[:60]!r}"
        )
    if (
        args.f32_copy
    ):  # the same weights in F32, f32 KV cache: llama.cpp's math without its rounding
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "f32.gguf")
            write_f32_copy(gm, path)
            f32_logits, f32_out = run_llama_cpp(
                args.llama_python, path, [p["ids"] for p in prompts], [], N_GREEDY, tmp, f32_kv=True
            )
        for p, lg, greedy, margins in zip(
            prompts, f32_logits, f32_out["greedy"], f32_out["margins"]
        ):
            p["f32_copy_greedy"], p["f32_copy_greedy_margins"] = greedy, margins
            ref = float64_reference.forward(gm, p["ids"])
            d = np.max(np.abs(lg - ref), axis=-1)
            p["llama_cpp_f32_copy_f64_distance"] = float(d.max())
            p["llama_cpp_f32_copy_f64_distance_median"] = float(np.median(d))
            print(
                f"{p['text'][:40]!r}: F32 copy |llama.cpp - f64| max {d.max():.3g}, "
                f"median {np.median(d):.3g}"
            )
    tokenizer = [
        {"text": t, "ids": ids} for t, ids in zip(TOKENIZER_TEXTS, out["tokenized"][len(prompts) :])
    ]
    return {
        "file": os.path.basename(args.model),
        "size": os.path.getsize(args.model),
        "sha256": sha256(args.model),
        "n_greedy": N_GREEDY,
        "prompts": prompts,
        "tokenizer": tokenizer,
    }


def write_f32_copy(gm, path: str) -> None:
    """gm's weights dequantized (gguf.quants) into an F32 GGUF with gm's tokenizer metadata."""
    import dataclasses

    from gguf.quants import dequantize

    from minfer_jax.files.gguf import QType, RawTensor

    from minfer_bench.synthetic import write_gguf

    tensors = {
        n: RawTensor(
            n,
            QType.F32,
            t.shape,
            dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float32),
        )
        for n, t in gm.tensors.items()
    }
    tok = {k: v for k, v in gm.metadata.items() if k.startswith("tokenizer.")}
    write_gguf(dataclasses.replace(gm, tensors=tensors), path, progress=False, tokenizer=tok)


def vocab(args) -> dict:
    """llama.cpp's ids for a cut test vocabulary (tests/data/tokenizer) with
    tests/cut_vocab.PRE_TOKENIZER_MERGES under another pre-tokenizer (--pre): its own vectors'
    texts, TOKENIZER_TEXTS and PRE_TOKENIZER_TEXTS."""
    import gguf

    from tests.cut_vocab import PRE_TOKENIZER_MERGES, cut_vocab_meta, vocab_vectors, with_merges

    meta = with_merges(cut_vocab_meta(args.name), PRE_TOKENIZER_MERGES)
    texts = [t for t, _ in vocab_vectors(args.name)] + TOKENIZER_TEXTS + PRE_TOKENIZER_TEXTS
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vocab.gguf")
        w = gguf.GGUFWriter(path, "llama")  # a vocabulary-only file: llama's few required keys
        for add, value in (
            (w.add_block_count, 1),
            (w.add_context_length, 64),
            (w.add_embedding_length, 64),
            (w.add_feed_forward_length, 64),
            (w.add_head_count, 1),
            (w.add_layer_norm_rms_eps, 1e-5),
        ):
            add(value)
        w.add_tokenizer_model(meta["tokenizer.ggml.model"])
        w.add_tokenizer_pre(args.pre)
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_token_merges(meta["tokenizer.ggml.merges"])
        w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        ids = _llama_ids(args.llama_python, path, texts, tmp)
    return {
        "vocab": args.name,
        "pre": args.pre,
        "cases": [{"text": t, "ids": i} for t, i in zip(texts, ids, strict=True)],
    }


def _llama_ids(llama_python: str, model: str, texts: list[str], tmp: str) -> list:
    """llama.cpp's ids of texts for a vocab file, from VOCAB_WORKER run by llama_python in tmp."""
    job = {"model": model, "texts": texts, "out": os.path.join(tmp, "ids.json")}
    with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
    with open(os.path.join(tmp, "worker.py"), "w") as f:
        f.write(VOCAB_WORKER)
    subprocess.run(
        [llama_python, os.path.join(tmp, "worker.py"), os.path.join(tmp, "job.json")], check=True
    )
    with open(job["out"]) as f:
        return json.load(f)


def tokenize(args) -> dict:
    """llama.cpp's ids (vocab_only, special tokens parsed, no BOS) for a whole vocabulary file
    (llama.cpp's models/ggml-vocab-NAME.gguf): NATURAL_TEXTS, TOKENIZER_TEXTS and
    PRE_TOKENIZER_TEXTS. tools/extract_vocab.py --also then keeps the tokens these need."""
    texts = NATURAL_TEXTS + TOKENIZER_TEXTS + PRE_TOKENIZER_TEXTS
    with tempfile.TemporaryDirectory() as tmp:
        ids = _llama_ids(args.llama_python, args.vocab, texts, tmp)
    return {
        "vocab": os.path.basename(args.vocab).removesuffix(".gguf"),
        "cases": [{"text": t, "ids": i} for t, i in zip(texts, ids, strict=True)],
    }


# code, non-ASCII, a lower-upper pair and a decomposed accent (tests/test_synthetic.py checks how
# each family's pre-tokenizer split them)
FAMILY_TEXTS = [
    "def f(x):\n    return x ** 2  # squares\n",
    "Grüße, Ωμέγα! 日本語 café 🙂",
    "helloWorld\t\tcafe\u0301 123456",
]


def family_files(directory: str):
    """(family, path) of the synthetic files whose tokenizers the `families` mode records."""
    from minfer_bench.synthetic import synthetic_model, write_gguf
    from minfer_bench.synthetic_gemma4 import gemma4_model
    from minfer_bench.synthetic_qwen35 import qwen35_model

    models = {
        "qwen35": lambda: qwen35_model("qwen35-tiny"),
        "qwen35moe": lambda: qwen35_model("qwen35moe-tiny"),
        "gpt-oss": lambda: synthetic_model("gpt-oss-tiny:f32"),
        "gemma4": lambda: gemma4_model("gemma4-tiny"),
    }
    for family, build in models.items():
        path = os.path.join(directory, f"{family}.gguf")
        write_gguf(build(), path, progress=False)
        yield family, path


def families(args) -> dict:
    """llama.cpp's ids (vocab_only, special tokens parsed, no BOS) of FAMILY_TEXTS for each
    synthetic family file, with the number of tokens its vocabulary holds."""
    from minfer_jax.model.from_gguf import load_gguf

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, path in family_files(tmp):
            meta = load_gguf(path).metadata
            ids = _llama_ids(args.llama_python, path, FAMILY_TEXTS, tmp)
            out[family] = {
                "n_tokens": len(meta["tokenizer.ggml.tokens"]),
                "cases": [{"text": t, "ids": i} for t, i in zip(FAMILY_TEXTS, ids, strict=True)],
            }
    return {"families": out}


def logits(args) -> dict:
    """llama.cpp's logits at every position of random prompts + its greedy continuation
    (--greedy tokens), for a synthetic spec; written beside --out as an .npz (float16: far below
    the tests' 0.02-std tolerance). For families minfer_bench/float64_reference.py does not know
    (gpt-oss): the test compares our logits with these directly."""
    from minfer_bench.synthetic import synthetic_model, write_gguf

    gm = synthetic_model(args.spec, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [rng.integers(0, gm.config.vocab_size, n).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_gguf(gm, path, progress=False)
        _, out = run_llama_cpp(
            args.llama_python, path, prompts, [], args.greedy, tmp, f32_kv=args.f32_kv
        )
        full = [p + g for p, g in zip(prompts, out["greedy"])]  # teacher-forced: every position
        rows, _ = run_llama_cpp(args.llama_python, path, full, [], 0, tmp, f32_kv=args.f32_kv)
    stem = os.path.splitext(args.out)[0]
    arrays = {f"p{i}": r.astype(np.float16) for i, r in enumerate(rows)}
    np.savez_compressed(stem + ".npz", **arrays)
    return {
        "spec": args.spec,
        "seed": args.seed,
        "f32_kv": args.f32_kv,
        "logits": os.path.basename(stem + ".npz"),
        "prompts": [
            {"ids": ids, "n_prompt": len(p), "margin": _margins(r)}
            for ids, p, r in zip(full, prompts, rows)
        ],
    }


def _margins(rows: np.ndarray) -> list[float]:
    top2 = np.sort(rows, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).tolist()


def synthetic(args) -> dict:
    from minfer_jax.quant.planes import QType

    from minfer_bench.synthetic import one_format_model, synthetic_model, write_gguf

    if args.matrix_type:  # spec: a config name
        gm = one_format_model(args.spec, QType[args.matrix_type], seed=args.seed)
    else:
        gm = synthetic_model(args.spec, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [rng.integers(0, gm.config.vocab_size, n).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_gguf(gm, path, progress=False)
        logits, out = run_llama_cpp(
            args.llama_python,
            path,
            prompts,
            [],
            args.greedy,
            tmp,
            f32_kv=args.f32_kv,
            all_logits=args.greedy > 0,
        )
    rows, kept_logits = [], {}
    for i, (ids, lg, greedy) in enumerate(zip(prompts, logits, out["greedy"])):
        ids = ids + greedy  # each greedy token was fed back: logits at every position
        lg = lg[: len(ids)]
        gaps: list = []
        ref = float64_reference.forward(gm, ids, router_gaps=gaps)
        top2 = np.sort(lg, axis=-1)[:, -2:]
        rows.append(
            {
                "ids": ids,
                "n_prompt": len(prompts[i]),
                "argmax": lg.argmax(-1).tolist(),
                "margin": (top2[:, 1] - top2[:, 0]).tolist(),
                "llama_cpp_f64_distance": float(np.max(np.abs(lg - ref))),
                "llama_cpp_f64_std": np.std(lg - ref, axis=-1).tolist(),  # per position
                "llama_cpp_f64_max": np.max(np.abs(lg - ref), axis=-1).tolist(),
                "f64_argmax_equal": int((lg.argmax(-1) == ref.argmax(-1)).sum()),
            }
        )
        if gaps:  # MoE: the router's closest call at each position, over the layers
            rows[-1]["f64_router_gap"] = np.min(gaps, axis=0).tolist()
        if args.logits_out:
            kept_logits[f"logits{i}"] = lg.astype(np.float16)
        print(
            f"{len(ids)} tokens: |llama.cpp - f64| {rows[-1]['llama_cpp_f64_distance']:.3g}, "
            f"llama.cpp argmax = f64 argmax at {rows[-1]['f64_argmax_equal']}/{len(ids)}, min "
            f"margin {min(rows[-1]['margin']):.3g}"
        )
    if args.logits_out:  # llama.cpp's logits themselves, f16 (the MoE parity tests read them)
        np.savez_compressed(args.logits_out, **kept_logits)
    out = {"spec": args.spec, "seed": args.seed, "f32_kv": args.f32_kv, "prompts": rows}
    return out | ({"matrix_type": args.matrix_type} if args.matrix_type else {})


def hybrid(args) -> dict:
    """A synthetic qwen35 variant (minfer_bench.synthetic_qwen35, F32, f32 KV cache): llama.cpp's
    greedy continuation of each random prompt, then its logits at every position of prompt +
    continuation (int16 steps of max|logit| / 32767, base64: f16 would round by ~1e-3 of the std),
    which the test compares with ours in units of their std."""
    import base64

    from minfer_bench.synthetic import write_gguf
    from minfer_bench.synthetic_gemma4 import GEMMA4_TINY, gemma4_model
    from minfer_bench.synthetic_qwen35 import qwen35_model

    build = gemma4_model if args.name in GEMMA4_TINY else qwen35_model
    gm = build(args.name, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [rng.integers(0, gm.config.vocab_size, n).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_gguf(gm, path, progress=False)
        _, out = run_llama_cpp(args.llama_python, path, prompts, [], args.n_greedy, tmp, True)
        full = [p + g for p, g in zip(prompts, out["greedy"])]
        logits, _ = run_llama_cpp(args.llama_python, path, full, [], 0, tmp, True)
    rows = []
    for ids, greedy, lg in zip(prompts, out["greedy"], logits):
        step = float(np.abs(lg).max()) / 32767
        steps = np.round(lg / step).astype("<i2")
        rows.append(
            {
                "ids": ids,
                "greedy": greedy,
                "logits_i16": base64.b64encode(steps.tobytes()).decode(),
                "logit_step": step,
                "std": float(lg.std()),
            }
        )
        print(f"{args.name}: {len(ids)} tokens + {len(greedy)} greedy, logit std {lg.std():.3g}")
    return {"name": args.name, "seed": args.seed, "f32_kv": True, "prompts": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--llama-python",
        default="/tmp/lcpp-venv/bin/python",
        help="a python with llama_cpp installed",
    )
    ap.add_argument("--out", required=True)
    sub = ap.add_subparsers(dest="kind", required=True)
    r = sub.add_parser("real")
    r.add_argument("model")
    r.add_argument(
        "--no-chat", dest="chat", action="store_false", help="plain prompts only (base models)"
    )
    r.add_argument(
        "--long-prompt", type=int, default=0, metavar="N", help="one more prompt of N tokens"
    )
    r.add_argument(
        "--f32-copy",
        action="store_true",
        help="also run llama.cpp on an F32 copy (f32 KV cache) and record its float64 distance",
    )
    s = sub.add_parser("synthetic")
    s.add_argument("spec")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--lengths", default="16,64,200,600")
    s.add_argument(
        "--f32-kv", action="store_true", help="llama.cpp's KV cache in f32 (default f16)"
    )
    s.add_argument(
        "--matrix-type",
        help="spec is a config name; every matrix but the token embedding in this GGML type, "
        "the rest F32 (e.g. IQ4_NL)",
    )
    s.add_argument(
        "--greedy",
        type=int,
        default=0,
        metavar="N",
        help="append llama.cpp's N greedy tokens to each prompt (values at every position)",
    )
    s.add_argument("--logits-out", default="", help="also keep llama.cpp's logits here (.npz)")
    lg = sub.add_parser("logits")
    lg.add_argument("spec")
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--lengths", default="24,72")
    lg.add_argument("--greedy", type=int, default=16, help="llama.cpp's greedy tokens appended")
    lg.add_argument("--f32-kv", action="store_true", help="llama.cpp's KV cache in f32")
    v = sub.add_parser("vocab")
    v.add_argument("name", help="a cut vocabulary of tests/data/tokenizer (ggml-vocab-llama-bpe)")
    v.add_argument("--pre", required=True, help="the tokenizer.ggml.pre to write, e.g. gpt-4o")
    tk = sub.add_parser("tokenize", help="llama.cpp's ids of NATURAL_TEXTS for a vocab file")
    tk.add_argument("vocab", help="a whole vocabulary, e.g. llama.cpp's ggml-vocab-qwen35.gguf")
    sub.add_parser("families", help="llama.cpp's ids for the synthetic families' vocabularies")
    h = sub.add_parser(
        "hybrid",
        help="a synthetic qwen35 or gemma4 variant (synthetic_qwen35.QWEN35_TINY, "
        "synthetic_gemma4.GEMMA4_TINY)",
    )
    h.add_argument("name")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--lengths", default="170,24")
    h.add_argument("--n-greedy", type=int, default=16)
    args = ap.parse_args(argv)
    modes = {"real": real, "synthetic": synthetic, "vocab": vocab, "logits": logits}
    modes["tokenize"] = tokenize
    modes["hybrid"] = hybrid
    modes["families"] = families
    result = modes[args.kind](args)
    result["llama_cpp_python"] = llama_cpp_version(args.llama_python)
    result["tool"] = "tools/llama_cpp_reference.py"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
