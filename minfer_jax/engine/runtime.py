"""The loaded model (params on the device, tokenizer, compiled executables) and the library calls.

`load(path)` resolves the model reference, validates the GGUF, moves the weights to the device
(quantized planes on a GPU, a dense copy on a CPU: model/weights.py says why) and returns a
`Model`. The executables a plan names (plan.py) are compiled ahead of time on first use and kept
on the Model, so each compiles exactly once per process; the executable store (executables.py)
lets the next process load them instead of tracing and compiling (on a GPU, JAX's persistent
compilation cache runs beside it), and the weights cache (weights_cache.py) lets it map the
weights instead of dequantizing or repacking them. `Model.startup` holds the load's phase times.
`generate` and `generate_batch` run through the Model's scheduler (scheduler.py), the package's
one host loop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import ops, validate
from minfer_jax.engine import executables, options, weights_cache
from minfer_jax.engine import plan as plan_mod
from minfer_jax.engine.constraint import BannedTokens, TokenConstraint
from minfer_jax.engine.executables import ExecutableRecord, ExecutableStore
from minfer_jax.engine.grammar import Grammars, GrammarSpec
from minfer_jax.engine.phases import PhaseTimer
from minfer_jax.engine.plan import Plan
from minfer_jax.engine.sampling import Sampler, SamplerKeywords, sampler_of, within_context
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.engine.steps import GenerationResult
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError
from minfer_jax.model.cache import KVCache, init_cache
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import load_gguf
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.weights import LoadOptions, Params, load_params, params_nbytes

if TYPE_CHECKING:
    from minfer_jax.engine.sharding import TensorParallel
    from minfer_jax.files.tokenizer import Tokenizer

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
    from minfer_jax.files.model_source import model_cache_dir

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
    cache_dtype: object
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
    _grammars: Grammars | None = dataclasses.field(default=None, repr=False)

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
        return init_cache(self.config, n_slots, max_len or self.plan().cache_len, self.cache_dtype)

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
        )

    def executable(self, key) -> tuple[Callable, float]:
        """The executable for a plan key (plan.py): from memory, else the store, else lowered and
        compiled (then stored): (exe, seconds spent now)."""
        exe = self._compiled.get(key)
        if exe is not None:
            return exe, 0.0
        t0 = time.perf_counter()
        exe, self._records[key] = executables.obtain(self, key, self.store)
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
    *,
    ctx_size: int | None = None,
    weights: str | None = None,
    dense_dtype: str = "float32",
    wide_dtype: str = "float32",
    kernels: str | None = None,
    gemm: str = "auto",
    cache_dtype=None,
    device=None,
    progress: bool = False,
    gguf_model: GGUFModel | None = None,
    prefill_chunk: int | None = None,
    tensor_parallel: int | None = None,
    deterministic: bool = False,
    precise: bool = False,
) -> Model:
    """Load a Qwen2 GGUF (None: the built-in default model) onto the default device.

    weights: "quantized" (default with kernels) keeps GGUF formats on the device; "dense" (default
    on CPU) dequantizes once (weights.LoadOptions: dense_dtype / wide_dtype). kernels: "pallas" |
    "interpret" | "xla" (default: pallas on GPU, xla elsewhere). ctx_size: KV cache length
    (default min(4096, trained context); a larger value is clamped to the trained context, which
    Model.ctx_size then holds). gemm: GEMM
    variant past 8 tokens, "auto", "f16", "dequant" or "int8" (ops.Impl). prefill_chunk: tokens per
    prefill executable (a power of two; default plan.DEFAULT_CHUNK for the platform).
    gguf_model: an already parsed GGUFModel (e.g. synthetic). tensor_parallel: split the weights
    and the KV cache over this many devices (sharding.py; None: the one device). deterministic:
    a sequence gets the same tokens alone or in any batch (ops.Impl.deterministic; slower decode,
    most past 8 rows: docs/BENCHMARKS.md, "Batch invariance"). precise: the decode GEMVs take
    their activations in two int8 terms, not one (ops.Impl.precise): logits near a float64
    forward's where one term can be logits away; slower decode on the kernels, no effect on XLA.
    """
    timer = PhaseTimer()
    device = device or jax.devices()[0]  # the first call starts the backend (CUDA: seconds)
    timer.mark("backend")
    platform = device.platform
    options.load_arguments(
        ctx_size=ctx_size,
        weights=weights,
        kernels=kernels,
        gemm=gemm,
        prefill_chunk=prefill_chunk,
        platform=platform,
        deterministic=deterministic,
        precise=precise,
    )
    from minfer_jax.files.model_source import resolve_model
    from minfer_jax.files.tokenizer import Tokenizer

    store = ExecutableStore.in_cache_dir(enable_compilation_cache(platform))
    if gguf_model is None:
        source = resolve_model(None if path is None else os.fspath(path), progress=progress)
        timer.mark("resolve")
        gguf_model = load_gguf(source)
        timer.mark("parse")
    source = gguf_model.path
    cfg = gguf_model.config
    impl = dataclasses.replace(
        ops.Impl(kernels=kernels) if kernels else ops.default_impl(platform),
        gemm=gemm,
        deterministic=deterministic,
        precise=precise,
    )
    mode = weights or ("quantized" if impl.kernels in ("pallas", "interpret") else "dense")
    ctx = (
        min(ctx_size, cfg.context_length) if ctx_size else min(DEFAULT_CTX, cfg.context_length)
    )  # clamped, like -c
    if cache_dtype is None:
        cache_dtype = jnp.float16 if platform == "gpu" else jnp.float32
    # before the weights move: a claimed context of 2**26 must not start allocating
    validate.fits_in_memory(
        f"a KV cache of {ctx} tokens x {cfg.n_layers} layers x {cfg.n_kv_heads} KV heads x "
        f"{cfg.head_dim}",
        validate.kv_cache_bytes(
            cfg.n_layers, ctx, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cache_dtype).itemsize
        ),
        validate.memory_limit_bytes(device),
        already=gguf_model.file_size,
    )
    chunk = (
        plan_mod.DEFAULT_CHUNK.get(platform, plan_mod.DEFAULT_CHUNK["cpu"])
        if prefill_chunk is None
        else prefill_chunk
    )
    Plan(ctx=ctx, chunk=chunk)  # validates the chunk before any weight moves
    bar = None
    if progress:
        from tqdm import tqdm

        bar = functools.partial(tqdm, desc="loading weights", unit="layer", leave=False)
    opts = LoadOptions(mode=mode, dense_dtype=dense_dtype, wide_dtype=wide_dtype)
    tp = None
    timer.mark("setup")
    cached = weights_cache.entry_for(gguf_model.path, opts) if tensor_parallel is None else None
    params = cached.get(device) if cached is not None else None
    weights_from = "cache" if params is not None else "built"
    if params is None:
        if tensor_parallel is None:
            params = load_params(gguf_model, opts, device=device, progress=bar)
        else:
            from minfer_jax.engine import sharding

            tp = sharding.tensor_parallel(gguf_model, tensor_parallel)
            params = sharding.shard_params(gguf_model, tp.split, tp.mesh, opts)
    jax.block_until_ready(params)  # the transfer belongs to this phase, not to the first step
    timer.mark("params")
    saving = (
        cached.put_in_background(params) if cached is not None and weights_from == "built" else None
    )
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
        source=source,
        weight_mode=mode,
        chunk=chunk,
        tp=tp,
        store=store,
        startup=timer.phases,
        weights_from=weights_from,
        weights_saving=saving,
    )


def prompt_ids(model: Model, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    """A text prompt tokenized (with chat=True wrapped in the chat template), or token ids as
    given."""
    if not isinstance(prompt, str):
        return validate.token_ids(prompt, model.config.vocab_size, "prompt")
    validate.text("prompt", prompt)
    if model.tokenizer is None:
        raise InvalidArgumentError("this model has no tokenizer metadata: pass token ids")
    if chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return model.tokenizer.encode(text, add_special=False)
    return model.tokenizer.encode(prompt)


def _sampler(model: Model, sampler: Sampler | None, settings: SamplerKeywords) -> Sampler:
    """generate()'s one sampler: the one given, or one built from its keywords; past the context
    or the vocabulary means all of it (validate.clamped_count; README "Extreme values")."""
    if sampler is None:
        sampler = sampler_of(history_cap=model.ctx_size, vocab=model.config.vocab_size, **settings)
    elif settings:
        raise InvalidArgumentError(
            f"pass a sampler or its settings ({', '.join(settings)}), not both"
        )
    elif not isinstance(sampler, Sampler):
        raise InvalidArgumentError(
            f"sampler must be a minfer_jax.Sampler, got {type(sampler).__name__}"
        )
    return within_context(sampler, model.ctx_size, model.config.vocab_size)


def generate(
    model: Model,
    prompt: str | Sequence[int],
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 128,
    seed: int = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    decode_steps: int = plan_mod.DECODE_STEPS,
    json_schema=None,
    grammar: str | None = None,
    ignore_eos: bool = False,
    **settings: Unpack[SamplerKeywords],
) -> GenerationResult:
    """Generate from a text prompt (tokenized; with chat=True wrapped in the chat template) or token
    ids.

    sampler: how tokens are drawn (default greedy); or its fields as keywords (temperature=0.7,
    top_k=..., as sampling.sampler_of builds them). decode_steps: tokens per decode executable
    (text streams to on_text once per such chunk). max_new_tokens and repeat_last_n of -1 or past
    the context mean the context, top_k past the vocabulary the vocabulary
    (clamped, as in llama.cpp). json_schema (a dict) or grammar (GBNF text, or llguidance's Lark
    opening with %llguidance) constrain the reply (the `grammar` extra: llguidance); ignore_eos
    never samples an end-of-sequence token.
    """
    validate.generate_arguments(
        max_new_tokens=max_new_tokens, seed=seed, stop=stop, chat=chat, on_text=on_text
    )
    sampler = _sampler(model, sampler, settings)
    max_new_tokens = validate.clamped_count(
        "max_new_tokens", max_new_tokens, model.ctx_size, all_of="the context"
    )
    constraint = model.constraint(json_schema=json_schema, grammar=grammar, ignore_eos=ignore_eos)
    sched = model.scheduler(1, decode_steps=decode_steps)
    req = sched.submit(
        prompt_ids(model, prompt, chat),
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        seed=seed,
        stop=stop,
        on_text=on_text,
        constraint=constraint,
    )
    sched.run([req])
    return req.result()


def generate_batch(
    model: Model,
    prompts: Sequence[str | Sequence[int]],
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 128,
    seed: int | Sequence[int] = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    max_batch: int = plan_mod.MAX_SEQS,
    decode_steps: int = plan_mod.DECODE_STEPS,
    **settings: Unpack[SamplerKeywords],
) -> list[GenerationResult]:
    """generate() for many prompts at once, decoded together; one result per prompt, in order.

    seed: one for all prompts or one per prompt. Each sequence gets the tokens it gets alone.
    """
    prompts = list(prompts)
    if not prompts:
        return []
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise InvalidArgumentError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    validate.generate_arguments(
        max_new_tokens=max_new_tokens, seed=0, stop=stop, chat=chat, on_text=None
    )
    seeds = [validate.seed(s) for s in seeds]
    validate.integer("max_batch", max_batch, 1, plan_mod.MAX_SEQS)
    sampler = _sampler(model, sampler, settings)
    max_new_tokens = validate.clamped_count(
        "max_new_tokens", max_new_tokens, model.ctx_size, all_of="the context"
    )
    sched = model.scheduler(min(len(prompts), max_batch), decode_steps=decode_steps)
    reqs = [
        sched.submit(
            prompt_ids(model, p, chat),
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            seed=s,
            stop=stop,
        )
        for p, s in zip(prompts, seeds)
    ]
    sched.run(reqs)
    return [r.result() for r in reqs]
