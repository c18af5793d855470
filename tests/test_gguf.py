"""Validation of minfer_jax.model.from_gguf.load_gguf (files/gguf.read_gguf underneath): every
broken file is a GGUFError naming what is wrong."""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quant_shape_to_byte_shape, quantize
from hypothesis import given
from hypothesis import strategies as st

from minfer_jax.errors import GGUFError, UnsupportedError
from minfer_jax.model.from_gguf import expected_shapes, load_gguf
from minfer_jax.model.gguf_model import GGUFModel
from tests.clock import Stopwatch
from tests.fuzz_support import fuzz_settings

# Tiny Qwen2: 2 layers, d_model 64, 4 heads (head_dim 16), 2 KV heads, ff 128, vocab 256.
N_LAYERS, D, N_HEADS, N_KV, FF, VOCAB = 2, 64, 4, 2, 128, 256
KV = N_KV * (D // N_HEADS)
CTX = 512

_DEFAULT_META = {
    "qwen2.block_count": ("uint32", N_LAYERS),
    "qwen2.context_length": ("uint32", CTX),
    "qwen2.embedding_length": ("uint32", D),
    "qwen2.feed_forward_length": ("uint32", FF),
    "qwen2.attention.head_count": ("uint32", N_HEADS),
    "qwen2.attention.head_count_kv": ("uint32", N_KV),
    "qwen2.rope.freq_base": ("float32", 1e6),
    "qwen2.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
}
DROP = object()


def _tensor_specs() -> dict[str, tuple[tuple[int, ...], Q]]:
    """name -> (numpy shape (out, in), storage type) of the tiny model."""
    specs = {
        "token_embd.weight": ((VOCAB, D), Q.F16),
        "output_norm.weight": ((D,), Q.F32),
        "output.weight": ((VOCAB, D), Q.Q8_0),
    }
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        specs.update(
            {
                p + "attn_norm.weight": ((D,), Q.F32),
                p + "attn_q.weight": ((D, D), Q.Q8_0),
                p + "attn_q.bias": ((D,), Q.F32),
                p + "attn_k.weight": ((KV, D), Q.Q8_0),
                p + "attn_k.bias": ((KV,), Q.F32),
                p + "attn_v.weight": ((KV, D), Q.F32),
                p + "attn_v.bias": ((KV,), Q.F32),
                p + "attn_output.weight": ((D, D), Q.Q8_0),
                p + "ffn_norm.weight": ((D,), Q.F32),
                p + "ffn_gate.weight": ((FF, D), Q.Q8_0),
                p + "ffn_up.weight": ((FF, D), Q.Q8_0),
                p + "ffn_down.weight": ((D, FF), Q.Q8_0),
            }
        )
    return specs


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.I32:
        return values.astype(np.int32)
    try:
        return quantize(values.astype(np.float32), qtype)
    except (
        NotImplementedError
    ):  # gguf-py cannot quantize e.g. IQ4_NL: any bytes of the right size do
        shape = quant_shape_to_byte_shape(values.shape, qtype)
        return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    meta: dict | None = None,
    tensors: dict | None = None,
    seed: int = 0,
) -> Path:
    """A small valid Qwen2 GGUF, with overrides.

    meta: key -> (type, value) with type one of uint32/float32/string/..., or DROP to omit.
    tensors: name -> DROP, a storage type (Q.*), or (shape, type) to store a different shape.
    """
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    m = (
        {k: v for k, v in _DEFAULT_META.items()}
        if arch == "qwen2"
        else {k.replace("qwen2.", f"{arch}.", 1): v for k, v in _DEFAULT_META.items()}
    )
    m.update(meta or {})
    for key, spec in m.items():
        if spec is DROP:
            continue
        kind, value = spec
        getattr(w, f"add_{kind}")(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_eos_token_id(VOCAB - 1)
    specs = _tensor_specs()
    for name, override in (tensors or {}).items():
        if override is DROP:
            specs.pop(name, None)
        elif isinstance(override, Q):
            specs[name] = (specs[name][0], override)
        else:
            specs[name] = override
    for name, (shape, qtype) in specs.items():
        data = _encode(rng.standard_normal(shape).astype(np.float32) * 0.1, qtype)
        if qtype in (Q.F32, Q.F16, Q.I32):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _err(path, match_parts, exc=GGUFError) -> str:
    """load_gguf(path) must raise `exc` whose message names the file and every string in
    match_parts."""
    with pytest.raises(exc) as info:
        load_gguf(path)
    msg = str(info.value)
    assert isinstance(info.value, exc)
    assert str(path) in msg, msg
    for part in match_parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def _tensor_info_offset(blob: bytes, name: str) -> int:
    """Byte offset just after the tensor-info name of `name` (at n_dims)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = blob.find(key)
    assert i >= 0 and blob.find(key, i + 1) < 0
    return i + len(key)


def _patch_tensor_info(
    path: Path, name: str, *, type_id: int | None = None, offset: int | None = None
) -> None:
    blob = bytearray(path.read_bytes())
    at = _tensor_info_offset(blob, name)
    (n_dims,) = struct.unpack_from("<I", blob, at)
    at_type = at + 4 + 8 * n_dims
    if type_id is not None:
        struct.pack_into("<I", blob, at_type, type_id)
    if offset is not None:
        struct.pack_into("<Q", blob, at_type + 4, offset)
    path.write_bytes(bytes(blob))


# --------------------------------------------------------------------------------------------
# the valid tiny file


def test_tiny_file_loads(tiny):
    m = load_gguf(tiny)
    assert isinstance(m, GGUFModel)
    c = m.config
    assert (
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.d_ff,
        c.vocab_size,
        c.context_length,
    ) == (N_LAYERS, D, N_HEADS, N_KV, FF, VOCAB, CTX)
    assert c.rope_theta == 1e6 and not c.tied_output
    assert set(m.tensors) == set(expected_shapes(c))
    q = m.tensor("blk.0.attn_q.weight")
    assert q.qtype == Q.Q8_0 and q.shape == (D, D) and q.data.shape == (D, D // 32 * 34)
    assert m.tensor("token_embd.weight").data.shape == (VOCAB, D)
    assert m.metadata["tokenizer.ggml.tokens"][:2] == ["<t0>", "<t1>"]
    assert m.metadata["tokenizer.ggml.token_type"] == [1] * VOCAB
    assert m.file_size == tiny.stat().st_size
    assert load_gguf(os.fspath(tiny)).config == c  # str and PathLike


def test_tied_output(tmp_path):
    m = load_gguf(write_tiny_gguf(tmp_path / "tied.gguf", tensors={"output.weight": DROP}))
    assert m.config.tied_output and "output.weight" not in m.tensors


# --------------------------------------------------------------------------------------------
# not a GGUF file at all


def test_missing_file(tmp_path):
    _err(tmp_path / "nope.gguf", ["no such file"])


def test_directory(tmp_path):
    _err(tmp_path, ["is a directory"])


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _err(p, ["empty", "0 bytes"])


def test_wrong_magic(tmp_path, tiny):
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + tiny.read_bytes()[4:])
    _err(p, ["not a GGUF file", "b'GGML'", "expected b'GGUF'"])


def test_text_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a model\n")
    _err(p, ["not a GGUF file", "expected b'GGUF'"])


@pytest.mark.parametrize("n", [2, 4, 13, 23])
def test_truncated_fixed_header(tmp_path, tiny, n):
    p = tmp_path / "short.gguf"
    p.write_bytes(tiny.read_bytes()[:n])
    _err(p, ["truncated", f"has {n} bytes", "needs 24"])


def test_unsupported_version(tmp_path, tiny):
    blob = bytearray(tiny.read_bytes())
    struct.pack_into("<I", blob, 4, 99)
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(blob))
    _err(p, ["version 99"])


# --------------------------------------------------------------------------------------------
# truncation


def test_truncated_in_metadata(tmp_path, tiny):
    blob = tiny.read_bytes()
    cut = blob.find(b"tokenizer.ggml.tokens") + 200  # inside the token string array
    p = tmp_path / "cut_meta.gguf"
    p.write_bytes(blob[:cut])
    _err(p, ["metadata 'tokenizer.ggml.tokens'", "truncated", f"only {cut} bytes"])


def test_truncated_in_tensor_infos(tmp_path, tiny):
    blob = tiny.read_bytes()
    cut = _tensor_info_offset(blob, "blk.1.ffn_up.weight") + 6
    p = tmp_path / "cut_info.gguf"
    p.write_bytes(blob[:cut])
    _err(p, ["tensor 'blk.1.ffn_up.weight'", "truncated"])


def test_truncated_data(tmp_path, tiny):
    blob = tiny.read_bytes()
    p = tmp_path / "cut_data.gguf"
    p.write_bytes(blob[:-100])
    msg = _err(p, ["tensor '", "truncated", f"only {len(blob) - 100} bytes", "needs bytes"])
    assert "blk.1.ffn_down.weight" in msg  # the last tensor written


def test_data_extent_past_eof(tmp_path, tiny):
    _patch_tensor_info(tiny, "blk.0.attn_k.weight", offset=10**9)
    _err(
        tiny,
        [
            "tensor 'blk.0.attn_k.weight'",
            "Q8_0",
            "needs bytes",
            f"only {tiny.stat().st_size} bytes",
        ],
    )


def test_huge_array_length_fails_fast(tmp_path, tiny):
    """A corrupt element count of a numeric metadata array must not loop over 2**60 empty reads."""
    blob = bytearray(tiny.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = blob.find(key) + len(key) + 4 + 4  # value type ARRAY, item type INT32, then the count
    assert struct.unpack_from("<Q", blob, at)[0] == VOCAB
    struct.pack_into("<Q", blob, at, 1 << 60)
    p = tmp_path / "huge_array.gguf"
    p.write_bytes(bytes(blob))
    clock = Stopwatch()
    _err(p, ["metadata 'tokenizer.ggml.token_type'", "truncated or corrupt"])
    assert clock.seconds() < 2.0, str(clock)


# --------------------------------------------------------------------------------------------
# valid GGUF, wrong model


def test_unknown_architecture(tmp_path):
    p = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    msg = _err(
        p,
        ["unsupported architecture 'mamba'", "'qwen2'", "'llama'", "'qwen3'", "'gemma3'"],
        UnsupportedError,
    )
    assert "missing" not in msg


def test_missing_architecture_key(tmp_path, tiny):
    blob = tiny.read_bytes()
    # Rename the key in place (same length): the file stays valid GGUF without general.architecture.
    p = tmp_path / "noarch.gguf"
    p.write_bytes(blob.replace(b"general.architecture", b"general.architecturX", 1))
    _err(p, ["'general.architecture'", "missing"])


def test_missing_tensor(tmp_path):
    p = write_tiny_gguf(tmp_path / "missing.gguf", tensors={"blk.1.attn_v.bias": DROP})
    _err(p, ["required tensor 'blk.1.attn_v.bias' is missing", f"expected shape ({KV},)"])


def test_missing_token_embd(tmp_path):
    p = write_tiny_gguf(tmp_path / "noembd.gguf", tensors={"token_embd.weight": DROP})
    _err(p, ["required tensor 'token_embd.weight' is missing"])


def test_wrong_shape(tmp_path):
    p = write_tiny_gguf(
        tmp_path / "shape.gguf", tensors={"blk.0.ffn_up.weight": ((FF + 32, D), Q.Q8_0)}
    )
    _err(p, ["tensor 'blk.0.ffn_up.weight'", f"shape ({FF + 32}, {D})", f"expected ({FF}, {D})"])


def test_wrong_rank_token_embd(tmp_path):
    p = write_tiny_gguf(
        tmp_path / "embd1d.gguf", tensors={"token_embd.weight": ((VOCAB * D,), Q.F32)}
    )
    _err(p, ["tensor 'token_embd.weight'", "expected 2 dimensions"])


def test_more_layers_than_tensors(tmp_path):
    """A block_count beyond the tensors fails at the first missing tensor; one beyond any model at
    once."""
    p = write_tiny_gguf(tmp_path / "layers.gguf", meta={"qwen2.block_count": ("uint32", 4096)})
    clock = Stopwatch()
    _err(p, ["required tensor 'blk.2.attn_norm.weight' is missing"])
    p = write_tiny_gguf(tmp_path / "layers.gguf", meta={"qwen2.block_count": ("uint32", 2**31)})
    _err(p, ["n_layers", "1..4096", str(2**31)])
    assert clock.seconds() < 2.0, str(clock)


@pytest.mark.parametrize(
    "name,qtype",
    [
        ("blk.0.ffn_gate.weight", Q.Q8_1),  # IQ4_NL runs since the formats work
        ("blk.1.attn_q.weight", Q.I32),
        ("output_norm.weight", Q.Q8_0),  # vectors must be float
    ],
)
def test_unsupported_type(tmp_path, name, qtype):
    p = write_tiny_gguf(tmp_path / "type.gguf", tensors={name: qtype})
    _err(p, [f"tensor '{name}'", f"type {qtype.name}", "supported:"], UnsupportedError)


def test_unknown_type_id(tmp_path, tiny):
    _patch_tensor_info(tiny, "blk.1.ffn_gate.weight", type_id=1234)
    _err(tiny, ["tensor 'blk.1.ffn_gate.weight'", "unknown ggml type id 1234"], UnsupportedError)


def test_block_misaligned_row(tmp_path, tiny):
    """A Q8_0 tensor whose row length is not a multiple of 32 (type id patched from F32)."""
    _patch_tensor_info(tiny, "blk.0.attn_q.bias", type_id=int(Q.Q8_0))  # 64 elems OK: blocks of 32
    _err(tiny, ["tensor 'blk.0.attn_q.bias'", "Q8_0"], UnsupportedError)
    p = write_tiny_gguf(tiny.parent / "odd.gguf", tensors={"blk.0.attn_q.bias": ((D + 8,), Q.F32)})
    _patch_tensor_info(p, "blk.0.attn_q.bias", type_id=int(Q.Q8_0))
    _err(p, ["tensor 'blk.0.attn_q.bias'", "row length 72", "blocks of 32"])


@pytest.mark.parametrize(
    "key,spec,expect",
    [
        ("qwen2.attention.head_count", ("string", "fourteen"), "should be int, got str 'fourteen'"),
        ("qwen2.block_count", ("float32", 2.0), "should be int, got float"),
        ("qwen2.embedding_length", ("bool", True), "should be int, got bool"),
        ("qwen2.rope.freq_base", ("string", "1e6"), "should be float, got str"),
        ("qwen2.rope.freq_base", ("float32", float("nan")), "finite positive float"),
        ("qwen2.attention.layer_norm_rms_epsilon", ("float32", -1.0), "finite positive float"),
        (
            "qwen2.feed_forward_length",
            DROP,
            "required metadata 'qwen2.feed_forward_length' is missing",
        ),
    ],
)
def test_garbage_metadata(tmp_path, key, spec, expect):
    p = write_tiny_gguf(tmp_path / "meta.gguf", meta={key: spec})
    _err(p, [f"'{key}'" if spec is not DROP else "", expect])


@pytest.mark.parametrize(
    "meta,expect",
    [
        ({"qwen2.attention.head_count": ("uint32", 0)}, "n_heads must be an int in 1..4096, got 0"),
        ({"qwen2.attention.head_count": ("uint32", 5)}, "not an even multiple of n_heads 5"),
        ({"qwen2.attention.head_count_kv": ("uint32", 3)}, "not a multiple of n_kv_heads 3"),
    ],
)
def test_inconsistent_hparams(tmp_path, meta, expect):
    _err(
        write_tiny_gguf(tmp_path / "hp.gguf", meta=meta), ["inconsistent hyper-parameters", expect]
    )


def test_undecodable_architecture_string(tmp_path, tiny):
    blob = tiny.read_bytes()
    p = tmp_path / "utf8.gguf"
    p.write_bytes(
        blob.replace(b"qwen2", b"\xff\xfeen2", 1)
    )  # the first 'qwen2' is the architecture value
    _err(p, ["'general.architecture'", "cannot be decoded"])


# --------------------------------------------------------------------------------------------
# fuzzing: any corruption loads or raises GGUFError, never anything else, and never hangs


@pytest.fixture(scope="module")
def tiny_blob(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf").read_bytes()


def _header_len(blob: bytes) -> int:
    return _tensor_info_offset(blob, "blk.1.ffn_down.weight") + 64


def _load_or_gguferror(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.gguf"
        p.write_bytes(blob)
        clock = Stopwatch()  # the bound hypothesis' deadline kept, on CPU time where less
        try:
            load_gguf(p)
        except GGUFError as e:
            assert str(p) in str(e)
        assert clock.seconds() < 2.0, str(clock)


@fuzz_settings(150, deadline_ms=None)  # derandomized: CI's cases are the same each run
@given(data=st.data())
def test_fuzz_byte_flips(tiny_blob, data):
    blob = bytearray(tiny_blob)
    hdr = _header_len(tiny_blob)
    n = data.draw(st.integers(1, 8), label="n_flips")
    for _ in range(n):
        # Mostly the header (where parsing happens), sometimes anywhere.
        hi = data.draw(st.sampled_from([hdr, len(blob)]), label="region")
        pos = data.draw(st.integers(0, hi - 1), label="pos")
        blob[pos] = data.draw(st.integers(0, 255), label="byte")
    _load_or_gguferror(bytes(blob))


@fuzz_settings(60, deadline_ms=None)  # derandomized: CI's cases are the same each run
@given(data=st.data())
def test_fuzz_truncation(tiny_blob, data):
    cut = data.draw(st.integers(0, len(tiny_blob)), label="cut")
    _load_or_gguferror(tiny_blob[:cut])


@fuzz_settings(60, deadline_ms=None)  # derandomized: CI's cases are the same each run
@given(data=st.data())
def test_fuzz_header_words(tiny_blob, data):
    """Overwrite aligned 4/8-byte words of the header with extreme values
    (counts, lengths, dims)."""
    blob = bytearray(tiny_blob)
    hdr = _header_len(tiny_blob)
    for _ in range(data.draw(st.integers(1, 3), label="n")):
        width = data.draw(st.sampled_from([4, 8]), label="width")
        pos = data.draw(st.integers(0, hdr - width), label="pos")
        value = data.draw(
            st.sampled_from(
                [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1][: 4 if width == 4 else 6]
            ),
            label="value",
        )
        blob[pos : pos + width] = value.to_bytes(width, "little")
    _load_or_gguferror(bytes(blob))


# --------------------------------------------------------------------------------------------
# the real model


def test_real_model_loads_fast(real_model_path):
    clock = Stopwatch()
    m = load_gguf(real_model_path)
    dt = clock.seconds()
    print(f"\nload_gguf({real_model_path}): {clock}")
    c = m.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size) == (
        24,
        896,
        14,
        2,
        4864,
        151936,
    )
    assert c.rope_theta == 1e6 and not c.tied_output and c.head_dim == 64
    assert m.metadata["general.architecture"] == "qwen2"
    assert len(m.metadata["tokenizer.ggml.tokens"]) == 151936
    assert len(m.tensors) == 2 + 1 + 24 * 12
    assert m.file_size == 491_400_064
    assert dt < 5.0, f"load_gguf took {clock}"
