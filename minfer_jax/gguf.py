"""GGUF file -> Config + metadata + raw tensor table, validated before any tensor data is touched.

Parsing is gguf-py's `GGUFReader` (mmap); this module only adds three things around it:
- speed: the reader walks 150k-entry token arrays through `np.memmap.__getitem__`, which costs
  ~8 s on the real 0.5B file; reading through a plain ndarray view of the same mmap costs ~2 s;
- validation: every way a file can be broken becomes one `GGUFError` that names the file, the
  tensor and what was expected, instead of a numpy traceback;
- the Qwen2 view: a static `Config` and the tensor names/shapes that config implies.

Tensor data stays in the mmap: `RawTensor.data` is the array gguf-py hands out (uint8 rows
[out, bytes_per_row] for block formats and BF16, float arrays for F32/F16), read lazily.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from minfer_jax.errors import GGUFError, UnsupportedError
from minfer_jax.model.config import Config

QType = GGMLQuantizationType

# Weight formats minfer_jax can run. Vectors (norms, biases) must be F32/F16/BF16.
SUPPORTED_TYPES = frozenset({
    QType.F32, QType.F16, QType.BF16,
    QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
})
FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})

ARCHITECTURE = "qwen2"


@dataclasses.dataclass(frozen=True, eq=False)
class RawTensor:
    """One tensor as stored in the file.

    shape is numpy order: (rows, cols) = (out_features, in_features) for matrices, (n,) for
    vectors. data is gguf-py's mmap view: uint8 [rows, bytes_per_row] for block formats and BF16,
    float32/float16 [rows, cols] for F32/F16.
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclasses.dataclass(eq=False)
class GGUFModel:
    """A validated Qwen2 GGUF: static config, metadata as Python values, tensors by name."""

    path: str
    config: Config
    metadata: Mapping[str, Any]
    tensors: dict[str, RawTensor]
    file_size: int

    def tensor(self, name: str) -> RawTensor:
        return self.tensors[name]


class _FastReader(GGUFReader):
    """GGUFReader reading through a plain ndarray view of its memmap, with checked tensor extents.

    gguf-py slices `self.data` hundreds of thousands of times while reading metadata; on a
    np.memmap every slice pays for `__array_finalize__`. A plain ndarray view shares the same
    mmap (the view keeps the memmap alive through .base) and slices ~4x faster.
    """

    @property  # type: ignore[override]
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _build_tensors(self, start_offs, fields):
        # gguf-py would reshape a short slice past EOF (a numpy ValueError) or raise on an unknown
        # type id; check both first so the error names the tensor.
        file_size = int(self._data.shape[0])
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = QType(int(raw_dtype[0]))
            except ValueError:
                raise UnsupportedError(f"tensor '{name}' has unknown ggml type id {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = 1
            for d in dims.tolist():
                n_elems *= int(d)
            if dims.size and n_elems % block:
                raise GGUFError(
                    f"tensor '{name}': {n_elems} elements is not a whole number of {qtype.name} blocks of {block}")
            start = int(start_offs) + int(offset[0])
            end = start + n_elems // block * type_size
            if end > file_size:
                raise GGUFError(
                    f"tensor '{name}' ({qtype.name}, shape {tuple(dims.tolist())}) needs bytes {start}..{end} "
                    f"but the file has only {file_size} bytes (truncated file?)")
        super()._build_tensors(start_offs, fields)


def _field_value(field) -> Any:
    """A reader field as a plain Python value (str, int, float, bool or list of them)."""
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        # Numeric arrays: parts are contiguous single-element views; concatenate in one go.
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return field.contents()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except Exception as e:  # a malformed value: keep the key, report on use
            meta[key] = GGUFError(f"metadata '{key}' cannot be decoded: {e}")
    return meta


def _meta(meta: Mapping[str, Any], key: str, path: str, kind: type, default: Any = None) -> Any:
    v = meta.get(key, default)
    if v is None:
        raise GGUFError(f"{path}: required metadata '{key}' is missing")
    if isinstance(v, GGUFError):
        raise v
    if kind is int:
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise GGUFError(f"{path}: metadata '{key}' should be {kind.__name__}, got {type(v).__name__} {v!r}")
    return kind(v)


def config_from_metadata(meta: Mapping[str, Any], path: str, vocab_size: int, tied: bool) -> Config:
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise UnsupportedError(
            f"{path}: unsupported architecture {arch!r}; minfer_jax runs '{ARCHITECTURE}' models "
            "(Qwen2, Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen)")
    a = ARCHITECTURE
    n_heads = _meta(meta, f"{a}.attention.head_count", path, int)
    try:
        return Config(
            n_layers=_meta(meta, f"{a}.block_count", path, int),
            d_model=_meta(meta, f"{a}.embedding_length", path, int),
            n_heads=n_heads,
            n_kv_heads=_meta(meta, f"{a}.attention.head_count_kv", path, int, default=n_heads),
            d_ff=_meta(meta, f"{a}.feed_forward_length", path, int),
            context_length=_meta(meta, f"{a}.context_length", path, int),
            vocab_size=vocab_size,
            rope_theta=_meta(meta, f"{a}.rope.freq_base", path, float, default=10000.0),
            rms_eps=_meta(meta, f"{a}.attention.layer_norm_rms_epsilon", path, float, default=1e-6),
            tied_output=tied,
        )
    except ValueError as e:
        raise GGUFError(f"{path}: inconsistent hyper-parameters: {e}") from None


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen2 model needs, in numpy order (out, in)."""
    d, kv, ff, v = cfg.d_model, cfg.kv_dim, cfg.d_ff, cfg.vocab_size
    shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (v, d)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,),
            p + "attn_q.weight": (d, d), p + "attn_q.bias": (d,),
            p + "attn_k.weight": (kv, d), p + "attn_k.bias": (kv,),
            p + "attn_v.weight": (kv, d), p + "attn_v.bias": (kv,),
            p + "attn_output.weight": (d, d),
            p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (ff, d),
            p + "ffn_up.weight": (ff, d),
            p + "ffn_down.weight": (d, ff),
        })
    return shapes


def open_reader(path: str) -> GGUFReader:
    """gguf-py's reader over `path`, with every failure turned into a GGUFError naming the file."""
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    size = os.path.getsize(path)
    if size == 0:
        raise GGUFError(f"{path}: file is empty (0 bytes), not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _FastReader(path)
    except GGUFError as e:
        raise type(e)(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        # gguf-py reports truncation and garbage as assorted numpy/struct errors.
        raise GGUFError(f"{path}: cannot parse GGUF header ({type(e).__name__}: {e}); "
                        "the file is truncated or corrupt") from None


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open, parse and validate a Qwen2 GGUF. Touches metadata and tensor headers, not tensor data."""
    path = os.fspath(path)
    reader = open_reader(path)
    meta = read_metadata(reader)
    raw = {t.name: t for t in reader.tensors}

    if "token_embd.weight" not in raw:
        # Architecture first: a llama file should say 'unsupported architecture', not 'missing tensor'.
        config_from_metadata(meta, path, 1, True)
        raise GGUFError(f"{path}: required tensor 'token_embd.weight' is missing")
    vocab = int(raw["token_embd.weight"].shape[-1])
    cfg = config_from_metadata(meta, path, vocab, tied="output.weight" not in raw)

    tensors: dict[str, RawTensor] = {}
    for name, want in expected_shapes(cfg).items():
        t = raw.get(name)
        if t is None:
            raise GGUFError(f"{path}: required tensor '{name}' is missing (expected shape {want})")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if shape != want:
            raise GGUFError(f"{path}: tensor '{name}' has shape {shape}, expected {want} from the metadata")
        qtype = QType(t.tensor_type)
        if qtype not in SUPPORTED_TYPES or (len(want) == 1 and qtype not in FLOAT_TYPES):
            allowed = FLOAT_TYPES if len(want) == 1 else SUPPORTED_TYPES
            raise UnsupportedError(
                f"{path}: tensor '{name}' has type {qtype.name}, which minfer_jax does not support here "
                f"(supported: {', '.join(sorted(q.name for q in allowed))})")
        tensors[name] = RawTensor(name, qtype, shape, t.data)
    return GGUFModel(path=path, config=cfg, metadata=meta, tensors=tensors, file_size=os.path.getsize(path))
