"""Shared pieces of the hardening and fuzz tests: a tiny model file, example budgets, bounds.

`tiny_gguf(path, ...)` writes a one-layer Qwen2 GGUF with a placeholder byte-level vocabulary
(synthetic.placeholder_vocab) and lets a test change any metadata value or the token list.
`fuzz_settings(n)` is hypothesis' settings for a fuzz test: n derandomized examples in CI,
MINFER_FUZZ_EXAMPLES=5000 (say) for a long run. `bounded(fn)` runs fn and fails when it took
longer or allocated more (tracemalloc peak) than the bound.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
from hypothesis import HealthCheck, settings

from minfer_jax.model.config import Config
from minfer_jax.model.qwen2 import ARCHITECTURE
from tests.clock import Stopwatch
from tests.configs import tiny_config

from minfer_bench.synthetic import placeholder_vocab, synthetic_model_from_config

FUZZ_EXAMPLES_ENV = "MINFER_FUZZ_EXAMPLES"
TINY = tiny_config(
    n_layers=1, d_model=64, d_ff=128, context_length=128, rope_theta=10000.0, tied_output=True
)
KEEP = object()


def fuzz_settings(ci_examples: int, deadline_ms: int | None = 5000):
    """Decorator above @given. CI: `ci_examples` derandomized cases; $MINFER_FUZZ_EXAMPLES
    overrides the count (random seeds then). deadline_ms bounds each example on tests/clock.py's
    min(wall, CPU) instead of hypothesis' wall-clock deadline, which a loaded or swapping CI
    machine can exceed by itself (one slow example fails the test as Flaky)."""
    long_run = os.environ.get(FUZZ_EXAMPLES_ENV)
    chosen = settings(
        max_examples=int(long_run) if long_run else ci_examples,
        derandomize=not long_run,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )

    def apply(test):
        test = chosen(test)
        if deadline_ms is not None:  # hypothesis.inner_test: its hook for wrapping each example
            test.hypothesis.inner_test = _within(test.hypothesis.inner_test, deadline_ms / 1000)
        return test

    return apply


def _within(example, seconds: float):
    @functools.wraps(example)
    def timed(*args, **kwargs):
        clock = Stopwatch()
        result = example(*args, **kwargs)
        assert clock.seconds() <= seconds, f"one example took {clock} (bound {seconds} s)"
        return result

    return timed


def bounded(fn, *, seconds: float = 5.0, megabytes: float | None = 64.0, rss: bool = False):
    """fn() with its time (tests/clock.py: the wall clock or this process' CPU time, whichever is
    less) and memory peak bounded.

    Memory is the Python-heap peak from tracemalloc (numpy buffers included), or with rss=True the
    growth of the resident set sampled every 2 ms by a thread (tracemalloc makes pure-Python work
    ~7x slower, too slow for template renders); megabytes=None: time only.
    """
    sampler = _RssPeak() if rss and megabytes is not None else None
    if megabytes is not None and sampler is None:
        tracemalloc.start()
    clock = Stopwatch()
    try:
        return fn()
    finally:
        elapsed = clock.seconds()
        peak = 0
        if sampler is not None:
            peak = sampler.stop()
        elif megabytes is not None:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert elapsed <= seconds, f"took {clock} (bound {seconds} s)"
        assert megabytes is None or peak <= megabytes * 2**20, (
            f"allocated {peak / 2**20:.1f} MiB at peak (bound {megabytes} MiB)"
        )


class _RssPeak:
    """Largest growth of this process' resident set over its size at start, sampled by a thread."""

    def __init__(self) -> None:
        self._base = self._peak = _rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.002):
            self._peak = max(self._peak, _rss_bytes())

    def stop(self) -> int:
        self._peak = max(self._peak, _rss_bytes())
        self._done.set()
        self._thread.join()
        return self._peak - self._base


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tiny_gguf(
    path: str | os.PathLike,
    *,
    cfg: Config = TINY,
    tokens: list[str] | None = None,
    meta: dict | None = None,
) -> Path:
    """A valid one-layer Qwen2 GGUF (F32 weights, tied head) with a placeholder vocabulary.

    tokens: a different token list (its types all NORMAL, merges kept); meta: key -> value to add or
    replace (a Python value gguf-py can type: str, bool, int -> uint32, float -> float32, list), or
    None to drop the key.
    """
    model = _weights(cfg)
    vocab, types, merges = placeholder_vocab(cfg.vocab_size)
    if tokens is not None:
        vocab, types = tokens, [1] * len(tokens)
    values = {
        "general.name": "tiny",
        f"{ARCHITECTURE}.block_count": cfg.n_layers,
        f"{ARCHITECTURE}.context_length": cfg.context_length,
        f"{ARCHITECTURE}.embedding_length": cfg.d_model,
        f"{ARCHITECTURE}.feed_forward_length": cfg.d_ff,
        f"{ARCHITECTURE}.attention.head_count": cfg.n_heads,
        f"{ARCHITECTURE}.attention.head_count_kv": cfg.n_kv_heads,
        f"{ARCHITECTURE}.rope.freq_base": float(cfg.rope_theta),
        f"{ARCHITECTURE}.attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": cfg.vocab_size - 1,
        "tokenizer.ggml.add_bos_token": False,
    }
    values.update(meta or {})
    w = gguf.GGUFWriter(os.fspath(path), arch=ARCHITECTURE)
    for key, value in values.items():
        if value is not None:
            _add_value(w, key, value)
    for name, t in model.tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return Path(path)


@functools.cache
def _weights(cfg: Config):
    return synthetic_model_from_config(cfg, "f32", seed=0, threads=1)


def _add_value(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_uint64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def replace_config(cfg: Config = TINY, **changes) -> Config:
    return dataclasses.replace(cfg, **changes)
