"""A GGUF file read as a model: the file's family turns its metadata into a Config, and every tensor
that Config needs is checked (present, of its shape, of a format minfer_jax runs) before any tensor
data is touched. files/gguf.py reads the file; this module is the model's view of it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from minfer_jax.errors import GGUFError, InvalidArgumentError, UnsupportedError
from minfer_jax.files.gguf import (
    FLOAT_TYPES,
    SUPPORTED_TYPES,
    GGUFFile,
    MetadataView,
    RawTensor,
    metadata_value,
    read_gguf,
)
from minfer_jax.model.config import Config
from minfer_jax.model.families import family, for_architecture
from minfer_jax.model.gguf_model import GGUFModel


def config_from_metadata(
    meta: Mapping[str, Any],
    path: str,
    vocab_size: int,
    tied: bool,
    tensor_names: frozenset[str] = frozenset(),
) -> Config:
    """The family's Config from the file's metadata (families.for_architecture picks the family)."""
    arch = metadata_value(meta, "general.architecture", path, str)
    fam = for_architecture(arch, path)
    try:
        return fam.config_from_metadata(
            MetadataView(meta, path, arch, vocab_size, tied, tensor_names)
        )
    except InvalidArgumentError as e:
        raise GGUFError(f"{path}: inconsistent hyper-parameters: {e}") from None


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `cfg` needs (its family's table), in numpy order (out, in)."""
    return dict(_iter_expected_shapes(cfg))


def _iter_expected_shapes(cfg: Config) -> Iterator[tuple[str, tuple[int, ...]]]:
    """expected_shapes() lazily: a corrupt block_count of 2**40 must fail at the first missing
    tensor, not build a dict of 10**13 names first."""
    return family(cfg).tensor_shapes(cfg)


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open, parse and validate a GGUF of a supported family. Touches metadata and tensor headers,
    not tensor data."""
    return model_from_file(read_gguf(path))


def _checked_tensor(path: str, raw: dict[str, RawTensor], name: str, want: tuple) -> RawTensor:
    t = raw.get(name)
    if t is None:
        raise GGUFError(f"{path}: required tensor '{name}' is missing (expected shape {want})")
    if t.shape != want:
        raise GGUFError(
            f"{path}: tensor '{name}' has shape {t.shape}, expected {want} from the metadata"
        )
    if t.qtype not in SUPPORTED_TYPES or (len(want) == 1 and t.qtype not in FLOAT_TYPES):
        allowed = FLOAT_TYPES if len(want) == 1 else SUPPORTED_TYPES
        raise UnsupportedError(
            f"{path}: tensor '{name}' has type {t.qtype.name}, which minfer_jax does not "
            f"support here (supported: {', '.join(sorted(q.name for q in allowed))})"
        )
    return t


def model_from_file(file: GGUFFile) -> GGUFModel:
    """The model a read GGUF holds: its Config, and the tensors that Config needs, checked."""
    path, meta, raw = file.path, file.metadata, file.tensors
    embd = raw.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        # Architecture first: a llama file should say 'unsupported architecture', not 'missing
        # tensor'.
        config_from_metadata(meta, path, 1, True)
        if embd is None:
            raise GGUFError(f"{path}: required tensor 'token_embd.weight' is missing")
        raise GGUFError(
            f"{path}: tensor 'token_embd.weight' has shape {embd.shape}, "
            "expected 2 dimensions (vocab_size, d_model)"
        )
    vocab = embd.shape[0]
    cfg = config_from_metadata(
        meta, path, vocab, tied="output.weight" not in raw, tensor_names=frozenset(raw)
    )
    n_tokens = len(meta.get("tokenizer.ggml.tokens", ()))
    if n_tokens > vocab:  # its ids past the table would be clamped by the gather, not refused
        raise GGUFError(
            f"{path}: the tokenizer has {n_tokens} tokens but 'token_embd.weight' has only {vocab} "
            f"rows (ids {vocab}..{n_tokens - 1} could not be embedded)"
        )
    tensors = {
        name: _checked_tensor(path, raw, name, want) for name, want in _iter_expected_shapes(cfg)
    }
    tensors.update(_mtp_tensors(path, raw, cfg))
    return GGUFModel(
        path=path, config=cfg, metadata=meta, tensors=tensors, file_size=file.file_size
    )


# [vocab, d] each; and shared_head_norm [d] (llama.cpp: TENSOR_NOT_REQUIRED, output_norm instead)
MTP_OPTIONAL = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")
MTP_OPTIONAL_NORM = "nextn.shared_head_norm.weight"


def _mtp_tensors(path: str, raw: dict[str, RawTensor], cfg: Config) -> dict[str, RawTensor]:
    """The MTP block's tensors after the trunk, checked, where the file has one (kept for
    speculative decoding, model/mtp.py; never run in the main pass). A file that declares
    nextn_predict_layers without the block's tensors loads without it."""
    shapes = getattr(family(cfg), "mtp_shapes", None)
    if not cfg.mtp_layers or shapes is None:
        return {}
    block = f"blk.{cfg.n_layers}."
    if block + "nextn.eh_proj.weight" not in raw:
        return {}
    optional: dict[str, tuple[int, ...]] = {
        block + n: (cfg.vocab_size, cfg.d_model) for n in MTP_OPTIONAL
    }
    optional[block + MTP_OPTIONAL_NORM] = (cfg.d_model,)
    out = {
        name: _checked_tensor(path, raw, name, want)
        for name, want in shapes(cfg).items()
        if name not in optional
    }
    for name, want in optional.items():
        if name in raw:
            out[name] = _checked_tensor(path, raw, name, want)
    return out
