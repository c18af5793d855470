"""GGUF file -> metadata + raw tensor table, checked before any tensor data is touched.

Parsing is gguf-py's `GGUFReader` (mmap); this module only adds three things around it:
- speed (gguf_reader.py): the reader walks 150k-entry token arrays through
  `np.memmap.__getitem__`, which costs ~8 s on the real 0.5B file; reading through a plain
  ndarray view of the same mmap costs ~2 s;
- validation: every way a file can be broken becomes one `GGUFError` that names the file, the
  tensor and what was expected, instead of a numpy traceback;
- typed reads of the `{arch}.*` hyper-parameters (MetadataView) for the model side, which turns
  them into a Config (model/gguf_model.py; this module knows no model).

Tensor data stays in the mmap: `RawTensor.data` is the array gguf-py hands out (uint8 rows
[out, bytes_per_row] for block formats and BF16, float arrays for F32/F16), read lazily.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from minfer_jax.errors import GGUFError
from minfer_jax.files.gguf_reader import PARSE_ERRORS, FastReader

QType = GGMLQuantizationType

# Weight formats minfer_jax can run: the types of quant/planes.FORMATS (one record each; the reader
# sits below quant, so it lists them: tests/test_formats.py checks the two agree). Vectors (norms,
# biases) must be F32/F16/BF16.
SUPPORTED_TYPES = frozenset(
    {
        QType.F32,
        QType.F16,
        QType.BF16,
        QType.Q8_0,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q2_K,
        QType.Q3_K,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
        QType.IQ4_NL,
        QType.IQ4_XS,
        QType.MXFP4,
    }
)
FLOAT_TYPES = frozenset({QType.F32, QType.F16, QType.BF16})


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
class GGUFFile:
    """A GGUF as read: its metadata as Python values (every key of METADATA_KINDS of its kind) and
    every tensor by name, data left in the mmap. What it holds is not checked against a model:
    model/gguf_model.py turns it into a Config and the tensors that Config needs."""

    path: str
    metadata: Mapping[str, Any]
    tensors: dict[str, RawTensor]
    file_size: int


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
        except Exception as e:  # noqa: BLE001  a malformed value: keep the key, report on use
            meta[key] = GGUFError(f"metadata '{key}' cannot be decoded: {e}")
    return meta


_STR, _INT, _FLOAT, _BOOL, _STRS, _INTS, _BOOLS = (
    "str",
    "int",
    "float",
    "bool",
    "array of str",
    "array of int",
    "array of bool",
)
_INT_OR_INTS = "int or array of int"  # llama.cpp's get_key_or_arr: one value or one per layer
# What each key this package reads must hold (llama.cpp's types); other keys pass unchecked.
# `{arch}.` keys are checked under the file's own architecture name (metadata_kinds).
_ARCH_KINDS = {
    **{
        k: _INT
        for k in (
            "block_count",
            "context_length",
            "embedding_length",
            "attention.head_count",
            "attention.key_length",
            "attention.value_length",
            "attention.sliding_window",
            "expert_count",
            "expert_used_count",
            "expert_feed_forward_length",
            "expert_shared_feed_forward_length",
            "rope.dimension_count",
            "ssm.conv_kernel",
            "ssm.inner_size",
            "ssm.state_size",
            "ssm.time_step_rank",
            "ssm.group_count",
            "full_attention_interval",
            "nextn_predict_layers",
        )
    },
    "feed_forward_length": _INT_OR_INTS,
    "attention.head_count_kv": _INT_OR_INTS,
    "attention.sliding_window_pattern": _BOOLS,
    "rope.dimension_sections": _INTS,
    "attention.recurrent_layers": _BOOLS,
    "rope.freq_base": _FLOAT,
    "attention.layer_norm_rms_epsilon": _FLOAT,
    "rope.scaling.type": _STR,
    "rope.scaling.factor": _FLOAT,
    "attention.scale": _FLOAT,
}
METADATA_KINDS = {
    "general.architecture": _STR,
    "general.name": _STR,
    "general.alignment": _INT,
    "general.file_type": _INT,
    "general.quantization_version": _INT,
    "tokenizer.ggml.model": _STR,
    "tokenizer.ggml.pre": _STR,
    "tokenizer.chat_template": _STR,
    "tokenizer.ggml.tokens": _STRS,
    "tokenizer.ggml.merges": _STRS,
    "tokenizer.ggml.token_type": _INTS,
    **{
        f"tokenizer.ggml.{k}_token_id": _INT
        for k in ("bos", "eos", "eot", "eom", "padding", "unknown")
    },
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_eos_token": _BOOL,
}


def metadata_kinds(arch: str | None) -> dict[str, str]:
    """METADATA_KINDS plus the `{arch}.*` hyper-parameter keys of architecture `arch`."""
    if not isinstance(arch, str):
        return METADATA_KINDS
    return {**METADATA_KINDS, **{f"{arch}.{k}": kind for k, kind in _ARCH_KINDS.items()}}


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


_KIND_CHECKS = {
    _STR: lambda v: isinstance(v, str),
    _BOOL: lambda v: isinstance(v, bool),
    _INT: _is_int,
    _FLOAT: lambda v: _is_int(v) or isinstance(v, (float, np.floating)),
    _STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    _INTS: lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    _BOOLS: lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v),
    _INT_OR_INTS: lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
}


def check_metadata_types(meta: Mapping[str, Any], path: str) -> None:
    """Every key of METADATA_KINDS present in `meta` holds its kind
    (an array as a whole: every item)."""
    for key, kind in metadata_kinds(meta.get("general.architecture")).items():
        if key not in meta:
            continue
        v = meta[key]
        if isinstance(v, GGUFError):
            raise GGUFError(f"{path}: {v}")
        if not _KIND_CHECKS[kind](v):
            shown = (
                f"an array of {len(v)}" if isinstance(v, list) else f"{type(v).__name__} {v!r:.60}"
            )
            raise GGUFError(f"{path}: metadata '{key}' should be {kind}, got {shown}")


def metadata_value(
    meta: Mapping[str, Any], key: str, path: str, kind: type, default: Any = None
) -> Any:
    v = meta.get(key, default)
    if v is None:
        raise GGUFError(f"{path}: required metadata '{key}' is missing")
    if isinstance(v, GGUFError):
        raise GGUFError(f"{path}: {v}")
    check = {int: _KIND_CHECKS[_INT], float: _KIND_CHECKS[_FLOAT]}.get(kind)
    if not (check(v) if check else isinstance(v, kind)):
        raise GGUFError(
            f"{path}: metadata '{key}' should be {kind.__name__}, got {type(v).__name__} {v!r}"
        )
    return kind(v)


class MetadataView:
    """Typed reads of one file's `{arch}.<key>` hyper-parameters for a family's config_from_metadata
    (model/schema.py); every missing or mistyped key is a GGUFError naming the file and the key."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        path: str,
        arch: str,
        vocab_size: int,
        tied: bool,
        tensor_names: frozenset[str] = frozenset(),
    ):
        self.meta, self.path, self.arch = meta, path, arch
        self.vocab_size, self.tied, self.tensor_names = vocab_size, tied, tensor_names

    def int(self, key: str, default: Any = None) -> int:
        return metadata_value(self.meta, f"{self.arch}.{key}", self.path, int, default=default)

    def float(self, key: str, default: Any = None) -> float:
        return metadata_value(self.meta, f"{self.arch}.{key}", self.path, float, default=default)

    # the methods `str` and `float` shadow the builtins in this class's scope
    def str(self, key: str, default: Any = None) -> builtins.str:
        return metadata_value(self.meta, f"{self.arch}.{key}", self.path, str, default=default)

    def list(self, key: builtins.str, default: Any = None) -> builtins.list:
        """An array key (its item kind checked by check_metadata_types at load)."""
        return metadata_value(
            self.meta, f"{self.arch}.{key}", self.path, builtins.list, default=default
        )

    def positive_float(self, key: builtins.str, default: Any = None) -> builtins.float:
        v = self.float(key, default)
        if not (math.isfinite(v) and v > 0):
            raise GGUFError(
                f"{self.path}: metadata '{self.arch}.{key}' should be a finite positive float, "
                f"got {v!r}"
            )
        return v


def open_reader(path: str) -> GGUFReader:
    """gguf-py's reader over `path`, with every failure turned into a GGUFError naming the file."""
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read the file ({e.strerror or e})") from None
    if size == 0:
        raise GGUFError(f"{path}: file is empty (0 bytes), not a GGUF file")
    if magic != b"GGUF" and not (len(magic) < 4 and b"GGUF".startswith(magic)):
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    if size < _HEADER_SIZE:
        raise GGUFError(
            f"{path}: truncated GGUF header: the file has {size} bytes, the fixed header "
            f"(magic, version, tensor count, metadata count) needs {_HEADER_SIZE}"
        )
    try:
        return FastReader(path)
    except GGUFError as e:
        raise type(e)(f"{path}: {e}") from None
    except PARSE_ERRORS as e:
        # gguf-py reports bad versions, alignments and garbage as assorted numpy/struct errors.
        raise GGUFError(
            f"{path}: cannot parse GGUF header ({type(e).__name__}: {e}); "
            "the file is truncated or corrupt"
        ) from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot map the file ({e.strerror or e})") from None


_HEADER_SIZE = 24


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and parse a GGUF: its metadata (types checked) and tensor headers, not their data."""
    path = os.fspath(path)
    reader = open_reader(path)
    meta = read_metadata(reader)
    check_metadata_types(meta, path)
    tensors = {
        t.name: RawTensor(
            t.name, QType(t.tensor_type), tuple(int(s) for s in reversed(t.shape.tolist())), t.data
        )
        for t in reader.tensors
    }
    return GGUFFile(path=path, metadata=meta, tensors=tensors, file_size=os.path.getsize(path))
