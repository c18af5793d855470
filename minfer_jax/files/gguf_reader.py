"""gguf-py's GGUFReader made fast and safe: reads through a plain ndarray view of its memmap (~4x
faster slicing than np.memmap), every read bounds-checked and every count bounded by the bytes
left, so a truncated or corrupt file is one GGUFError naming the key or tensor (files/gguf.py
turns the reader into a GGUFFile)."""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType
from gguf import GGMLQuantizationType as QType

from minfer_jax.errors import GGUFError, UnsupportedError


class FastReader(GGUFReader):
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
            except PARSE_ERRORS as e:
                raise GGUFError(f"{where}: cannot read its key: {_reason(e)}") from None
            try:
                offs = super()._build_fields(offs, 1)
            except PARSE_ERRORS as e:
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
            except PARSE_ERRORS as e:
                raise GGUFError(f"{where}: cannot read its name: {_reason(e)}") from None
            try:
                offs, (field,) = super()._build_tensor_info(offs, 1)
            except PARSE_ERRORS as e:
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
PARSE_ERRORS = (
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
