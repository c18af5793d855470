"""The loaded model (params on the device, tokenizer, compiled executables) and the library calls.

`load(path)` resolves the model reference, validates the GGUF, moves the weights to the device
(quantized planes on a GPU, a dense copy on a CPU: model/weights.py says why) and returns a
`Model`. The executables a plan names (plan.py) are compiled ahead of time on first use and kept
on the Model, so each compiles exactly once per process; the executable store (executables.py)
lets the next process load them instead of tracing and compiling (on a GPU, JAX's persistent
compilation cache runs beside it), and the weights cache (weights_cache.py) lets it map the
weights instead of dequantizing or repacking them. `Model.startup` holds the load's phase times.
The library calls on a Model (generate, generate_batch) are generation.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from minfer_jax import ops, validate
from minfer_jax.engine import executables, sharding, weights_cache
from minfer_jax.engine import plan as plan_mod
from minfer_jax.engine.constraint import BannedTokens, TokenConstraint
from minfer_jax.engine.executables import ExecutableRecord, ExecutableStore
from minfer_jax.engine.grammar import Grammars, GrammarSpec
from minfer_jax.engine.options import (
    Options,
    cache_format,
    check_platform,
    impl_for,
    options_of,
)
from minfer_jax.engine.phases import PhaseTimer
from minfer_jax.engine.plan import Plan
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.engine.sharding import TensorParallel
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError
from minfer_jax.files.model_source import model_cache_dir, notice, resolve_model
from minfer_jax.files.tokenizer import Tokenizer
from minfer_jax.model.cache import (
    FLOAT_KV,
    KVCache,
    KVTypes,
    cache_nbytes,
    init_cache,
    kv_label,
)
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import load_gguf
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.mtp import load_mtp
from minfer_jax.model.weights import LoadOptions, Params, load_params, params_nbytes
from minfer_jax.quant import kv

DEFAULT_CTX = 4096
COMPILATION_CACHE_ENV = "MINFER_COMPILATION_CACHE"  # a directory, or "0"/"off" to disable


def compilation_cache_dir() -> str | None:
    """The cache directory of this load (None: off): MINFER_COMPILATION_CACHE, else a directory
    already given to JAX, else <model cache dir>/xla. JAX's cache and the executable store share
    it."""
    setting = os.environ.get(COMPILATION_CACHE_ENV, "")
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting:
        return setting
    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # no stub
    if configured:
        return configured
    return os.path.join(model_cache_dir(), "xla")


def enable_compilation_cache(platform: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache where it helps beside the executable store
    (executables.jax_cache_useful: not on a CPU) unless disabled; a directory JAX already uses
    stays (JAX reads its setting once). Returns this load's cache directory (the store's too)."""
    path = compilation_cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # no stub
    if not configured and executables.jax_cache_useful(platform or jax.default_backend()):
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


@dataclasses.dataclass(eq=False)
class Model:
    config: Config
    params: Params
    tokenizer: Tokenizer | None  # None: the file has no vocabulary (token ids in and out)
    impl: ops.Impl
    ctx_size: int
    cache_dtype: object  # the float cache's dtype, or an 8-bit one's compute dtype
    source: str
    weight_mode: str
    chunk: int = plan_mod.DEFAULT_CHUNK["cpu"]  # prefill chunk (tokens per executable)
    tp: TensorParallel | None = None  # params and cache split over its mesh; None: one device
    # None: compile every start
    store: ExecutableStore | None = dataclasses.field(default=None, repr=False)
    startup: dict = dataclasses.field(default_factory=dict)  # load phase -> seconds, in order
    weights_from: str = "built"  # "cache": mapped from the weights cache (weights_cache.py)
    # the thread writing that cache entry
    weights_saving: object = dataclasses.field(default=None, repr=False)
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)
    _compile_seconds: dict = dataclasses.field(default_factory=dict, repr=False)
    _records: dict = dataclasses.field(default_factory=dict, repr=False)  # key -> ExecutableRecord
    _scheduler: Scheduler | None = dataclasses.field(default=None, repr=False)
    options: Options = Options()  # what load() was told
    _grammars: Grammars | None = dataclasses.field(default=None, repr=False)
    kv_types: KVTypes = FLOAT_KV  # 8-bit K / V kinds (quant/kv.py), None: the float cache
    kv_rotation: bool = True  # 8-bit layers stored Hadamard-rotated (quant/kv.py)

    @property
    def grammars(self) -> Grammars:
        """The model's compiled grammars (engine/grammar.py), made on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def constraint(
        self, *, json_schema=None, grammar: str | None = None, ignore_eos: bool = False
    ) -> TokenConstraint | None:
        """A request's token constraint: a JSON Schema or a grammar (GBNF, or llguidance's Lark
        opening with %llguidance), else the end-of-sequence tokens banned (ignore_eos), else
        None. A grammar decides where the text ends, so ignore_eos does not apply to it."""
        if json_schema is not None and grammar is not None:
            raise InvalidArgumentError("pass json_schema or grammar, not both")
        if json_schema is not None:
            return self.grammars.compile(GrammarSpec.json_schema(json_schema))
        if grammar is not None:
            return self.grammars.compile(GrammarSpec.grammar(grammar))
        if ignore_eos and self.tokenizer is not None:
            return BannedTokens(self.tokenizer.eos_ids)
        return None

    @property
    def weight_nbytes(self) -> int:
        return params_nbytes(self.params)

    def new_cache(self, n_slots: int = 1, max_len: int | None = None) -> KVCache:
        if self.tp is not None:
            return self.tp.init_cache(n_slots, max_len or self.plan().cache_len, self.cache_dtype)
        max_len = max_len or self.plan().cache_len
        validate.fits_in_memory(  # -np slots of -c / -np tokens, in the cache's real bytes
            f"a KV cache of {n_slots} slots x {max_len} tokens "
            f"({kv_label(self.cache_dtype, self.kv_types)})",
            cache_nbytes(
                self.config,
                *(n_slots, max_len, self.cache_dtype, self.kv_types),
                self.kv_rotation,
                self.has_mtp,
            ),  # fmt: skip
            validate.memory_limit_bytes(executables.execution_devices(self)[0]),
            already=self.weight_nbytes,
        )
        return init_cache(
            self.config, *(n_slots, max_len, self.cache_dtype, self.kv_types),
            self.kv_rotation, self.has_mtp,
        )  # fmt: skip

    @property
    def has_mtp(self) -> bool:
        """The MTP block is loaded (load(mtp=True)): draft-mtp speculation can run."""
        return self.params.mtp is not None

    # -- the plan and its executables ------------------------------------------------------------
    def plan(
        self, n_seqs: int = 1, ctx: int | None = None, decode_steps: int = plan_mod.DECODE_STEPS
    ) -> Plan:
        return Plan(
            ctx=ctx or self.ctx_size,
            n_seqs=n_seqs,
            chunk=self.chunk,
            decode_steps=decode_steps,
            # deterministic: every row over the whole slot, whatever the batch's longest row
            spans=self.impl.kernels == "xla" and not self.impl.deterministic,
            batch_verify=not self.config.recurrent_layer_ids,  # recurrent rollback: one at a time
        )

    def executable(self, key, compile_on: Callable | None = None) -> tuple[Callable, float]:
        """The executable for a plan key (plan.py): from memory, else the store, else lowered and
        compiled (then stored): (exe, seconds spent now). compile_on(fn) runs XLA's compile
        elsewhere and returns fn's result (engine/warmup.py: on a niced thread)."""
        exe = self._compiled.get(key)
        if exe is not None:
            return exe, 0.0
        t0 = time.perf_counter()
        got = executables.prepare(self, key, self.store)
        if isinstance(got, executables.Lowered):
            got = got.compile() if compile_on is None else compile_on(got.compile)
        exe, self._records[key] = got
        self._compiled[key] = exe
        dt = self._compile_seconds[key] = time.perf_counter() - t0
        return exe, dt

    def in_store(self, key) -> bool:
        """Whether the executable store holds this key (a first use loads it instead of
        compiling)."""
        return self.store is not None and self.store.holds(self, key)

    def executable_record(self, key) -> ExecutableRecord | None:
        """Where this executable came from (store / compiled) and its lower/compile/load seconds."""
        return self._records.get(key)

    @property
    def executable_records(self) -> list[ExecutableRecord]:
        """Every executable obtained so far, in order: its source and seconds."""
        return list(self._records.values())

    @property
    def compile_stats(self) -> dict:
        """Executables obtained so far: how many came from the store / were compiled, and the
        seconds."""
        recs = list(self._records.values())
        return dict(
            store=sum(r.source == "store" for r in recs),
            compiled=sum(r.source == "compiled" for r in recs),
            jax_cache=sum(r.source == "jax-cache" for r in recs),
            lower_s=sum(r.lower_s for r in recs),
            compile_s=sum(r.compile_s for r in recs),
            load_s=sum(r.load_s for r in recs),
            save_s=sum(r.save_s for r in recs),
        )

    def compile_seconds(self, key) -> float:
        """What compiling this executable cost when it was compiled (0 if it was not)."""
        return self._compile_seconds.get(key, 0.0)

    def is_compiled(self, key) -> bool:
        return key in self._compiled

    def compiled_keys(self) -> tuple:
        """The keys compiled so far (a snapshot: safe while another thread compiles)."""
        return tuple(self._compiled)

    def scheduler(
        self, n_seqs: int = 1, ctx: int | None = None, decode_steps: int = plan_mod.DECODE_STEPS
    ) -> Scheduler:
        """The model's host loop for this plan (one at a time: a new plan frees the last one's
        cache)."""
        plan = self.plan(n_seqs, ctx, decode_steps)
        s = self._scheduler
        if s is None or s.model is not self or s.plan != plan or s.busy:
            self._scheduler = None  # drop the old KV cache before allocating the next
            s = self._scheduler = Scheduler(self, plan)
        return s

    # -- user-facing helpers -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer metadata: pass token ids")
        return self.tokenizer.encode(text)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of one prompt, run in prefill chunks: [n, vocab] float32."""
        ids = validate.token_ids(token_ids, self.config.vocab_size)
        if len(ids) > self.ctx_size:
            raise ContextOverflowError(
                f"{len(ids)} tokens do not fit in the context of {self.ctx_size} tokens"
            )
        plan = self.plan()
        cache, out = self.new_cache(1, plan.cache_len), []
        for start, bucket, n_valid in plan.chunks(len(ids)):
            exe, _ = self.executable(plan.logits_key(bucket))
            tokens = np.zeros((bucket,), np.int32)
            tokens[:n_valid] = ids[start : start + n_valid]
            logits, cache = exe(self.params, cache, tokens, np.int32(0), np.int32(start))
            out.append(np.asarray(logits[:n_valid], np.float32))
        return np.concatenate(out)


def load(
    path: str | os.PathLike | None = None,
    options: Options | None = None,
    *,
    device: jax.Device | None = None,
    gguf_model: GGUFModel | None = None,
    **keywords: Any,
) -> Model:
    """Load a GGUF model of a supported family (None: the built-in default model) onto a device.

    options: how (engine/options.Options: ctx_size, kernels, weights, gemm, prefill_chunk,
    tensor_parallel, deterministic, precise, ...); its fields are accepted as keywords too, over
    `options` (`load(path, ctx_size=512)`). device: default the first device. gguf_model: an
    already parsed GGUFModel (e.g. a synthetic one) instead of a path.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"path must be a str or os.PathLike (a GGUF file, 'default' or hf:<repo>:<file>), "
            f"got {type(path).__name__}"
        )
    if gguf_model is not None and not isinstance(gguf_model, GGUFModel):
        raise InvalidArgumentError(
            f"gguf_model must be a GGUFModel, got {type(gguf_model).__name__}"
        )
    opts = options_of(options, keywords)
    timer = PhaseTimer()
    device = device or jax.devices()[0]  # the first call starts the backend (CUDA: seconds)
    timer.mark("backend")
    check_platform(opts, device.platform)
    store = ExecutableStore.in_cache_dir(enable_compilation_cache(device.platform))
    if gguf_model is None:
        source = resolve_model(None if path is None else os.fspath(path), progress=opts.progress)
        timer.mark("resolve")
        gguf_model = load_gguf(source)
        timer.mark("parse")
    if gguf_model.config.recurrent_layers and device.platform == "cpu":
        # jax 0.10.2's CPU client crashed (segfault) serializing a hybrid model's executables in
        # the test suite (2026-12-07): compile those each start instead of storing them
        store = None
    return _assemble(gguf_model, opts, device, timer, store)


def _context(
    opts: Options, cfg: Config, cache_dtype, kv_types: KVTypes, file_size: int, device
) -> int:
    """The KV cache length of this load (clamped to the trained context, like -c), refused before
    any weight moves when it cannot fit: a claimed context of 2**26 must not start allocating."""
    ctx = min(opts.ctx_size or DEFAULT_CTX, cfg.context_length)
    validate.fits_in_memory(
        f"a KV cache of {ctx} tokens x {len(cfg.attention_layers)} layers x {cfg.n_kv_heads} KV "
        f"heads x {cfg.head_dim} ({kv_label(cache_dtype, kv_types)})",
        cache_nbytes(cfg, 1, ctx, cache_dtype, kv_types),
        validate.memory_limit_bytes(device),
        already=file_size,
    )
    return ctx


def _params(gguf_model: GGUFModel, opts: Options, weight_opts: LoadOptions, device):
    """(params on the device, their TensorParallel or None, "cache" | "built", the cache write)."""
    bar = None
    if opts.progress:
        bar = functools.partial(tqdm, desc="loading weights", unit="layer", leave=False)
    if opts.tensor_parallel is not None:
        tp = sharding.tensor_parallel(gguf_model, opts.tensor_parallel)
        params = sharding.shard_params(gguf_model, tp.split, tp.mesh, weight_opts)
        return jax.block_until_ready(params), tp, "built", None
    cached = weights_cache.entry_for(gguf_model.path, weight_opts)
    mapped = cached.get(device) if cached is not None else None
    if mapped is not None:
        return jax.block_until_ready(mapped), None, "cache", None
    if cached is not None:  # a miss the cache will keep: the next load maps it instead
        notice(f"converting the weights for {device.platform} (kept in the weights cache)")
    params = load_params(gguf_model, weight_opts, device=device, progress=bar)
    jax.block_until_ready(params)  # the transfer belongs to this phase, not to the first step
    saving = cached.put_in_background(params) if cached is not None else None
    return params, None, "built", saving


def default_weight_mode(impl: ops.Impl, platform: str) -> str:
    """The kernels read quantized planes; on a CPU the XLA path reads int8 vocabulary matrices
    (quant/int8_form.py) beside the dense f32 layers; a GPU's XLA path keeps the dense f32 copy."""
    if impl.kernels in ("pallas", "interpret"):
        return "quantized"
    return "int8" if platform == "cpu" else "dense"


def _assemble(gguf_model: GGUFModel, opts: Options, device, timer: PhaseTimer, store) -> Model:
    cfg, platform = gguf_model.config, device.platform
    impl = impl_for(opts, platform)
    mode = opts.weights or default_weight_mode(impl, platform)
    cache_dtype, kv_types = cache_format(opts, platform)
    for kind in kv_types:
        if kind is not None:
            kv.check_kind(kind, cfg.head_dim)
    ctx = _context(opts, cfg, cache_dtype, kv_types, gguf_model.file_size, device)
    default_chunk = plan_mod.DEFAULT_CHUNK.get(platform, plan_mod.DEFAULT_CHUNK["cpu"])
    chunk = default_chunk if opts.prefill_chunk is None else opts.prefill_chunk
    Plan(ctx=ctx, chunk=chunk)  # validates the chunk before any weight moves
    weight_opts = LoadOptions(mode=mode, dense_dtype=opts.dense_dtype, wide_dtype=opts.wide_dtype)
    timer.mark("setup")
    params, tp, weights_from, saving = _params(gguf_model, opts, weight_opts, device)
    if opts.mtp:  # after the weights cache's copy, which holds the trunk only
        params = dataclasses.replace(params, mtp=load_mtp(gguf_model, weight_opts, device))
    timer.mark("params")
    tokenizer = (
        Tokenizer.from_model(gguf_model) if "tokenizer.ggml.tokens" in gguf_model.metadata else None
    )
    timer.mark("tokenizer")
    return Model(
        config=cfg,
        params=params,
        tokenizer=tokenizer,
        impl=impl,
        ctx_size=ctx,
        cache_dtype=jnp.dtype(cache_dtype),
        kv_types=kv_types,
        kv_rotation=opts.kv_rotation,
        source=gguf_model.path,
        weight_mode=mode,
        chunk=chunk,
        tp=tp,
        store=store,
        startup=timer.phases,
        weights_from=weights_from,
        weights_saving=saving,
        options=opts,
    )
