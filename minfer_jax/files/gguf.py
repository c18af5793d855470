"""GGUF file -> metadata + raw tensor table, checked before any tensor data is touched.

Parsing is gguf-py's `GGUFReader` (mmap); this module only adds three things around it:
- speed: the reader walks 150k-entry token arrays through `np.memmap.__getitem__`, which costs
  ~8 s on the real 0.5B file; reading through a plain ndarray view of the same mmap costs ~2 s;
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
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from minfer_jax.errors import GGUFError, UnsupportedError

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


class _FastReader(GGUFReader):
    """GGUFReader reading through a plain ndarray view of its memmap, with checked reads.

    gguf-py slices `self.data` hundreds of thousands of times while reading metadata; on a
    np.memmap every slice pays for `__array_finalize__`. A plain ndarray view shares the same
    mmap (the view keeps the memmap alive through .base) and slices ~4x faster.

    Every primitive read (`_get`) is bounds-checked: gguf-py silently returns short arrays past
    the end of the file, which turns a truncated file into numpy errors or, for a numeric array
    whose length field is corrupt, into a loop over ~2**60 empty reads. Metadata entries and
    tensor infos are parsed one at a time so that any failure names the key or tensor.
    """

    _ORDER_NEEDS_VIEW = {"S"} if sys.byteorder == "little" else {"S", "<"}

    @property  # type: ignore[override]
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value
        self._size = int(self._data.shape[0])

    def _get(self, offset, dtype, count=1, override_order=None):
        offset, count = int(offset), int(count)
        dt = _DTYPES.get(dtype) or np.dtype(dtype)
        end = offset + dt.itemsize * count
        if count < 0 or end > self._size:
            raise GGUFError(
                f"needs bytes {offset}..{end} but the file has only {self._size} bytes "
                "(truncated or corrupt file)"
            )
        arr = self._data[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        if order in self._ORDER_NEEDS_VIEW:
            arr = arr.view(dt.newbyteorder(order))
        return arr

    def _get_field_parts(self, orig_offs, raw_type):
        # An array's length is checked against the bytes left before gguf-py loops over it: parsing
        # costs ~130 bytes of memory per item, so one corrupt length must not parse the whole file.
        if int(raw_type) == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            if item_type == GGUFValueType.ARRAY:
                raise GGUFError("arrays of arrays are not supported")
            _check_count(
                "array",
                length,
                _ITEM_MIN_BYTES.get(item_type, 1),
                self._size - orig_offs - 12,
                MAX_ARRAY_LEN,
                self._size,
            )
            if self.byte_order not in self._ORDER_NEEDS_VIEW:
                return self._array_parts(orig_offs, GGUFValueType(item_type), length)
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(self, orig_offs, item_type, length):
        """gguf-py's parts of a native-order array, built without its per-item recursion (the 150k
        tokens, merges and token types of a Qwen2 file: 1.8 s -> 0.5 s). The parts are the same
        arrays gguf-py makes: [item type, length, then per item its parts]."""
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(item_type)
        if nptype is not None:  # numbers: one view, split into gguf-py's one-element views in C
            items = self._get(offs, nptype, length)
            return (
                12 + int(items.nbytes),
                [*head, *items.reshape(length, 1)],
                list(range(2, 2 + length)),
                [GGUFValueType.ARRAY, item_type],
            )
        if item_type != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, GGUFValueType.ARRAY)
        data, raw, size, u64 = self._data, self._data.data, self._size, _DTYPES[np.uint64]
        parts = head
        for _ in range(length):  # per string: its uint64 length, then its bytes
            if offs + 8 > size:
                raise GGUFError(
                    f"needs bytes {offs}..{offs + 8} but the file has only {size} bytes "
                    "(truncated or corrupt file)"
                )
            end = offs + 8 + int.from_bytes(raw[offs : offs + 8], sys.byteorder)
            if end > size:
                raise GGUFError(
                    f"needs bytes {offs + 8}..{end} but the file has only {size} bytes "
                    "(truncated or corrupt file)"
                )
            parts.append(data[offs : offs + 8].view(u64))
            parts.append(data[offs + 8 : end])
            offs = end
        return (
            offs - orig_offs,
            parts,
            list(range(3, 2 + 2 * length, 2)),
            [GGUFValueType.ARRAY, item_type],
        )

    def _build_fields(self, offs, count):
        count = int(count)
        _check_count(
            "metadata entry",
            count,
            _KV_MIN_BYTES,
            self._size - offs,
            MAX_METADATA_ENTRIES,
            self._size,
        )
        for i in range(count):
            where = f"metadata entry {i} of {count} (at byte {offs})"
            try:
                _, kdata = self._get_str(offs)
                key = bytes(kdata).decode("utf-8")
            except _PARSE_ERRORS as e:
                raise GGUFError(f"{where}: cannot read its key: {_reason(e)}") from None
            try:
                offs = super()._build_fields(offs, 1)
            except _PARSE_ERRORS as e:
                raise GGUFError(f"metadata '{key}' ({where}): {_reason(e)}") from None
        return offs

    def _build_tensor_info(self, offs, count):
        count = int(count)
        _check_count(
            "tensor info", count, _TENSOR_INFO_MIN_BYTES, self._size - offs, MAX_TENSORS, self._size
        )
        fields = []
        for i in range(count):
            where = f"tensor info {i} of {count} (at byte {offs})"
            try:
                _, name_data = self._get_str(offs)
                name = bytes(name_data).decode("utf-8")
            except _PARSE_ERRORS as e:
                raise GGUFError(f"{where}: cannot read its name: {_reason(e)}") from None
            try:
                offs, (field,) = super()._build_tensor_info(offs, 1)
            except _PARSE_ERRORS as e:
                raise GGUFError(f"tensor '{name}' ({where}): {_reason(e)}") from None
            fields.append(field)
        return offs, fields

    def _build_tensors(self, start_offs, fields):
        # gguf-py would reshape a short slice past EOF (a numpy ValueError) or raise on an unknown
        # type id; check both first so the error names the tensor.
        file_size = self._size
        seen = set()
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            shape = tuple(reversed(dims.tolist()))
            if name in seen:
                raise GGUFError(f"tensor '{name}' appears twice in the tensor table")
            seen.add(name)
            try:
                qtype = QType(int(raw_dtype[0]))
            except ValueError:
                raise UnsupportedError(
                    f"tensor '{name}' has unknown ggml type id {int(raw_dtype[0])}"
                ) from None
            if not 1 <= dims.size <= _MAX_DIMS:
                raise GGUFError(
                    f"tensor '{name}' has {dims.size} dimensions, expected 1..{_MAX_DIMS}"
                )
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = 1
            for d in dims.tolist():
                n_elems *= int(d)
            if int(dims[0]) % block:
                raise GGUFError(
                    f"tensor '{name}' ({qtype.name}, shape {shape}): row length {int(dims[0])} is "
                    f"not a whole number of {qtype.name} blocks of {block}"
                )
            start = int(start_offs) + int(offset[0])
            end = start + n_elems // block * type_size
            if end > file_size:
                raise GGUFError(
                    f"tensor '{name}' ({qtype.name}, shape {shape}) needs bytes {start}..{end} "
                    f"but the file has only {file_size} bytes (truncated file?)"
                )
        super()._build_tensors(start_offs, fields)


_MAX_DIMS = 4  # GGML_MAX_DIMS
# Counts the parser accepts, far above real files (Qwen2.5: ~150k tokens and merges, ~30 keys,
# ~290-970 tensors): each is also bounded by the bytes left in the file, at the smallest encoding of
# one item.
MAX_ARRAY_LEN = 1 << 21
MAX_METADATA_ENTRIES = 1 << 16
MAX_TENSORS = 1 << 16
_KV_MIN_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_TENSOR_INFO_MIN_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset
_ITEM_MIN_BYTES = {
    int(GGUFValueType.STRING): 8,
    int(GGUFValueType.UINT16): 2,
    int(GGUFValueType.INT16): 2,
    int(GGUFValueType.UINT32): 4,
    int(GGUFValueType.INT32): 4,
    int(GGUFValueType.FLOAT32): 4,
    int(GGUFValueType.UINT64): 8,
    int(GGUFValueType.INT64): 8,
    int(GGUFValueType.FLOAT64): 8,
}


def _check_count(
    what: str, count: int, min_bytes: int, bytes_left: int, limit: int, file_size: int
) -> None:
    """Refuse a count the rest of the file cannot hold (or above `limit`) before parsing any
    item."""
    if count > limit or count * min_bytes > max(bytes_left, 0):
        raise GGUFError(
            f"{what} count {count} is impossible (truncated or corrupt file): the limit is "
            f"{limit}, and {count} items of at least {min_bytes} bytes need more than the "
            f"{max(bytes_left, 0)} bytes left; the file has only {file_size} bytes"
        )


_DTYPES = {
    t: np.dtype(t)
    for t in (
        np.uint8,
        np.int8,
        np.uint16,
        np.int16,
        np.uint32,
        np.int32,
        np.uint64,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
        np.bool_,
    )
}
# What gguf-py (and numpy under it) raises on garbage; all of it becomes a GGUFError.
_PARSE_ERRORS = (
    GGUFError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    OverflowError,
    UnicodeDecodeError,
    MemoryError,
    RecursionError,
)


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, GGUFError) else f"{type(e).__name__}: {e}"


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


_STR, _INT, _FLOAT, _BOOL, _STRS, _INTS = (
    "str",
    "int",
    "float",
    "bool",
    "array of str",
    "array of int",
)
# What each key this package reads must hold (llama.cpp's types); other keys pass unchecked.
# `{arch}.` keys are checked under the file's own architecture name (metadata_kinds).
_ARCH_KINDS = {
    **{
        k: _INT
        for k in (
            "block_count",
            "context_length",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "attention.sliding_window",
            "expert_count",
            "expert_used_count",
            "expert_feed_forward_length",
            "expert_shared_feed_forward_length",
            "rope.dimension_count",
        )
    },
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
        return _FastReader(path)
    except GGUFError as e:
        raise type(e)(f"{path}: {e}") from None
    except _PARSE_ERRORS as e:
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
