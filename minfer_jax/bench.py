"""Benchmarks with llama-bench's tests, fields and table layout, plus per-shape kernel timings.

`python scripts/bench.py` (this module's `main`) has two modes:

Model mode (the default) mirrors llama.cpp's tools/llama-bench/llama-bench.cpp:
  ppN      prefill of N tokens into an empty cache; t/s = N / time
  tgN      N single-token decode steps from an empty cache (the first token at position 0);
           t/s = N / time
  ppN+tgM  (-pg N,M) prefill N, then decode M, timed together; t/s = (N + M) / time
  Each test runs once untimed (warm-up; --no-warmup skips it), then -r times; a row reports
  avg +- sample stdev of the per-run t/s (llama-bench's avg_ts / stddev_ts) and of the run
  times in ns (avg_ns / stddev_ns). csv/json/jsonl carry every llama-bench field under its
  name (test::get_fields()), then minfer_jax's own columns.
  Timing is taken around compiled executables only: pp is ONE prefill executable of the
  prompt's bucket (a power of two >= 16; a prompt of another length is padded and reported
  with its real N), tg is ONE decode executable that runs all N steps on the device. The KV
  cache (length: smallest power of two >= prompt + gen, or -c) is allocated before the timer,
  fresh for every run; executables are compiled once and reused across runs and tests.

Kernel mode (--kernels, --shapes, --ggml-shapes) times every distinct (type, out, in) matmul
a model runs (q/k/v and gate/up fused as loaded), or an explicit list, for a list of token
counts nt, through ops.matmul's dispatch (GEMV for nt <= ops.GEMV_MAX_NT, GEMM above, or the
XLA reference), each case inside one executable; on a GPU the time is the executable's span on the device timeline (jax.profiler),
not the host clock (kernel_bench.run_case says why).

Beyond llama-bench every row has: the compile time of the executable(s) it ran, achieved weight
GB/s (tg: weight bytes read per decode token / time per token) and its share of the device's
memory bandwidth, peak device memory, the backend and the JAX version.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

import numpy as np

from minfer_jax.errors import MinferError

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

GEMM_CHOICES = ("auto", "f16", "dequant", "int8")  # ops.GEMM_VARIANTS, spelled out: --help stays jax-free

# Measured memory read bandwidth per device kind (bytes/s), matched as a substring of
# jax's device_kind. H200: ../shared/PERF_TARGETS.md (jnp.sum over 1 GiB f32: 4.15 - 4.28 TB/s).
MEM_BW_TABLE: dict[str, float] = {"H200": 4.2e12}

# ggml's CUDA MUL_MAT times on the H200 (PERF_TARGETS.md, test-backend-ops perf -o MUL_MAT, f32
# activations): (type, out, in) -> {nt: microseconds}. --ggml-shapes runs exactly these cases.
GGML_REFERENCE_US: dict[tuple[str, int, int], dict[int, float]] = {
    ("Q4_0", 4096, 14336): {1: 14.6, 8: 32.7, 512: 307.0},
    ("Q5_0", 4096, 14336): {1: 17.6},
    ("Q8_0", 4096, 14336): {1: 23.2, 512: 311.0},
    ("Q4_K", 4096, 14336): {1: 15.7, 8: 46.5, 512: 347.0},
    ("Q6_K", 4096, 14336): {1: 24.1, 512: 423.0},
    ("Q4_K", 4096, 4096): {1: 7.3},
    ("Q4_K", 14336, 4096): {1: 19.6},
}

# llama-bench's test::get_fields(), in order (ggml-org/llama.cpp tools/llama-bench/llama-bench.cpp).
LLAMA_BENCH_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode",
    "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "use_mmap", "embeddings", "no_op_offload",
    "no_host", "n_prompt", "n_gen", "n_depth", "test_time",
    "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
# test::get_field_type(): everything else is a STRING.
_INT_FIELDS = {"build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params",
               "n_gpu_layers", "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns",
               "no_op_offload", "n_cpu_moe"}
_BOOL_FIELDS = {"no_kv_offload", "cpu_strict", "flash_attn", "use_mmap", "embeddings", "no_host"}
_FLOAT_FIELDS = {"avg_ts", "stddev_ts"}

# minfer_jax's columns, appended after llama-bench's (None = not applicable -> "" / null / n/a).
MODEL_EXTRA_FIELDS = [
    "test", "jax_version", "device", "kernels", "weight_mode", "n_ctx", "bucket", "compile_s",
    "weight_bytes_per_token", "weight_gbps", "mem_bw_gbps", "pct_mem_bw", "matmul_tflops",
    "peak_mem_bytes", "command",
]
MODEL_FIELDS = LLAMA_BENCH_FIELDS + MODEL_EXTRA_FIELDS

KERNEL_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "jax_version", "device",
    "model_filename", "qtype", "n_out", "n_in", "nt", "kernel", "impl", "tensors", "count",
    "weight_bytes", "reps", "test_time", "avg_us", "stddev_us", "best_us", "gbps", "mem_bw_gbps",
    "pct_mem_bw", "tflops", "rel_err", "compile_s", "ggml_us", "speedup_vs_ggml", "command",
]

# The weight matrices of one Qwen2 layer, in the order a token meets them, then the head.
_ROLE_ORDER = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"]

OUTPUT_FORMATS = ("md", "csv", "json", "jsonl")


class BenchError(MinferError, ValueError):
    """Bad benchmark input (flags, shapes, sizes): reported as one line, exit status 2."""


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?(?:,|$)")


def parse_int_range(s: str, what: str = "value") -> list[int]:
    """llama-bench's parse_int_range: comma list of first[-last[(+|*)step]], e.g. '128,512' or '16-2048*2'."""
    out: list[int] = []
    rest = str(s).strip()
    if not rest:
        raise BenchError(f"{what}: empty list")
    while rest:
        m = _RANGE_RE.match(rest)
        if not m:
            raise BenchError(f"{what}: cannot parse {s!r} (expected e.g. 512 or 128,512 or 16-2048*2)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op = m.group(3) or "+"
        step = int(m.group(4)) if m.group(4) is not None else 1
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(f"{what}: invalid range {m.group(0).rstrip(',')!r} (it does not advance)")
            i = nxt
        rest = rest[m.end():]
    return out


def parse_pg(s: str) -> tuple[int, int]:
    """-pg 'N,M' (llama-bench: exactly two integers)."""
    parts = str(s).split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise BenchError(f"-pg: expected '<prompt>,<gen>' such as 512,128, got {s!r}")
    return int(parts[0]), int(parts[1])


def _qtype(name: str):
    from minfer_jax.quant.planes import FORMATS, QType

    key = name.strip().upper()
    try:
        qt = QType[key]
    except KeyError:
        raise BenchError(f"unknown weight type {name!r}; supported: {', '.join(q.name.lower() for q in FORMATS)}") from None
    if qt not in FORMATS:
        raise BenchError(f"weight type {qt.name} has no device layout; supported: "
                         f"{', '.join(q.name.lower() for q in FORMATS)}")
    return qt


def parse_shapes(s: str) -> list[tuple[Any, int, int]]:
    """'q4_k:4096x14336,q8_0:4096x14336' (type:OUTxIN) -> [(QType, out, in), ...]."""
    from minfer_jax.quant.planes import get_format

    out = []
    for item in str(s).split(","):
        item = item.strip()
        m = re.fullmatch(r"([A-Za-z0-9_]+):(\d+)[xX](\d+)", item)
        if not m:
            raise BenchError(f"--shapes: cannot parse {item!r} (expected TYPE:OUTxIN such as q4_k:4096x14336)")
        qt, n, k = _qtype(m.group(1)), int(m.group(2)), int(m.group(3))
        block = get_format(qt).block
        if n <= 0 or k <= 0:
            raise BenchError(f"--shapes: {item!r}: sizes must be positive")
        if k % block:
            raise BenchError(f"--shapes: {item!r}: in={k} is not a multiple of {qt.name}'s block of {block}")
        out.append((qt, n, k))
    return out


def pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def test_name(n_prompt: int, n_gen: int) -> str:
    """llama-bench's markdown test label."""
    if n_prompt > 0 and n_gen == 0:
        return f"pp{n_prompt}"
    if n_gen > 0 and n_prompt == 0:
        return f"tg{n_gen}"
    return f"pp{n_prompt}+tg{n_gen}"


# --------------------------------------------------------------------------------------------
# Environment: device, bandwidth, build
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Env:
    platform: str  # "gpu" | "cpu" | ...
    device_kind: str  # "NVIDIA H200", "cpu"
    backend: str  # llama-bench's "backends" column: JAX-CUDA / JAX-CPU
    gpu_info: str
    cpu_info: str
    jax_version: str
    build_commit: str
    build_number: int
    n_threads: int
    mem_bw: float | None = None  # bytes/s
    mem_bw_source: str = "n/a"
    command: str = ""
    device: Any = None

    @property
    def is_cpu_backend(self) -> bool:
        return "CPU" in self.backend

    @property
    def device_label(self) -> str:
        return f"{self.device_kind} ({self.platform})"

    def peak_mem(self) -> int | None:
        try:
            stats = self.device.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            return None
        if not stats:
            return None
        v = stats.get("peak_bytes_in_use")
        return int(v) if v is not None else None


def _cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_build() -> tuple[str, int]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        count = subprocess.run(["git", "-C", here, "rev-list", "--count", "HEAD"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()
        return commit or "unknown", int(count or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown", 0


def measure_mem_bw(device=None, nbytes: int | None = None, trials: int = 5) -> float:
    """Read bandwidth (bytes/s): best of `trials` jitted jnp.sum over one large f32 array."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    if nbytes is None:
        nbytes = (1 << 30) if device.platform == "gpu" else (256 << 20)
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best


def make_env(mem_bw: str = "auto", command: str = "") -> Env:
    import jax

    dev = jax.devices()[0]
    plat = dev.platform
    kind = str(getattr(dev, "device_kind", plat))
    if plat == "gpu":
        ver = str(getattr(dev.client, "platform_version", "") or "").lower()
        backend = "JAX-ROCm" if "rocm" in ver else "JAX-CUDA"
    else:
        backend = f"JAX-{plat.upper()}"
    commit, number = _git_build()
    env = Env(platform=plat, device_kind=kind, backend=backend, gpu_info=kind if plat == "gpu" else "",
              cpu_info=_cpu_info(), jax_version=jax.__version__, build_commit=commit, build_number=number,
              n_threads=os.cpu_count() or 1, command=command, device=dev)
    setting = str(mem_bw).strip().lower()
    if setting in ("none", "off", "n/a", "na"):
        env.mem_bw, env.mem_bw_source = None, "n/a"
    elif setting == "auto":
        hit = next((k for k in MEM_BW_TABLE if k.lower() in kind.lower()), None)
        if hit:
            env.mem_bw, env.mem_bw_source = MEM_BW_TABLE[hit], f"table ({hit})"
        else:
            env.mem_bw = None
            env.mem_bw_source = "measure"  # filled in lazily by ensure_mem_bw()
    elif setting == "measure":
        env.mem_bw, env.mem_bw_source = None, "measure"
    else:
        try:
            gbps = float(setting)
        except ValueError:
            raise BenchError(f"--mem-bw: expected auto, measure, none or a number of GB/s, got {mem_bw!r}") from None
        if not gbps > 0:
            raise BenchError(f"--mem-bw: must be > 0 GB/s, got {mem_bw!r}")
        env.mem_bw, env.mem_bw_source = gbps * 1e9, "given"
    return env


def ensure_mem_bw(env: Env) -> None:
    if env.mem_bw is None and env.mem_bw_source == "measure":
        env.mem_bw = measure_mem_bw(env.device)
        env.mem_bw_source = "measured: jnp.sum"


def header_line(env: Env, mode: str, impl: str) -> str:
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    import jax

    bw = "n/a" if env.mem_bw is None else f"{env.mem_bw / 1e9:.0f} GB/s ({env.mem_bw_source})"
    cache = "on" if jax.config.jax_compilation_cache_dir else "off"
    return (f"minfer_jax bench ({mode}) | {now} | device: {env.device_label}, {env.backend} | "
            f"jax {env.jax_version} | kernels: {impl} | mem bw: {bw} | compile cache: {cache} | "
            f"build: {env.build_commit} ({env.build_number}) | cmd: {env.command}")


# --------------------------------------------------------------------------------------------
# Model description (llama_model_desc, llama_model_size, llama_model_n_params)
# --------------------------------------------------------------------------------------------

# llama_ftype_name() for the file types minfer_jax can hold (src/llama-model-loader.cpp).
_FTYPE_NAMES = {
    0: "all F32", 1: "F16", 32: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q5_0", 9: "Q5_1", 7: "Q8_0",
    10: "Q2_K - Medium", 21: "Q2_K - Small", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
}
_FTYPE_GUESSED = 1024


def _qwen2_type_name(cfg) -> str:
    """llm_type_name(type) as llama_model_qwen2::load_arch_hparams picks it (by layer count).

    Note llama.cpp calls Qwen2.5-0.5B (24 layers, n_embd 896 != 1024) '1B'.
    """
    n = cfg.n_layers
    if n == 24:
        return "0.5B" if cfg.d_model == 1024 else "1B"
    if n == 28:
        return "1.5B" if cfg.d_model == 1536 else "7B"
    if n == 40:
        return "4B" if cfg.n_heads == 20 else "13B"
    return {32: "7B", 36: "3B", 48: "14B", 64: "32B", 80: "70B"}.get(n, "?B")


def model_type(gmodel) -> str:
    """llama_model_desc(): '<arch> <size> <ftype name>', e.g. 'qwen2 7B Q4_K - Medium'."""
    arch = gmodel.metadata.get("general.architecture", "qwen2")
    ft = gmodel.metadata.get("general.file_type")
    if ft is None:
        name = "unknown, may not work"
    else:
        ft = int(ft)
        base = _FTYPE_NAMES.get(ft & ~_FTYPE_GUESSED, "unknown, may not work")
        name = base + (" (guessed)" if ft & _FTYPE_GUESSED else "")
    return f"{arch} {_qwen2_type_name(gmodel.config)} {name}"


def model_size_params(gmodel) -> tuple[int, int]:
    """(llama_model_size, llama_model_n_params): tensor bytes and elements over all tensors."""
    size = sum(t.nbytes for t in gmodel.tensors.values())
    n_params = sum(int(math.prod(t.shape)) for t in gmodel.tensors.values())
    return int(size), int(n_params)


def _layer_matmul_elems(cfg) -> int:
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.d_ff
    return cfg.n_layers * (2 * d * d + 2 * kv * d + 3 * ff * d)


def decode_weight_bytes(params) -> int:
    """Device weight bytes one decode token reads: everything but an untied embedding table
    (only one of its rows is gathered); a tied table is read in full as the head."""
    from minfer_jax.model.weights import params_nbytes

    total = params_nbytes(params)
    if params.output is not None:
        total -= params.embed.nbytes
    return int(total)


# --------------------------------------------------------------------------------------------
# Model benchmark
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TestSpec:
    n_prompt: int
    n_gen: int

    @property
    def name(self) -> str:
        return test_name(self.n_prompt, self.n_gen)

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen


def build_tests(prompts: Sequence[int], gens: Sequence[int], pgs: Sequence[tuple[int, int]]) -> list[TestSpec]:
    """llama-bench's instance order: every pp, then every tg, then every pg (zeros skipped)."""
    tests = [TestSpec(n, 0) for n in prompts if n > 0]
    tests += [TestSpec(0, n) for n in gens if n > 0]
    tests += [TestSpec(p, g) for p, g in pgs if p > 0 or g > 0]
    return tests


def context_for(test: TestSpec, ctx: int | None, model_ctx: int) -> int:
    """Cache length for a test: -c, else the smallest power of two >= prompt + gen tokens."""
    need = test.n_tokens
    if ctx is not None:
        if need > ctx:
            raise BenchError(f"test {test.name} needs {need} tokens of context, more than -c {ctx}")
        n_ctx = ctx
    else:
        n_ctx = pow2ceil(need)
    if n_ctx > model_ctx:
        raise BenchError(f"test {test.name} needs a cache of {n_ctx} tokens, more than the model's trained "
                         f"context of {model_ctx}")
    return n_ctx


def _llama_stdev(v: Sequence[float]) -> float:
    return float(np.std(np.asarray(v, np.float64), ddof=1)) if len(v) > 1 else 0.0


@dataclasses.dataclass
class ModelSource:
    label: str  # model_filename
    gguf: Any  # GGUFModel


class ModelBench:
    """One loaded model: compiles each executable once, times tests, yields llama-bench rows."""

    def __init__(self, model, source: ModelSource, env: Env, *, reps: int, ctx: int | None, seed: int,
                 warmup: bool, log: Callable[[str], None]):
        self.model = model
        self.source = source
        self.env = env
        self.reps = reps
        self.ctx = ctx
        self.seed = seed
        self.warmup = warmup
        self.log = log
        self.compile_s: dict[tuple, float] = {}
        self.size, self.n_params = model_size_params(source.gguf)
        self.mtype = model_type(source.gguf)
        self.bytes_per_token = decode_weight_bytes(model.params)

    # -- executables ------------------------------------------------------------------------
    def _exe(self, kind: str, size: int, n_ctx: int):
        from minfer_jax.sampling import GREEDY

        key = (kind, size, n_ctx)
        if key not in self.compile_s:
            self.log(f"compiling {kind} {'bucket' if kind == 'prefill' else 'steps'}={size} ctx={n_ctx} ...")
        if kind == "prefill":
            exe, dt = self.model.prefill_executable(size, n_ctx, GREEDY)
        else:
            exe, dt = self.model.decode_executable(size, n_ctx, GREEDY)
        if key not in self.compile_s:
            self.compile_s[key] = dt
            self.log(f"  compiled in {dt:.2f} s")
        return exe, self.compile_s[key]

    # -- one test ---------------------------------------------------------------------------
    def run(self, test: TestSpec) -> dict:
        import jax

        from minfer_jax.engine import bucket_for

        m = self.model
        cfg = m.config
        n_ctx = context_for(test, self.ctx, cfg.context_length)
        test_time = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        rng = np.random.default_rng(self.seed)
        dev = self.env.device
        put = lambda a: jax.device_put(a, dev)

        compile_total = 0.0
        bucket = None
        pre = dec = None
        if test.n_prompt:
            bucket = bucket_for(test.n_prompt, n_ctx)
            pre, dt = self._exe("prefill", bucket, n_ctx)
            compile_total += dt
            tokens = np.zeros((bucket,), np.int32)
            tokens[:test.n_prompt] = rng.integers(0, cfg.vocab_size, test.n_prompt)
            tokens_d = put(tokens)
            n_valid_d = put(np.int32(test.n_prompt))
        if test.n_gen:
            dec, dt = self._exe("decode", test.n_gen, n_ctx)
            compile_total += dt
            first_tok_d = put(np.int32(rng.integers(0, cfg.vocab_size)))
            gen_pos_d = put(np.int32(test.n_prompt))
        zero_d = put(np.int32(0))
        key_d = put(np.asarray(jax.random.PRNGKey(self.seed)))
        hist_d = put(np.zeros((0,), np.int32))
        params = m.params

        def fresh_cache():
            return jax.block_until_ready(m.new_cache(n_ctx))

        def once() -> int:
            cache = fresh_cache()
            t0 = time.perf_counter_ns()
            if pre is not None:
                tok, _, cache = pre(params, cache, tokens_d, zero_d, n_valid_d, key_d, hist_d)
                if dec is not None:
                    out = dec(params, cache, tok, gen_pos_d, key_d, hist_d)
                else:
                    out = (tok, cache)
            else:
                out = dec(params, cache, first_tok_d, zero_d, key_d, hist_d)
            jax.block_until_ready(out)
            dt = time.perf_counter_ns() - t0
            del out
            return dt

        if self.warmup:
            self.log(f"{test.name}: warm-up run")
            once()
        samples = []
        for i in range(self.reps):
            samples.append(once())
            self.log(f"{test.name}: run {i + 1}/{self.reps}: {samples[-1] / 1e6:.3f} ms")

        ts = [1e9 * test.n_tokens / s for s in samples]
        avg_ns = int(sum(samples) // len(samples))
        avg_s = avg_ns * 1e-9
        gbps = pct = tflops = None
        if test.n_gen and not test.n_prompt and avg_s > 0:
            gbps = self.bytes_per_token * test.n_gen / avg_s / 1e9
            if self.env.mem_bw:
                pct = 100.0 * gbps * 1e9 / self.env.mem_bw
        if test.n_prompt and not test.n_gen and avg_s > 0:
            flops = 2.0 * test.n_prompt * _layer_matmul_elems(cfg) + 2.0 * cfg.vocab_size * cfg.d_model
            tflops = flops / avg_s / 1e12
        env = self.env
        row = {
            "build_commit": env.build_commit,
            "build_number": env.build_number,
            "cpu_info": env.cpu_info,
            "gpu_info": env.gpu_info,
            "backends": env.backend,
            "model_filename": self.source.label,
            "model_type": self.mtype,
            "model_size": self.size,
            "model_n_params": self.n_params,
            "n_batch": bucket or 1,
            "n_ubatch": bucket or 1,
            "n_threads": env.n_threads,
            "cpu_mask": "0x0",
            "cpu_strict": False,
            "poll": 50,
            "type_k": np.dtype(m.cache_dtype).name.replace("float", "f"),
            "type_v": np.dtype(m.cache_dtype).name.replace("float", "f"),
            "n_gpu_layers": 0 if env.is_cpu_backend else 99,
            "n_cpu_moe": 0,
            "split_mode": "none",
            "main_gpu": 0,
            "no_kv_offload": False,
            "flash_attn": False,
            "devices": "auto",
            "tensor_split": "0.00",
            "tensor_buft_overrides": "none",
            "use_mmap": False,
            "embeddings": False,
            "no_op_offload": 0,
            "no_host": False,
            "n_prompt": test.n_prompt,
            "n_gen": test.n_gen,
            "n_depth": 0,
            "test_time": test_time,
            "avg_ns": avg_ns,
            "stddev_ns": int(_llama_stdev(samples)),
            "avg_ts": float(np.mean(ts)),
            "stddev_ts": _llama_stdev(ts),
            # minfer_jax's own columns
            "test": test.name,
            "jax_version": env.jax_version,
            "device": env.device_label,
            "kernels": m.impl.kernels,
            "weight_mode": m.weight_mode,
            "n_ctx": n_ctx,
            "bucket": bucket,
            "compile_s": compile_total,
            "weight_bytes_per_token": self.bytes_per_token,
            "weight_gbps": gbps,
            "mem_bw_gbps": None if env.mem_bw is None else env.mem_bw / 1e9,
            "pct_mem_bw": pct,
            "matmul_tflops": tflops,
            "peak_mem_bytes": env.peak_mem(),
            "command": env.command,
            "samples_ns": samples,
            "samples_ts": ts,
        }
        return row


# --------------------------------------------------------------------------------------------
# Kernel benchmark
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KernelCase:
    qtype: Any  # QType
    n: int  # out
    k: int  # in
    nts: tuple[int, ...]
    tensors: str = ""  # roles, e.g. "ffn_down x22, ffn_down x6"
    count: int | None = None  # calls per decode token in the model
    source: str = ""


def _role(name: str, tied: bool) -> str | None:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "output" if tied else None  # a tied table is the head's matrix
    m = re.match(r"blk\.\d+\.(\w+)\.weight$", name)
    if m and m.group(1) in _ROLE_ORDER:
        return m.group(1)
    return None


_FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # row-stacked by the loader


def model_matmul_cases(tensor_types: dict[str, Any], shapes: dict[str, tuple], tied: bool, nts: Sequence[int],
                       source: str) -> list[KernelCase]:
    """Distinct (type, out, in) of the matmuls a model runs, with the tensors behind each:
    neighbouring q/k/v and gate/up projections of one format are one matmul, as the loader stores
    them (model.weights.fused_runs), e.g. "attn_q+attn_k" [d + kv, d] when v has another format."""
    from minfer_jax.model.weights import fused_runs
    from minfer_jax.quant.planes import QType

    groups: dict[tuple, collections.Counter] = {}

    def add(qtype, n: int, k: int, role: str):
        groups.setdefault((QType(qtype), int(n), int(k)), collections.Counter())[role] += 1

    stacked: dict[int, dict[str, str]] = collections.defaultdict(dict)  # layer -> role -> tensor name
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue
        role = _role(name, tied)
        if role is None:
            continue
        layer = re.match(r"blk\.(\d+)\.", name)
        if layer and any(role in g for g in _FUSED_GROUPS):
            stacked[int(layer.group(1))][role] = name
        else:
            add(tensor_types[name], shape[0], shape[1], role)
    for names in stacked.values():
        for group in _FUSED_GROUPS:
            roles = [r for r in group if r in names]
            members = [names[r] for r in roles]
            for run in fused_runs([tensor_types[m] for m in members]):
                add(tensor_types[members[run[0]]], sum(shapes[members[i]][0] for i in run), shapes[members[run[0]]][1],
                    "+".join(roles[i] for i in run))

    def rank(role: str) -> int:
        return _ROLE_ORDER.index(role.split("+")[0])

    def order(item):
        (qt, n, k), roles = item
        return (min(rank(r) for r in roles), qt.name, n, k)

    cases = []
    for (qt, n, k), roles in sorted(groups.items(), key=order):
        label = ", ".join(f"{r} x{c}" if c > 1 else r for r, c in sorted(roles.items(), key=lambda rc: rank(rc[0])))
        cases.append(KernelCase(qt, n, k, tuple(nts), tensors=label, count=sum(roles.values()), source=source))
    return cases


def ggml_cases(nts: Sequence[int] | None) -> list[KernelCase]:
    from minfer_jax.quant.planes import QType

    return [KernelCase(QType[q], n, k, tuple(nts) if nts else tuple(sorted(ref)), source="ggml (PERF_TARGETS.md)")
            for (q, n, k), ref in GGML_REFERENCE_US.items()]


def auto_kernel_reps(wbytes: int, env: Env, impl: str) -> int:
    """Calls per timed executable: 40, fewer when the weight copies would not fit a budget."""
    if impl == "interpret":
        return 2
    budget = (16 << 30) if env.platform == "gpu" else (1 << 30)
    return int(max(2, min(40, budget // max(wbytes, 1))))


def _report_failure(what: str, e: Exception) -> None:
    """One stderr line for a test/case that failed while the run goes on."""
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"bench.py: {what} failed: {type(e).__name__}: {first}"[:2000], file=sys.stderr)


def run_kernel_case(case: KernelCase, nt: int, env: Env, *, impl: str, trials: int, reps: int | None,
                    warmup: bool, seed: int, gemm: str = "auto") -> dict:
    from minfer_jax import kernel_bench as kb

    wbytes = kb.weight_nbytes(case.qtype, case.n, case.k)
    nreps = reps or auto_kernel_reps(wbytes, env, impl)
    test_time = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res = kb.run_case(case.qtype, case.n, case.k, nt, kb.dispatch_matmul(case.qtype, case.n, case.k, impl, gemm),
                      kb.reference_matmul(case.qtype, case.n, nt, impl, gemm), impl=impl, reps=nreps, trials=trials, seed=seed,
                      warmup=warmup)
    kind = kb.kernel_kind(nt, impl, case.qtype, gemm)
    avg = res.avg_us
    gbps = wbytes / avg / 1e3 if avg > 0 else None
    pct = 100.0 * gbps * 1e9 / env.mem_bw if (gbps and env.mem_bw) else None
    ggml = GGML_REFERENCE_US.get((case.qtype.name, case.n, case.k), {}).get(nt)
    return {
        "build_commit": env.build_commit, "build_number": env.build_number, "cpu_info": env.cpu_info,
        "gpu_info": env.gpu_info, "backends": env.backend, "jax_version": env.jax_version,
        "device": env.device_label, "model_filename": case.source, "qtype": case.qtype.name, "n_out": case.n,
        "n_in": case.k, "nt": nt, "kernel": kind, "impl": impl, "tensors": case.tensors, "count": case.count,
        "weight_bytes": wbytes, "reps": nreps, "test_time": test_time, "avg_us": avg, "stddev_us": res.stddev_us,
        "best_us": res.us, "gbps": gbps, "mem_bw_gbps": None if env.mem_bw is None else env.mem_bw / 1e9,
        "pct_mem_bw": pct, "tflops": 2.0 * nt * case.n * case.k / avg / 1e6 if avg > 0 else None,
        "rel_err": res.rel_err, "compile_s": res.compile_s, "ggml_us": ggml,
        "speedup_vs_ggml": (ggml / avg) if (ggml and avg > 0) else None, "command": env.command,
        "samples_us": res.samples_us,
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def _fmt_bytes_llama(n: int) -> str:
    if n < 1024 ** 3:
        return f"{n / 1024 / 1024:.2f} MiB"
    return f"{n / 1024 ** 3:.2f} GiB"


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def _na(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def _fmt_mem(v) -> str:
    return "n/a" if v is None else _fmt_bytes_llama(int(v))


@dataclasses.dataclass
class Column:
    title: str
    width: int  # llama-bench convention: negative = left-aligned
    value: Callable[[dict], str]


def model_md_columns(env: Env) -> list[Column]:
    """llama-bench's markdown fields (model, size, params, backend, ngl | threads, test, t/s), then ours."""
    cols = [
        Column("model", -30, lambda r: r["model_type"]),
        Column("size", 10, lambda r: _fmt_bytes_llama(r["model_size"])),
        Column("params", 10, lambda r: _fmt_params(r["model_n_params"])),
        Column("backend", -10, lambda r: r["backends"]),
    ]
    if not env.is_cpu_backend:
        cols.append(Column("ngl", 3, lambda r: str(r["n_gpu_layers"])))
    else:
        cols.append(Column("threads", 7, lambda r: str(r["n_threads"])))
    cols += [
        Column("test", 15, lambda r: r["test"]),
        Column("t/s", 20, lambda r: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"),
        Column("ctx", 6, lambda r: str(r["n_ctx"])),
        Column("bucket", 6, lambda r: "-" if r["bucket"] is None else str(r["bucket"])),
        Column("compile s", 9, lambda r: f"{r['compile_s']:.2f}"),
        Column("GB/s", 8, lambda r: _na(r["weight_gbps"], ".1f") if r["n_gen"] and not r["n_prompt"] else "-"),
        Column("% bw", 6, lambda r: _na(r["pct_mem_bw"], ".1f") if r["n_gen"] and not r["n_prompt"] else "-"),
        Column("TFLOP/s", 8, lambda r: _na(r["matmul_tflops"], ".2f") if r["n_prompt"] and not r["n_gen"] else "-"),
        Column("peak mem", 10, lambda r: _fmt_mem(r["peak_mem_bytes"])),
    ]
    return cols


def kernel_md_columns(env: Env) -> list[Column]:
    gemv = lambda r: r["kernel"] in ("gemv", "xla") and r["nt"] <= _gemv_max_nt()
    return [
        Column("type", -5, lambda r: r["qtype"]),
        Column("out x in", 13, lambda r: f"{r['n_out']} x {r['n_in']}"),
        Column("nt", 5, lambda r: str(r["nt"])),
        Column("kernel", -7, lambda r: r["kernel"]),
        Column("tensors", -24, lambda r: r["tensors"] or "-"),
        Column("us", 18, lambda r: f"{r['avg_us']:.2f} ± {r['stddev_us']:.2f}"),
        Column("best us", 9, lambda r: f"{r['best_us']:.2f}"),
        Column("GB/s", 8, lambda r: _na(r["gbps"], ".1f") if gemv(r) else "-"),
        Column("% bw", 6, lambda r: _na(r["pct_mem_bw"], ".1f") if gemv(r) else "-"),
        Column("TFLOP/s", 8, lambda r: _na(r["tflops"], ".2f")),
        Column("rel err", 8, lambda r: _na(r["rel_err"], ".1e")),
        Column("compile s", 9, lambda r: f"{r['compile_s']:.2f}"),
        Column("ggml us", 8, lambda r: _na(r["ggml_us"], ".1f")),
        Column("vs ggml", 8, lambda r: "-" if r["speedup_vs_ggml"] is None else f"{r['speedup_vs_ggml']:.2f}x"),
    ]


def _gemv_max_nt() -> int:
    from minfer_jax import ops

    return ops.GEMV_MAX_NT


def _csv_value(field: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"  # std::to_string(bool)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:f}" if field in _FLOAT_FIELDS else repr(v)
    if isinstance(v, (list, tuple)):
        return ";".join(str(x) for x in v)
    return str(v)


def _json_value(field: str, v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if field in _BOOL_FIELDS:
        return bool(v)
    if field in _INT_FIELDS and v is not None:
        return int(v)
    if field in _FLOAT_FIELDS and v is not None:
        return float(v)
    return v


class Printer:
    """Writes one output format to one stream, row by row (as llama-bench's printers do)."""

    def __init__(self, fmt: str, fh: TextIO, fields: list[str], columns: list[Column], header: str | None,
                 samples: tuple[str, ...], footer: str | None):
        self.fmt, self.fh, self.fields, self.columns = fmt, fh, fields, columns
        self.header, self.samples, self.footer_text = header, samples, footer
        self.first = True

    def _w(self, s: str) -> None:
        self.fh.write(s)
        self.fh.flush()

    def start(self) -> None:
        if self.fmt == "md":
            if self.header:
                self._w(self.header + "\n\n")
            self._w("|" + "".join(f" {c.title:{'<' if c.width < 0 else '>'}{abs(c.width)}} |" for c in self.columns) + "\n")
            self._w("|" + "".join(f" {'-' * (abs(c.width) - 1)}{':' if c.width > 0 else '-'} |" for c in self.columns) + "\n")
        elif self.fmt == "csv":
            self._w(",".join(self.fields) + "\n")
        elif self.fmt == "json":
            self._w("[\n")

    def row(self, r: dict) -> None:
        if self.fmt == "md":
            self._w("|" + "".join(f" {c.value(r):{'<' if c.width < 0 else '>'}{abs(c.width)}} |" for c in self.columns) + "\n")
        elif self.fmt == "csv":
            vals = [_csv_value(f, r.get(f)) for f in self.fields]
            self._w(",".join('"' + v.replace('"', '""') + '"' for v in vals) + "\n")
        else:
            obj = {f: _json_value(f, r.get(f)) for f in self.fields}
            for s in self.samples:
                obj[s] = r.get(s, [])
            if self.fmt == "jsonl":
                self._w(json.dumps(obj, ensure_ascii=False) + "\n")
            else:
                text = json.dumps(obj, indent=2, ensure_ascii=False).replace("\n", "\n  ")
                self._w(("" if self.first else ",\n") + "  " + text)
        self.first = False

    def finish(self) -> None:
        if self.fmt == "md" and self.footer_text:
            self._w("\n" + self.footer_text + "\n")
        elif self.fmt == "json":
            self._w("\n]\n")


def _format_for_path(path: str, default: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return {"md": "md", "markdown": "md", "csv": "csv", "json": "json", "jsonl": "jsonl"}.get(ext, default)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bench.py",
        description="minfer_jax benchmark: llama-bench compatible model tests (ppN, tgN, ppN+tgM) and "
                    "per-shape kernel timings (--kernels). Timing is taken around compiled executables after "
                    "a warm-up run; see minfer_jax/bench.py for the exact definitions.",
        epilog="Multiple values can be given as comma lists or ranges (first-last, first-last+step, "
               "first-last*mult), as in llama-bench. Examples:\n"
               "  bench.py -m model.gguf -p 512 -n 128 -r 5\n"
               "  bench.py --synthetic qwen2.5-7b:q4_k_m -p 512 -n 128 -o md --out rows.json\n"
               "  bench.py --synthetic qwen2.5-0.5b:q4_k_m --write-gguf /tmp/s.gguf\n"
               "  bench.py --ggml-shapes\n"
               "  bench.py --kernels --synthetic qwen2.5-7b:q4_k_m --nt 1,512\n"
               "  bench.py --shapes q4_k:4096x14336,q8_0:4096x14336 --nt 1,8,512",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", action="append", default=[], metavar="FILE",
                   help="GGUF model path (or 'default', or hf:<repo>:<file>); comma list or repeated")
    g.add_argument("--synthetic", action="append", default=[], metavar="SPEC",
                   help="in-memory random-weight model '<config>:<ftype>' (configs: qwen2.5-0.5b, -1.5b, -3b, -7b, "
                        "-14b; ftypes: q4_k_m, q4_0, q8_0, q6_k, ...); comma list or repeated")
    g.add_argument("--layers", type=int, default=None, metavar="N",
                   help="synthetic models only: override the layer count (quick runs)")
    g.add_argument("--seed", type=int, default=0, help="seed of synthetic weights, random token ids and kernel inputs (default: 0)")
    g.add_argument("--write-gguf", default=None, metavar="PATH",
                   help="write the (single) synthetic model as a GGUF file for llama.cpp, then exit; "
                        "with -p/-n/-pg given explicitly, also run the benchmark")
    g = p.add_argument_group("tests (llama-bench)")
    g.add_argument("-p", "--n-prompt", action="append", default=None, metavar="N",
                   help="prompt sizes for ppN tests (default: 512)")
    g.add_argument("-n", "--n-gen", action="append", default=None, metavar="N",
                   help="generation lengths for tgN tests (default: 128)")
    g.add_argument("-pg", action="append", default=[], metavar="PP,TG",
                   help="prefill PP tokens then generate TG, timed together: test 'ppPP+tgTG', t/s = (PP+TG) / time; "
                        "repeat the flag for several pairs")
    g.add_argument("-r", "--repetitions", type=int, default=5, metavar="N",
                   help="timed runs per test (kernel mode: timed trials per case) (default: 5)")
    g.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="KV cache length for every test (default: smallest power of two >= prompt + gen)")
    g.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each test/case")
    g = p.add_argument_group("execution")
    g.add_argument("--kernel-impl", choices=("pallas", "interpret", "xla"), default=None,
                   help="matmul implementation: pallas (Triton kernels, GPU), interpret (the same kernels in "
                        "Pallas' interpreter: very slow, tiny shapes only) or xla (reference dequant + dot). "
                        "Default: pallas on GPU, xla elsewhere")
    g.add_argument("--gemm", choices=GEMM_CHOICES, default="auto",
                   help="prefill variant for block formats: auto (default: dequant from "
                        "ops.DEQUANT_MIN_NT tokens, else f16), f16 (weight tiles decoded inside the GEMM), "
                        "dequant (weights decoded into a transient f16 matrix, then a float GEMM) or int8 "
                        "(int8 activations x int8 quants; slower on the H200)")
    g.add_argument("--weights", choices=("quantized", "dense"), default=None,
                   help="model mode: weight storage on the device (default: quantized for pallas/interpret, dense "
                        "for xla, as minfer_jax.load)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="disable JAX's persistent compilation cache (compile times then always mean a fresh compile)")
    g.add_argument("--mem-bw", default="auto", metavar="auto|measure|none|GBPS",
                   help="device memory bandwidth for '%% bw': auto = table (H200: 4200 GB/s) else measured with a "
                        "jitted jnp.sum over a large f32 array; or a number in GB/s; or none (default: auto)")
    g = p.add_argument_group("kernel mode")
    g.add_argument("--kernels", action="store_true",
                   help="time each distinct (type, out, in) matmul the model(s) run (fused q/k/v and gate/up as "
                        "loaded) instead of whole-model tests")
    g.add_argument("--shapes", default=None, metavar="LIST",
                   help="explicit kernel cases TYPE:OUTxIN, comma separated, e.g. q4_k:4096x14336,q8_0:4096x14336")
    g.add_argument("--ggml-shapes", action="store_true",
                   help="the cases of PERF_TARGETS.md's ggml table (Q4_0/Q5_0/Q8_0/Q4_K/Q6_K 4096x14336, Q4_K "
                        "4096x4096 and 14336x4096; nt 1, and 8/512 where ggml lists them), with ggml's times")
    g.add_argument("--nt", default=None, metavar="LIST",
                   help="token counts per kernel case (default: 1,512; --ggml-shapes: ggml's own)")
    g.add_argument("--kernel-reps", type=int, default=None, metavar="N",
                   help="matmul calls unrolled in one timed executable, each on its own weight copy; per-call "
                        "time = the executable's span on the device timeline / N (default: up to 40, "
                        "fewer for big matrices)")
    g = p.add_argument_group("output")
    g.add_argument("-o", "--output", choices=OUTPUT_FORMATS, default="md",
                   help="format printed to stdout (default: md)")
    g.add_argument("--out", action="append", default=[], metavar="FILE",
                   help="also write to FILE; format from its extension (.md .csv .json .jsonl), else -o; repeatable")
    g.add_argument("--progress", action="store_true", help="print progress (compiles, runs) to stderr")
    return p


def _split_list(values: Iterable[str]) -> list[str]:
    return [x.strip() for v in values for x in str(v).split(",") if x.strip()]


def _int_lists(values: list[str] | None, default: list[int], what: str) -> list[int]:
    if values is None:
        return list(default)
    out: list[int] = []
    for v in values:
        out += parse_int_range(v, what)
    return out


def _load_source(kind: str, ref: str, layers: int | None, seed: int, progress: bool) -> ModelSource:
    if kind == "synthetic":
        from minfer_jax.synthetic import synthetic_model

        gm = synthetic_model(ref, seed=seed, layers=layers)
        return ModelSource(gm.path, gm)
    from minfer_jax.gguf import load_gguf
    from minfer_jax.model_source import resolve_model

    path = resolve_model(ref, progress=progress)
    return ModelSource(ref, load_gguf(path))


def _synthetic_shapes(spec: str, layers: int | None):
    """(types, shapes, tied, label) of a synthetic model without generating its weights."""
    import dataclasses as dc

    from minfer_jax.gguf import expected_shapes
    from minfer_jax.synthetic import (
        SYNTHETIC_CONFIGS,
        SyntheticSpecError,
        parse_spec,
        tensor_types,
    )

    cfg_name, ftype = parse_spec(spec)
    cfg = SYNTHETIC_CONFIGS[cfg_name]
    if layers is not None:
        if layers <= 0:
            raise SyntheticSpecError(f"layers must be a positive int, got {layers!r}")
        cfg = dc.replace(cfg, n_layers=layers)
    label = f"synthetic:{cfg_name}:{ftype}" + (f":layers={layers}" if layers is not None else "")
    return tensor_types(cfg, ftype), expected_shapes(cfg), cfg.tied_output, label


def _validate(args) -> None:
    if args.repetitions < 1:
        raise BenchError(f"-r must be >= 1, got {args.repetitions}")
    if args.ctx_size is not None and args.ctx_size < 1:
        raise BenchError(f"-c must be >= 1, got {args.ctx_size}")
    if args.layers is not None and args.layers < 1:
        raise BenchError(f"--layers must be >= 1, got {args.layers}")
    if args.layers is not None and not args.synthetic:
        raise BenchError("--layers applies to --synthetic models only")
    if args.kernel_reps is not None and args.kernel_reps < 1:
        raise BenchError(f"--kernel-reps must be >= 1, got {args.kernel_reps}")
    if args.write_gguf and len(_split_list(args.synthetic)) != 1:
        raise BenchError("--write-gguf needs exactly one --synthetic model")


def _default_impl() -> str:
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "xla"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BenchError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    except MinferError as e:  # unknown synthetic spec, missing/broken model, context overflow
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"bench.py: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    models = _split_list(args.model)
    synths = _split_list(args.synthetic)
    shapes = parse_shapes(args.shapes) if args.shapes else []
    kernel_mode = args.kernels or bool(shapes) or args.ggml_shapes
    nts = parse_int_range(args.nt, "--nt") if args.nt else None
    if nts is not None and any(n < 1 for n in nts):
        raise BenchError("--nt values must be >= 1")
    prompts = _int_lists(args.n_prompt, [512], "-p")
    gens = _int_lists(args.n_gen, [128], "-n")
    pgs = [parse_pg(s) for s in args.pg]
    explicit_tests = args.n_prompt is not None or args.n_gen is not None or bool(args.pg)
    log = (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True)) if args.progress else (lambda s: None)

    # Resolve inputs cheaply before anything heavy (every bad input fails here with exit 2).
    from minfer_jax.synthetic import parse_spec

    for s in synths:
        parse_spec(s)
    for m in models:
        if m.strip() not in ("default",) and not m.startswith("hf:") and not os.path.exists(m):
            raise BenchError(f"model file not found: {m}")
    if args.write_gguf and kernel_mode:
        raise BenchError("--write-gguf cannot be combined with kernel mode")
    if kernel_mode:
        if args.kernels and not (models or synths or shapes or args.ggml_shapes):
            raise BenchError("--kernels needs -m MODEL, --synthetic SPEC, --shapes LIST or --ggml-shapes")
    elif not (models or synths):
        raise BenchError("give -m MODEL or --synthetic SPEC (or --kernels/--shapes/--ggml-shapes for kernel mode)")
    tests = build_tests(prompts, gens, pgs)
    if not kernel_mode and not tests and not args.write_gguf:
        raise BenchError("no tests: every -p/-n/-pg value is 0")
    if not kernel_mode:
        from minfer_jax.synthetic import SYNTHETIC_CONFIGS

        limits = [SYNTHETIC_CONFIGS[parse_spec(s)[0]].context_length for s in synths] or [1 << 62]
        for t in tests:  # N > context -> exit 2 before loading anything (files: checked after reading them)
            context_for(t, args.ctx_size, min(limits))

    if args.no_compile_cache:
        from minfer_jax.runtime import COMPILATION_CACHE_ENV

        os.environ[COMPILATION_CACHE_ENV] = "off"

    impl = args.kernel_impl or _default_impl()
    import jax

    if impl == "pallas" and jax.default_backend() != "gpu":
        raise BenchError(f"--kernel-impl pallas needs a GPU (backend here: {jax.default_backend()}); "
                         "use interpret or xla")
    command = " ".join(shlex.quote(a) for a in ["scripts/bench.py", *argv])

    preloaded: dict[tuple[str, str], ModelSource] = {}
    if args.write_gguf:
        from minfer_jax.synthetic import write_gguf

        src = _load_source("synthetic", synths[0], args.layers, args.seed, args.progress)
        preloaded[("synthetic", synths[0])] = src
        write_gguf(src.gguf, args.write_gguf, progress=args.progress)
        size = os.path.getsize(args.write_gguf)
        print(f"wrote {src.label} ({model_type(src.gguf)}) to {args.write_gguf} ({size} bytes)", file=sys.stderr)
        if not explicit_tests:
            return 0

    env = make_env(args.mem_bw, command)
    mode = "kernels" if kernel_mode else "model"

    # ---- kernel mode -----------------------------------------------------------------------
    if kernel_mode:
        cases: list[KernelCase] = []
        default_nts = nts or [1, 512]
        if args.ggml_shapes:
            cases += ggml_cases(nts)
        for qt, n, k in shapes:
            cases.append(KernelCase(qt, n, k, tuple(default_nts), source="--shapes"))
        for s in synths:
            types, shp, tied, label = _synthetic_shapes(s, args.layers)
            cases += model_matmul_cases(types, shp, tied, default_nts, label)
        for m in models:
            from minfer_jax.gguf import load_gguf
            from minfer_jax.model_source import resolve_model

            gm = load_gguf(resolve_model(m, progress=args.progress))
            cases += model_matmul_cases({n: t.qtype for n, t in gm.tensors.items()},
                                        {n: t.shape for n, t in gm.tensors.items()}, gm.config.tied_output,
                                        default_nts, m)
        if any(nt <= _gemv_max_nt() for c in cases for nt in c.nts):
            ensure_mem_bw(env)
        printers, files = _printers(args, env, KERNEL_FIELDS, kernel_md_columns(env), ("samples_us",),
                                    header_line(env, mode, impl),
                                    footer=f"build: {env.build_commit} ({env.build_number})")
        failed = 0
        try:
            for case in cases:
                for nt in case.nts:
                    log(f"kernel {case.qtype.name} {case.n}x{case.k} nt={nt} ({impl})")
                    try:
                        row = run_kernel_case(case, nt, env, impl=impl, gemm=args.gemm, trials=args.repetitions,
                                              reps=args.kernel_reps, warmup=not args.no_warmup, seed=args.seed)
                    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                        failed += 1
                        _report_failure(f"case {case.qtype.name}:{case.n}x{case.k} nt={nt}", e)
                        continue
                    for pr in printers:
                        pr.row(row)
        finally:
            for pr in printers:
                pr.finish()
            for fh in files:
                fh.close()
        return 1 if failed else 0

    # ---- model mode ------------------------------------------------------------------------
    from minfer_jax.runtime import load

    sources = [("model", m) for m in models] + [("synthetic", s) for s in synths]
    if any(t.n_gen and not t.n_prompt for t in tests):
        ensure_mem_bw(env)
    printers, files = None, []
    failed = 0
    try:
        for kind, ref in sources:
            log(f"loading {ref}")
            t0 = time.perf_counter()
            src = preloaded.pop((kind, ref), None) or _load_source(
                kind, ref, args.layers if kind == "synthetic" else None, args.seed, args.progress)
            cfg = src.gguf.config
            ctxs = [context_for(t, args.ctx_size, cfg.context_length) for t in tests]
            model = load(gguf_model=src.gguf, ctx_size=max(ctxs), kernels=impl, weights=args.weights,
                         gemm=args.gemm, device=env.device, progress=args.progress)
            log(f"loaded {src.label} in {time.perf_counter() - t0:.1f} s: {model.weight_mode} weights, "
                f"{model.weight_nbytes / 1e9:.3f} GB on the device")
            if printers is None:
                printers, files = _printers(args, env, MODEL_FIELDS, model_md_columns(env), ("samples_ns", "samples_ts"),
                                            header_line(env, mode, impl),
                                            footer=f"build: {env.build_commit} ({env.build_number})")
            mb = ModelBench(model, src, env, reps=args.repetitions, ctx=args.ctx_size, seed=args.seed,
                            warmup=not args.no_warmup, log=log)
            for t in tests:
                try:
                    row = mb.run(t)
                except BenchError:
                    raise
                except Exception as e:  # noqa: BLE001 - report, keep going with the other tests
                    failed += 1
                    _report_failure(f"test {t.name} on {src.label}", e)
                    continue
                for pr in printers:
                    pr.row(row)
            del model, mb
    finally:
        for pr in printers or []:
            pr.finish()
        for fh in files:
            fh.close()
    return 1 if failed else 0


def _printers(args, env: Env, fields: list[str], columns: list[Column], samples: tuple[str, ...], header: str,
              footer: str | None = None) -> tuple[list[Printer], list[TextIO]]:
    printers = []
    files = []
    if args.output != "md":
        print(header, file=sys.stderr)  # csv/json stay machine-readable; the same facts are in every row
    printers.append(Printer(args.output, sys.stdout, fields, columns, header, samples, footer))
    for path in args.out:
        fmt = _format_for_path(path, args.output)
        try:
            fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller after the last row
        except OSError as e:
            raise BenchError(f"cannot write --out {path}: {e.strerror or e}") from None
        files.append(fh)
        printers.append(Printer(fmt, fh, fields, columns, header, samples, footer))
    for pr in printers:
        pr.start()
    return printers, files


if __name__ == "__main__":
    sys.exit(main())
