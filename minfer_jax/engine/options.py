"""How a model is loaded and run: one frozen `Options`, checked in one place, and the one argparse
helper every command line (generate, serve, bench, tools/engine_check) declares its flags with.

`load(path, options)` takes it; `load(path, ctx_size=..., kernels=...)` builds it from the same
names. A name that is no field (`temprature=`) or a value of the wrong type is an
InvalidArgumentError naming it, never a TypeError from deep inside.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from minfer_jax import ops, validate
from minfer_jax.engine.plan import Plan, PlanError
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.model.cache import KVTypes
from minfer_jax.model.weights import WEIGHT_MODES
from minfer_jax.quant import kv

LOAD_WEIGHT_MODES = WEIGHT_MODES
DTYPES = ("float32", "bfloat16", "float16")
FLOAT_CACHE_TYPES = {"f32": jnp.float32, "f16": jnp.float16}
CACHE_TYPES = (*FLOAT_CACHE_TYPES, *kv.KV_TYPES)  # -ctk / -ctv, llama.cpp's spellings


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything `load` can be told, besides where the model comes from.

    ctx_size: KV cache length (None: min(4096, the trained context); more is clamped to it).
    kernels: "pallas" | "interpret" | "xla" (None: pallas on a GPU, xla elsewhere).
    weights: "quantized" keeps the GGUF formats on the device, "int8" holds block formats as int8
    with group scales (XLA decodes them inside its dot), "dense" dequantizes once to f32 (None:
    quantized with kernels, int8 on a CPU's XLA path, dense on a GPU's); dense_dtype /
    wide_dtype: the dense copy's dtypes.
    gemm: GEMM variant past 8 tokens ("auto", "f16", "dequant", "int8"; ops.Impl).
    prefill_chunk: tokens per prefill executable, a power of two (None: the platform's).
    tensor_parallel: split weights and KV cache over this many devices (None: one device).
    deterministic: a sequence gets the same tokens alone or in any batch (slower decode).
    mtp: load the file's MTP block (Qwen3.5 / 3.6) for speculative="draft-mtp" drafting.
    precise: decode GEMVs take their activations in two int8 terms (slower decode on kernels).
    fused_decode: decode's fused Pallas epilogues (off: the XLA ops, for A/B; ops.Impl).
    cache_dtype: the KV cache's dtype (None: float16 on a GPU, float32 elsewhere).
    cache_type_k / cache_type_v: "f32" | "f16" (a float cache of that dtype) | "q8_0" | "fp8"
    (8-bit, quant/kv.py, computed in cache_dtype) | None (cache_dtype); cache_format decides.
    kv_rotation: an 8-bit K (V) is stored Hadamard-rotated, as llama.cpp does (quant/kv.py); off:
    unrotated, and decode keeps its fused q/k/v epilogue (LLAMA_ATTN_ROT_DISABLE's A/B).
    progress: a progress bar while the weights load and a line while the built-in model is set up.
    """

    ctx_size: int | None = None
    kernels: str | None = None
    weights: str | None = None
    dense_dtype: str = "float32"
    wide_dtype: str = "float32"
    gemm: str = "auto"
    prefill_chunk: int | None = None
    tensor_parallel: int | None = None
    deterministic: bool = False
    precise: bool = False
    fused_decode: bool = True
    cache_dtype: Any = None
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    kv_rotation: bool = True
    progress: bool = False
    mtp: bool = False

    def __post_init__(self) -> None:
        _check(self)


def _check(o: Options) -> None:
    if o.ctx_size is not None:
        limit = validate.INT32_MAX
        validate.clamped_count(
            "ctx_size", o.ctx_size, limit, all_of="the trained context", minus_one=False
        )
        if o.ctx_size == 0:
            raise InvalidArgumentError("ctx_size must be >= 1 (or None for the default), got 0")
    if o.prefill_chunk is not None:
        try:
            Plan(ctx=1, chunk=o.prefill_chunk)  # the plan decides which chunk sizes exist
        except PlanError as e:
            raise InvalidArgumentError(
                f"prefill_chunk (tokens per prefill executable): {e}"
            ) from None
    if o.tensor_parallel is not None:
        validate.integer("tensor_parallel", o.tensor_parallel, 1, 1 << 16)
    for name in ("deterministic", "precise", "fused_decode", "kv_rotation", "progress", "mtp"):
        if not isinstance(getattr(o, name), bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {getattr(o, name)!r}")
    if o.weights is not None:
        validate.choice("weights", o.weights, LOAD_WEIGHT_MODES)
    if o.kernels is not None:
        validate.choice("kernels", o.kernels, ops.KERNELS.names)
    validate.choice("gemm", o.gemm, ops.GEMMS.names)
    for name in ("cache_type_k", "cache_type_v"):
        if getattr(o, name) is not None:
            validate.choice(name, getattr(o, name), CACHE_TYPES)
    floats = {
        FLOAT_CACHE_TYPES[t] for t in (o.cache_type_k, o.cache_type_v) if t in FLOAT_CACHE_TYPES
    }
    if o.cache_dtype is not None:
        floats.add(jnp.dtype(o.cache_dtype).type)
    if len(floats) > 1:
        raise InvalidArgumentError(
            f"cache types {o.cache_type_k!r} / {o.cache_type_v!r} (cache_dtype "
            f"{o.cache_dtype}) name different float dtypes; K and V share one"
        )
    quantized = {t for t in (o.cache_type_k, o.cache_type_v) if t in kv.KV_TYPES}
    if quantized and o.tensor_parallel is not None:
        raise InvalidArgumentError(
            f"an 8-bit KV cache ({', '.join(sorted(quantized))}) does not run tensor-parallel yet; "
            "drop -ctk/-ctv or -tp"
        )
    validate.choice("dense_dtype", o.dense_dtype, DTYPES)
    validate.choice("wide_dtype", o.wide_dtype, DTYPES)


FIELDS = tuple(f.name for f in dataclasses.fields(Options))


def unknown_keyword(name: str, known: tuple[str, ...], where: str) -> InvalidArgumentError:
    """The error for a keyword `where` does not take, with the closest known name if any."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InvalidArgumentError(
        f"{where} got an unknown keyword {name!r}{hint} (it takes {', '.join(known)})"
    )


def options_of(options: Options | None, keywords: Mapping[str, Any]) -> Options:
    """load()'s one Options: the one given, with any keywords applied over it."""
    if options is None:
        options = Options()
    elif not isinstance(options, Options):
        raise InvalidArgumentError(
            f"options must be a minfer_jax.Options, got {type(options).__name__}"
        )
    for name in keywords:
        if name not in FIELDS:
            raise unknown_keyword(name, FIELDS, "load()")
    return dataclasses.replace(options, **keywords) if keywords else options


def check_platform(o: Options, platform: str) -> None:
    if o.kernels == "pallas" and platform != "gpu":
        raise InvalidArgumentError(
            f"kernels='pallas' needs a GPU, but the device is {platform}; "
            "use kernels='interpret' (slow) or 'xla'"
        )


def cache_format(o: Options, platform: str) -> tuple[Any, KVTypes]:
    """(the float dtype of the cache or of an 8-bit cache's dequantized tiles, (K, V) 8-bit kinds
    or None): a float -ctk / -ctv, else cache_dtype, else float16 on a GPU and float32 elsewhere."""
    named = [
        FLOAT_CACHE_TYPES[t] for t in (o.cache_type_k, o.cache_type_v) if t in FLOAT_CACHE_TYPES
    ]
    dtype = (
        named[0] if named else o.cache_dtype or (jnp.float16 if platform == "gpu" else jnp.float32)
    )
    kinds = tuple(t if t in kv.KV_TYPES else None for t in (o.cache_type_k, o.cache_type_v))
    return jnp.dtype(dtype), (kinds[0], kinds[1])


def impl_for(o: Options, platform: str) -> ops.Impl:
    """The static execution choices (ops.Impl) these options mean on this platform."""
    base = ops.Impl(kernels=o.kernels) if o.kernels else ops.default_impl(platform)
    return dataclasses.replace(
        base,
        gemm=o.gemm,
        deterministic=o.deterministic,
        precise=o.precise,
        fused_decode=o.fused_decode,
    )


# -- the command lines -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The engine's flags, spelled and meant the same in every command line (the context size is
    each command's own: a prompt's, a server's slots', a benchmark test's)."""
    parser.add_argument(
        "--kernels",
        "--backend",
        dest="kernels",
        default="auto",
        choices=("auto", *ops.KERNELS.names),
        help=f"quantized matmul implementation: {ops.KERNELS.describe()}; auto = pallas on a "
        "GPU, else xla",
    )
    parser.add_argument(
        "--gemm",
        choices=ops.GEMMS.names,
        default="auto",
        help=f"GEMM variant past {ops.GEMV_MAX_NT} tokens for block formats (default auto): "
        f"{ops.GEMMS.describe()}",
    )
    parser.add_argument(
        "--weights",
        choices=LOAD_WEIGHT_MODES,
        default=None,
        help="weight storage on the device (default: quantized with kernels, int8 on a CPU's xla "
        "path, dense on a GPU's; dense: the f32 reference)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="a sequence gets the same tokens alone or batched (slower decode, most past 8 rows)",
    )
    parser.add_argument(
        "--precise",
        action="store_true",
        help="decode activations in two int8 terms instead of one (llama.cpp's): logits stay "
        "near a float64 forward's on tokens where one term drifts; slower decode on a GPU",
    )
    parser.add_argument(
        "--unfused-decode",
        dest="fused_decode",
        action="store_false",
        help="decode's q/k/v epilogue, attention merge and residual adds as XLA ops instead of "
        "the fused kernels (for A/B)",
    )
    parser.add_argument(
        "-ub",
        "--ubatch-size",
        dest="prefill_chunk",
        type=int,
        default=None,
        metavar="N",
        help="prefill chunk: tokens per prefill executable, a power of two (default: the "
        "platform's)",
    )
    for short, name, what in (("-ctk", "k", "K"), ("-ctv", "v", "V")):
        parser.add_argument(
            short,
            f"--cache-type-{name}",
            dest=f"cache_type_{name}",
            choices=CACHE_TYPES,
            default=None,
            help=f"KV cache type for {what}: f16 / f32, or 8-bit q8_0 (llama.cpp's blocks of 32) "
            "/ fp8 (e4m3, a scale per head row) (default: f16 on a GPU, f32 on a CPU)",
        )
    parser.add_argument(
        "--no-kv-rotation",
        dest="kv_rotation",
        action="store_false",
        help="store an 8-bit K / V cache unrotated (llama.cpp's LLAMA_ATTN_ROT_DISABLE; for A/B: "
        "outliers then cost accuracy)",
    )
    parser.add_argument(
        "-tp",
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split the weights and KV cache over N devices (default: one device)",
    )


def from_arguments(args: argparse.Namespace, **overrides: Any) -> Options:
    """The Options of add_arguments' flags (plus what the command decides itself: ctx_size,
    progress, ...)."""
    return Options(
        kernels=None if args.kernels == "auto" else args.kernels,
        gemm=args.gemm,
        weights=args.weights,
        deterministic=args.deterministic,
        precise=args.precise,
        fused_decode=args.fused_decode,
        prefill_chunk=args.prefill_chunk,
        tensor_parallel=args.tensor_parallel,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        kv_rotation=args.kv_rotation,
        **overrides,
    )
