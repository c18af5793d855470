"""The loaded model: params on the device, tokenizer, and one compiled executable per shape bucket.

`load(path)` resolves the model reference, validates the GGUF, moves the weights to the device
(quantized planes on a GPU, a dense copy on a CPU: model/weights.py says why) and returns a
`Model`. Executables are compiled ahead of time per (kind, bucket, cache length, sampler) and
kept on the Model, so each bucket compiles exactly once per process; JAX's persistent
compilation cache makes the next process start fast.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import engine as gen
from minfer_jax import ops, validate
from minfer_jax.errors import ContextOverflowError, InvalidArgumentError
from minfer_jax.gguf import GGUFModel, load_gguf
from minfer_jax.model.cache import KVCache, init_cache
from minfer_jax.model.config import Config
from minfer_jax.model.weights import LoadOptions, Params, load_params, params_nbytes
from minfer_jax.sampling import GREEDY, Sampler

DEFAULT_CTX = 4096
COMPILATION_CACHE_ENV = "MINFER_COMPILATION_CACHE"  # a directory, or "0"/"off" to disable


def enable_compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache (unless disabled or already configured)."""
    setting = os.environ.get(COMPILATION_CACHE_ENV, "")
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    from minfer_jax.model_source import model_cache_dir

    path = setting or os.path.join(model_cache_dir(), "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


@dataclasses.dataclass(eq=False)
class Model:
    config: Config
    params: Params
    tokenizer: object
    impl: ops.Impl
    ctx_size: int
    cache_dtype: object
    source: str
    weight_mode: str
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def weight_nbytes(self) -> int:
        return params_nbytes(self.params)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return init_cache(self.config, max_len or self.ctx_size, self.cache_dtype)

    # -- compiled executables, one per bucket -------------------------------------------------
    def _compile(self, key, fn: Callable, *args) -> tuple[Callable, float]:
        """AOT-compile fn for these argument shapes once; returns (executable, seconds spent now)."""
        exe = self._compiled.get(key)
        if exe is not None:
            return exe, 0.0
        t0 = time.perf_counter()
        exe = fn.lower(*args).compile()
        self._compiled[key] = exe
        return exe, time.perf_counter() - t0

    def _cache_spec(self, max_len: int):
        shape = (self.config.n_layers, max_len, self.config.n_kv_heads, self.config.head_dim)
        spec = jax.ShapeDtypeStruct(shape, self.cache_dtype)
        return KVCache(k=spec, v=spec)

    def prefill_executable(self, bucket: int, max_len: int, sampler: Sampler = GREEDY):
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        return self._compile(
            self.prefill_key(bucket, max_len, sampler), _prefill_jit(self.config, self.impl, sampler),
            self.params, self._cache_spec(max_len), jax.ShapeDtypeStruct((bucket,), jnp.int32), i32, i32,
            jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((sampler.history_len,), jnp.int32))

    def decode_executable(self, n_steps: int, max_len: int, sampler: Sampler = GREEDY, span: int | None = None):
        """Executable for n_steps decode steps attending over cache slots [0, span) (default: all)."""
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        span = max_len if span is None else span
        return self._compile(
            self.decode_key(n_steps, max_len, sampler, span), _decode_jit(self.config, self.impl, sampler, n_steps, span),
            self.params, self._cache_spec(max_len), i32, i32, jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((sampler.history_len,), jnp.int32))

    @staticmethod
    def prefill_key(bucket: int, max_len: int, sampler: Sampler) -> tuple:
        return ("prefill", bucket, max_len, sampler)

    @staticmethod
    def decode_key(n_steps: int, max_len: int, sampler: Sampler, span: int) -> tuple:
        return ("decode", n_steps, max_len, sampler, span)

    def is_compiled(self, key: tuple) -> bool:
        return key in self._compiled

    def logits_executable(self, bucket: int, max_len: int):
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        return self._compile(("logits", bucket, max_len), _logits_jit(self.config, self.impl),
                             self.params, self._cache_spec(max_len), jax.ShapeDtypeStruct((bucket,), jnp.int32), i32)

    # -- user-facing helpers -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of one prefill: [n, vocab] float32."""
        ids = validate.token_ids(token_ids, self.config.vocab_size)
        n = len(ids)
        if n > self.ctx_size:
            raise ContextOverflowError(f"{n} tokens do not fit in the context of {self.ctx_size} tokens")
        bucket = gen.bucket_for(n, self.ctx_size)
        tokens = np.zeros((bucket,), np.int32)
        tokens[:n] = ids
        exe, _ = self.logits_executable(bucket, bucket)
        out, _ = exe(self.params, self.new_cache(bucket), jnp.asarray(tokens), jnp.int32(0))
        return np.asarray(out[:n], np.float32)


# Jitted step functions, built once per static configuration (never per call).
@functools.cache
def _prefill_jit(cfg, impl, sampler):
    return jax.jit(functools.partial(gen.prefill_step, cfg=cfg, impl=impl, sampler=sampler), donate_argnums=(1,))


@functools.cache
def _decode_jit(cfg, impl, sampler, n_steps, span):
    return jax.jit(functools.partial(gen.decode_loop, cfg=cfg, impl=impl, sampler=sampler, n_steps=n_steps,
                                     span=span), donate_argnums=(1,))


@functools.cache
def _logits_jit(cfg, impl):
    return jax.jit(functools.partial(gen.prompt_logits, cfg=cfg, impl=impl), donate_argnums=(1,))


def load(path: str | os.PathLike | None = None, *, ctx_size: int | None = None, weights: str | None = None,
         dense_dtype: str = "float32", wide_dtype: str = "float32", kernels: str | None = None,
         gemm: str = "auto", cache_dtype=None, device=None, progress: bool = False, gguf_model: GGUFModel | None = None) -> Model:
    """Load a Qwen2 GGUF (None: the built-in default model) onto the default device.

    weights: "quantized" (default with kernels) keeps GGUF formats on the device; "dense" (default
    on CPU) dequantizes once (weights.LoadOptions: dense_dtype / wide_dtype). kernels: "pallas" |
    "interpret" | "xla" (default: pallas on GPU, xla elsewhere). ctx_size: KV cache length
    (default min(4096, trained context)). gemm: prefill variant, "auto", "f16", "dequant" or "int8" (ops.Impl).
    gguf_model: an already parsed GGUFModel (e.g. synthetic).
    """
    device = device or jax.devices()[0]
    platform = device.platform
    validate.load_arguments(ctx_size=ctx_size, weights=weights, kernels=kernels, gemm=gemm, platform=platform)
    from minfer_jax.model_source import resolve_model
    from minfer_jax.tokenizer import Tokenizer

    enable_compilation_cache()
    if gguf_model is None:
        source = resolve_model(None if path is None else os.fspath(path), progress=progress)
        gguf_model = load_gguf(source)
    source = gguf_model.path
    cfg = gguf_model.config
    impl = dataclasses.replace(ops.Impl(kernels=kernels) if kernels else ops.default_impl(platform), gemm=gemm)
    mode = weights or ("quantized" if impl.kernels in ("pallas", "interpret") else "dense")
    ctx = ctx_size or min(DEFAULT_CTX, cfg.context_length)
    if not 1 <= ctx <= cfg.context_length:
        raise ContextOverflowError(f"ctx_size {ctx} is outside 1..{cfg.context_length} (the model's trained context)")
    if cache_dtype is None:
        cache_dtype = jnp.float16 if platform == "gpu" else jnp.float32
    validate.fits_in_memory(  # before the weights move: a claimed context of 2**26 must not start allocating
        f"a KV cache of {ctx} tokens x {cfg.n_layers} layers x {cfg.n_kv_heads} KV heads x {cfg.head_dim}",
        validate.kv_cache_bytes(cfg.n_layers, ctx, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cache_dtype).itemsize),
        validate.memory_limit_bytes(device), already=gguf_model.file_size)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = functools.partial(tqdm, desc="loading weights", unit="layer", leave=False)
    opts = LoadOptions(mode=mode, dense_dtype=dense_dtype, wide_dtype=wide_dtype)
    params = load_params(gguf_model, opts, device=device, progress=bar)
    tokenizer = Tokenizer.from_model(gguf_model) if "tokenizer.ggml.tokens" in gguf_model.metadata else None
    return Model(config=cfg, params=params, tokenizer=tokenizer, impl=impl, ctx_size=ctx,
                 cache_dtype=jnp.dtype(cache_dtype), source=source, weight_mode=mode)


def generate(model: Model, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
             repeat_last_n: int = 64, seed: int = 0, stop: Sequence[str] = (), chat: bool = False,
             on_text: Callable[[str], None] | None = None, chunk: int = 16) -> gen.GenerationResult:
    """Generate from a text prompt (tokenized; with chat=True wrapped in the chat template) or token ids."""
    validate.generate_arguments(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stop, chat=chat,
        on_text=on_text, chunk=chunk)
    repeat_last_n = min(repeat_last_n, model.ctx_size)  # no more history exists: a device array that long is waste
    if isinstance(prompt, str):
        validate.text("prompt", prompt)
        if model.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer metadata: pass token ids")
        if chat:
            prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = model.tokenizer.encode(prompt, add_special=False)
        else:
            ids = model.tokenizer.encode(prompt)
    else:
        ids = validate.token_ids(prompt, model.config.vocab_size, "prompt")
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
    if sampler.greedy:  # filters are irrelevant when greedy: one executable for all greedy calls
        sampler = dataclasses.replace(GREEDY, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
    return gen.run_generation(model, ids, max_new_tokens=max_new_tokens, sampler=sampler, seed=seed,
                              stop=stop, on_text=on_text, chunk=chunk)
