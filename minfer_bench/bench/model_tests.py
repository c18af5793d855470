"""Whole-model tests as llama-bench runs them (ppN, tgN, ppN+tgM, each optionally @ dD), timed
around the engine's own executables (engine_runs.py).

pp runs the prompt in the plan's prefill chunks (the last padded to a power of two >= 16), tg is
ONE decode executable that runs all N steps on the device; with a depth D the sequence's first D
positions are filled by untimed prefill chunks first. The KV cache (positions: smallest power of
two >= D + prompt + gen, or -c) is allocated before the timer, fresh for every run; executables
are compiled once per model and reused across runs and tests. A row carries every llama-bench
field, then minfer_jax's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minfer_jax.model.cache import type_names
from minfer_jax.sizes import pow2_at_least

from minfer_bench.bench.engine_runs import time_sequence
from minfer_bench.bench.env import Env, utc_stamp
from minfer_bench.bench.fields import model_size_params, model_type, test_name
from minfer_bench.bench.parsing import BenchError


def _layer_matmul_elems(cfg) -> int:
    """Weights one token multiplies by per forward (a mixture of experts: the router, its k
    experts and the shared expert)."""
    d, kv, ff = cfg.d_model, cfg.kv_dim, cfg.d_ff
    if cfg.n_experts:
        experts = cfg.n_experts_used * cfg.d_ff_expert + cfg.d_ff_shared
        ffn = cfg.n_experts * d + 3 * experts * d
        return cfg.n_layers * (2 * cfg.q_dim * d + 2 * kv * d + ffn)
    return cfg.n_layers * (2 * d * d + 2 * kv * d + 3 * ff * d)


def decode_weight_bytes(params, cfg=None) -> int:
    """Device weight bytes one decode token reads: everything but an untied embedding table
    (only one of its rows is gathered); a tied table is read in full as the head. A mixture of
    experts (cfg given): of each expert tensor only the k chosen experts' share."""
    from minfer_jax.model.weights import params_nbytes

    total = params_nbytes(params)
    if params.output is not None:
        total -= params.embed.nbytes
    for layer in params.layers:
        if layer.moe is not None and cfg is not None:
            experts = sum(w.nbytes for w in (layer.moe.gate, layer.moe.up, layer.moe.down))
            total -= experts * (cfg.n_experts - cfg.n_experts_used) // cfg.n_experts
    return int(total)


@dataclasses.dataclass(frozen=True)
class TestSpec:
    n_prompt: int
    n_gen: int
    n_depth: int = 0  # positions already in the cache when the timed part starts (llama-bench -d)

    @property
    def name(self) -> str:
        return test_name(self.n_prompt, self.n_gen, self.n_depth)

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen


def build_tests(
    prompts: Sequence[int],
    gens: Sequence[int],
    pgs: Sequence[tuple[int, int]],
    depths: Sequence[int] = (0,),
) -> list[TestSpec]:
    """llama-bench's instance order: every pp, then every tg, then every pg (zeros skipped), per
    depth."""
    tests = []
    for d in depths:
        tests += [TestSpec(n, 0, d) for n in prompts if n > 0]
        tests += [TestSpec(0, n, d) for n in gens if n > 0]
        tests += [TestSpec(p, g, d) for p, g in pgs if p > 0 or g > 0]
    return tests


def context_for(test: TestSpec, ctx: int | None, model_ctx: int) -> int:
    """Cache length for a test: -c, else the smallest power of two >= depth + prompt + gen tokens
    (at most the model's trained context when that is enough)."""
    need = test.n_depth + test.n_tokens
    if ctx is not None:
        if need > ctx:
            raise BenchError(f"test {test.name} needs {need} tokens of context, more than -c {ctx}")
        n_ctx = ctx
    else:
        n_ctx = pow2_at_least(need) if pow2_at_least(need) <= model_ctx else need
    if n_ctx > model_ctx:
        raise BenchError(
            f"test {test.name} needs a cache of {n_ctx} tokens, more than the model's trained "
            f"context of {model_ctx}"
        )
    return n_ctx


def _llama_stdev(v: Sequence[float]) -> float:
    return float(np.std(np.asarray(v, np.float64), ddof=1)) if len(v) > 1 else 0.0


@dataclasses.dataclass
class ModelSource:
    label: str  # model_filename
    gguf: Any  # GGUFModel


class ModelBench:
    """One loaded model: compiles each executable once, times tests, yields llama-bench rows."""

    def __init__(
        self,
        model,
        source: ModelSource,
        env: Env,
        *,
        reps: int,
        ctx: int | None,
        seed: int,
        warmup: bool,
        log: Callable[[str], None],
    ):
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
        self.bytes_per_token = decode_weight_bytes(model.params, model.config)

    # -- one test ---------------------------------------------------------------------------
    def run(self, test: TestSpec) -> dict:
        """Compile, warm up, time `reps` runs and return the test's row."""
        n_ctx = context_for(test, self.ctx, self.model.config.context_length)
        test_time = utc_stamp()
        self.log(f"{test.name}: context {n_ctx}")
        samples, compile_s, plan = time_sequence(
            self.model,
            n_prompt=test.n_prompt,
            n_gen=test.n_gen,
            depth=test.n_depth,
            n_ctx=n_ctx,
            reps=self.reps,
            warmup=self.warmup,
            seed=self.seed,
            log=lambda s: self.log(f"{test.name}: {s}"),
        )
        bucket = max((b for _, b, _ in plan.chunks(test.n_prompt, test.n_depth)), default=None)
        return self._row(test, n_ctx, bucket, compile_s, samples, test_time)

    def _row(
        self,
        test: TestSpec,
        n_ctx: int,
        bucket: int | None,
        compile_s: float,
        samples: list[int],
        test_time: str,
    ) -> dict:
        """llama-bench's fields (test::get_fields(), in order), then minfer_jax's columns."""
        m, env, cfg = self.model, self.env, self.model.config
        ts = [1e9 * test.n_tokens / s for s in samples]
        avg_ns = int(sum(samples) // len(samples))
        gbps, pct, tflops = self._rates(test, avg_ns * 1e-9, cfg)
        type_k, type_v = type_names(m.cache_dtype, m.kv_types)
        return {
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
            "type_k": type_k,
            "type_v": type_v,
            "n_gpu_layers": 0 if env.is_cpu_backend else 99,
            "n_cpu_moe": 0,
            "split_mode": "none",
            "main_gpu": 0,
            "no_kv_offload": False,
            "flash_attn": m.impl.kernels != "xla",
            "devices": "auto",
            "tensor_split": "0.00",
            "tensor_buft_overrides": "none",
            "use_mmap": False,
            "embeddings": False,
            "no_op_offload": 0,
            "no_host": False,
            "n_prompt": test.n_prompt,
            "n_gen": test.n_gen,
            "n_depth": test.n_depth,
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
            "compile_s": compile_s,
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

    def _rates(
        self, test: TestSpec, avg_s: float, cfg
    ) -> tuple[float | None, float | None, float | None]:
        """(weight GB/s, % of memory bandwidth) for tg tests, matmul TFLOP/s for pp tests."""
        gbps = pct = tflops = None
        if test.n_gen and not test.n_prompt and avg_s > 0:
            gbps = self.bytes_per_token * test.n_gen / avg_s / 1e9
            if self.env.mem_bw:
                pct = 100.0 * gbps * 1e9 / self.env.mem_bw
        if test.n_prompt and not test.n_gen and avg_s > 0:
            flops = (
                2.0 * test.n_prompt * _layer_matmul_elems(cfg) + 2.0 * cfg.vocab_size * cfg.d_model
            )
            tflops = flops / avg_s / 1e12
        return gbps, pct, tflops
