"""Start-up: phases reported, the executable store (a warm store compiles nothing; a changed program
misses), the weights cache (a restart maps bit-identical weights), and bench.py --startup.

Every test points the caches at its own tmp_path, so no test shares state with another (JAX's own
persistent cache keeps the directory the process first gave it; the store does not depend on it).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine import executables, weights_cache
from minfer_jax.engine.phases import PhaseTimer, format_executable, format_phase
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config, write_gguf

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
PROMPT = [5, 17, 42, 99, 7]
# jax._src.dispatch.BACKEND_COMPILE_EVENT
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"  # jax._src.dispatch.JAXPR_TRACE_EVENT


@pytest.fixture(scope="module")
def tiny_gguf():
    return synthetic_model_from_config(TINY, "q8_0", seed=3)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MINFER_COMPILATION_CACHE", str(tmp_path / "xla"))
    monkeypatch.setenv("MINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))
    return tmp_path


def load(gm=None, path=None, **kw):
    return minfer_jax.load(
        path,
        gguf_model=gm,
        kernels="xla",
        weights="quantized",
        ctx_size=256,
        prefill_chunk=16,
        **kw,
    )


def run(model):
    """One greedy generation; returns its tokens and the keys it used."""
    out = minfer_jax.generate(model, PROMPT, max_new_tokens=20)
    return out.tokens, list(model._compiled)


class JaxEvents:
    """Counts JAX's own trace and backend-compile events (a persistent-cache hit is still one)."""

    def __init__(self):
        self.counts = {BACKEND_COMPILE: 0, TRACE: 0}

    def __call__(self, event, duration, **kwargs):
        if event in self.counts:
            self.counts[event] += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_event_names_exist_in_this_jax():
    """The counter below watches the right events: a fresh jit records both."""
    with JaxEvents() as ev:
        jax.jit(lambda x: x * 3 + 1).lower(np.float32(2)).compile()
    assert ev.counts[BACKEND_COMPILE] >= 1 and ev.counts[TRACE] >= 1


def test_load_reports_phases(caches, tiny_gguf, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)
    m = load(path=path)
    assert list(m.startup) == ["backend", "resolve", "parse", "setup", "params", "tokenizer"]
    assert all(isinstance(s, float) and s >= 0 for s in m.startup.values())
    m2 = load(tiny_gguf)  # parsed already: load() does not resolve or parse
    assert "parse" not in m2.startup and {"backend", "params", "tokenizer"} <= set(m2.startup)
    run(m2)
    recs = m2.executable_records
    assert [r.label for r in recs] == ["prefill [16] greedy", "decode [16] greedy"]
    for r in recs:
        assert (
            r.source == "compiled"
            and r.lower_s > 0
            and r.compile_s > 0
            and r.load_s >= 0
            and r.save_s >= 0
        )
        assert format_executable(r).startswith(f"startup: executable {r.label} (compiled: lower ")
    assert format_phase("parse", 1.234) == "startup: parse 1.23 s"


def test_phase_timer_adds_repeated_phases():
    t = PhaseTimer()
    t.mark("a")
    t.mark("b")
    t.mark("a")
    assert list(t.phases) == ["a", "b"] and all(v >= 0 for v in t.phases.values())


def test_warm_store_compiles_nothing(caches, tiny_gguf):
    cold = load(tiny_gguf)
    tokens, keys = run(cold)
    assert cold.compile_stats["compiled"] == len(keys) == 2 and cold.compile_stats["store"] == 0
    warm = load(tiny_gguf)  # a restart: a new Model, nothing in memory
    assert all(warm.in_store(k) for k in keys)
    with JaxEvents() as ev:
        for k in keys:
            warm.executable(k)
    assert ev.counts == {BACKEND_COMPILE: 0, TRACE: 0}  # JAX neither traced nor compiled anything
    st = warm.compile_stats
    assert st["compiled"] == 0 and st["store"] == 2 and st["lower_s"] == st["compile_s"] == 0
    assert all(warm.executable_record(k).source == "store" for k in keys)
    assert run(warm)[0] == tokens  # the loaded executables compute what the compiled ones did


def test_code_change_misses(caches, tiny_gguf, monkeypatch):
    _, keys = run(load(tiny_gguf))
    monkeypatch.setattr(executables, "source_hash", lambda: "another version of the package")
    m = load(tiny_gguf)
    assert not any(m.in_store(k) for k in keys)
    run(m)
    assert m.compile_stats["compiled"] == 2 and m.compile_stats["store"] == 0


def test_config_change_misses(caches, tiny_gguf):
    """A program constant (RoPE base) changes the program but no shape: the store must miss."""
    tokens, keys = run(load(tiny_gguf))
    other = synthetic_model_from_config(dataclasses.replace(TINY, rope_theta=1e4), "q8_0", seed=3)
    m = load(other)
    assert not any(m.in_store(k) for k in keys)
    run(m)
    assert m.compile_stats["compiled"] == 2


def test_fingerprint_covers_flags_impl_and_params(caches, tiny_gguf, monkeypatch):
    m = load(tiny_gguf)
    key = m.plan().logits_key(16)
    base = executables.fingerprint(m, key)
    assert executables.fingerprint(m, key) == base  # deterministic
    assert executables.fingerprint(m, m.plan().logits_key(32)) != base
    assert (
        executables.fingerprint(
            dataclasses.replace(m, impl=dataclasses.replace(m.impl, gemm="int8")), key
        )
        != base
    )
    assert (
        executables.fingerprint(dataclasses.replace(m, cache_dtype=np.dtype(np.float16)), key)
        != base
    )
    from minfer_jax.model.weights import LoadOptions, load_params

    apart = load_params(tiny_gguf, LoadOptions(fuse=False))
    assert executables.fingerprint(dataclasses.replace(m, params=apart), key) != base
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert executables.fingerprint(m, key) != base


def test_corrupt_entry_is_a_miss_and_is_overwritten(caches, tiny_gguf, caplog):
    m = load(tiny_gguf)
    key = m.plan().logits_key(16)
    m.executable(key)
    entry = m.store.path(executables.fingerprint(m, key))
    good = entry.read_bytes()
    entry.write_bytes(good[: len(good) // 2])  # truncated
    again = load(tiny_gguf)
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        exe, _ = again.executable(key)
    assert again.executable_record(key).source == "compiled" and "unusable" in caplog.text
    assert entry.stat().st_size == len(good)  # rewritten whole
    third = load(tiny_gguf)
    third.executable(key)
    assert third.executable_record(key).source == "store"


def test_unserializable_backend_falls_back_to_compiling(caches, tiny_gguf, monkeypatch):
    """A backend that cannot serialize (or deserialize) still runs: it compiles every start."""
    from jax.experimental import serialize_executable

    def fail(*args, **kwargs):
        raise ValueError("Compilation does not support serialization")

    with monkeypatch.context() as mp:
        mp.setattr(serialize_executable, "serialize", fail)
        m = load(tiny_gguf)
        tokens, keys = run(m)
        assert not any(m.in_store(k) for k in keys) and m.compile_stats["compiled"] == 2
    run(load(tiny_gguf))  # now stored
    with monkeypatch.context() as mp:
        mp.setattr(serialize_executable, "deserialize_and_load", fail)
        m = load(tiny_gguf)
        assert (
            run(m)[0] == tokens
            and m.compile_stats["compiled"] == 2
            and m.compile_stats["store"] == 0
        )


_JAX_CACHE_RUN = """
import json, sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import minfer_jax
from minfer_jax.model.from_gguf import load_gguf
m = minfer_jax.load(gguf_model=load_gguf(sys.argv[2]), kernels="xla", weights="quantized",
                    ctx_size=256, prefill_chunk=16)
out = minfer_jax.generate(m, [5, 17, 42, 99, 7], max_new_tokens=20)
print(json.dumps(dict(tokens=out.tokens, sources=[r.source for r in m.executable_records])))
"""


def test_a_jax_cache_hit_never_enters_the_store(tiny_gguf, tmp_path):
    """An executable JAX's persistent cache hands back is not stored (on the CPU its re-serialized
    copy has lost its code), and the run it serves computes the same tokens. Fresh processes: JAX
    reads its cache setting once per process."""
    import json
    import subprocess
    import sys

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)

    def run_in(store_dir):
        env = dict(os.environ, MINFER_COMPILATION_CACHE=str(store_dir), MINFER_WEIGHTS_CACHE="0")
        proc = subprocess.run(
            [sys.executable, "-c", _JAX_CACHE_RUN, str(tmp_path / "jax"), str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run_in(tmp_path / "a")  # JAX's cache empty: fresh compiles, stored
    assert (
        first["sources"] == ["compiled", "compiled"]
        and len(list((tmp_path / "a").glob("*/*.exe"))) == 2
    )
    second = run_in(tmp_path / "b")  # JAX's cache warm, this store empty: JAX's copies, not stored
    assert second["sources"] == ["jax-cache", "jax-cache"] and not list(
        (tmp_path / "b").glob("*/*.exe")
    )
    assert second["tokens"] == first["tokens"]
    third = run_in(tmp_path / "a")
    assert third["sources"] == ["store", "store"] and third["tokens"] == first["tokens"]


def test_the_store_replaces_jax_cache_on_cpu(tiny_gguf, caches):
    import minfer_jax.engine.runtime as runtime

    assert not executables.jax_cache_useful("cpu") and executables.jax_cache_useful("gpu")
    if jax.default_backend() == "cpu" and not jax.config.jax_compilation_cache_dir:
        runtime.enable_compilation_cache("cpu")
        assert not jax.config.jax_compilation_cache_dir


def test_cache_off_means_no_store(tiny_gguf, monkeypatch):
    monkeypatch.setenv("MINFER_COMPILATION_CACHE", "0")
    assert load(tiny_gguf).store is None


def test_store_stays_within_its_bound(tmp_path):
    store = executables.ExecutableStore(tmp_path, max_bytes=1000)
    for i, size in enumerate((400, 400, 400)):
        (tmp_path / f"{i}.exe").write_bytes(b"x" * size)
        os.utime(tmp_path / f"{i}.exe", (i, i))  # 0 is the least recently used
    stale, fresh = tmp_path / ".tmp-dead.exe", tmp_path / ".tmp-writing.exe"
    for p in (stale, fresh):
        p.write_bytes(b"x")
    os.utime(stale, (0, 0))  # a writer that died long ago (engine/file_store.py)
    store.prune()
    assert sorted(p.name for p in store.entries()) == ["1.exe", "2.exe"]
    assert fresh.exists() and not stale.exists()


# -- the weights cache ---------------------------------------------------------------------------


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return (
        jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        and len(la) == len(lb)
        and all(
            x.shape == y.shape
            and x.dtype == y.dtype
            and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
            for x, y in zip(la, lb)
        )
    )


@pytest.mark.parametrize("weights", ["int8", "dense", "quantized"])
def test_weights_cache_maps_identical_weights(caches, tiny_gguf, tmp_path, weights):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)
    first = minfer_jax.load(path, kernels="xla", weights=weights, ctx_size=256)
    assert first.weights_from == "built"
    first.weights_saving.join()
    second = minfer_jax.load(path, kernels="xla", weights=weights, ctx_size=256)
    assert second.weights_from == "cache" and second.weights_saving is None
    assert _leaves_equal(first.params, second.params)
    assert (
        minfer_jax.generate(first, PROMPT, max_new_tokens=4).tokens
        == minfer_jax.generate(second, PROMPT, max_new_tokens=4).tokens
    )


def test_weights_cache_keys_on_file_and_options(caches, tiny_gguf, tmp_path):
    from minfer_jax.model.weights import LoadOptions

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)
    a = weights_cache.cache_key(str(path), LoadOptions(mode="dense"))
    assert a == weights_cache.cache_key(str(path), LoadOptions(mode="dense"))
    assert a != weights_cache.cache_key(str(path), LoadOptions(mode="dense", wide_dtype="bfloat16"))
    assert (
        weights_cache.cache_key("synthetic:2L-d128:q8_0", LoadOptions()) is None
    )  # no file: not cached
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the same size, a different last byte
    path.write_bytes(bytes(data))
    assert weights_cache.cache_key(str(path), LoadOptions(mode="dense")) != a


def test_corrupt_weights_entry_is_rebuilt(caches, tiny_gguf, tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)
    first = minfer_jax.load(path, kernels="xla", weights="dense", ctx_size=256)
    first.weights_saving.join()
    (entry,) = (caches / "weights").glob("*.weights")
    entry.write_bytes(entry.read_bytes()[:5000])
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        second = minfer_jax.load(path, kernels="xla", weights="dense", ctx_size=256)
    assert second.weights_from == "built" and "unusable" in caplog.text
    second.weights_saving.join()
    third = minfer_jax.load(path, kernels="xla", weights="dense", ctx_size=256)
    assert third.weights_from == "cache" and _leaves_equal(first.params, third.params)


def test_weights_cache_bound(tmp_path, tiny_gguf):
    from minfer_jax.model.weights import LoadOptions, load_params

    params = load_params(tiny_gguf, LoadOptions(mode="dense"))
    cache = weights_cache.WeightsCache(tmp_path, max_bytes=1000)
    assert not cache.put("x", params)  # larger than the whole cache: not written
    assert not list(tmp_path.glob("*.weights"))


# -- bench.py --startup ----------------------------------------------------------------------------


def test_startup_log_parsing_and_table():
    from minfer_bench.bench import startup

    log = "\n".join(
        [
            "startup: python + imports 1.20 s",
            "noise",
            "INFO:     startup: parse 0.50 s",
            format_executable(
                executables.ExecutableRecord("prefill [16]", "compiled", lower_s=1.0, compile_s=2.0)
            ),
            format_executable(executables.ExecutableRecord("decode [16]", "store", load_s=0.25)),
            "startup: first text after the process started 9.00 s",
        ]
    )
    phases, exes = startup.parse_log(log)
    assert phases == {"python + imports": 1.2, "parse": 0.5}
    assert [(e["label"], e["source"], e["lower"], e["compile"], e["store load"]) for e in exes] == [
        ("prefill [16]", "compiled", 1.0, 2.0, 0.0),
        ("decode [16]", "store", 0.0, 0.0, 0.25),
    ]
    runs = [
        startup.Run("cold", 9.0, 12.0, 0, phases, exes),
        startup.Run("warm", 2.0, 5.0, 0, phases, exes[1:]),
    ]
    result = dict(
        mode="cli",
        command=["python", "scripts/generate.py"],
        platform="cpu",
        cold=startup.summarize(runs, "cold"),
        warm=startup.summarize(runs, "warm"),
    )
    assert result["cold"]["other_s"] == pytest.approx(9.0 - 1.7 - 3.25)
    table = startup.markdown(result)
    assert (
        "| parse | 0.50 | 0.50 |" in table
        and "| executables from the store / compiled | 1 / 1 | 1 / 0 |" in table
    )
    assert "| **first text** | **9.00** | **2.00** |" in table


@pytest.mark.slow
def test_bench_startup_cli_cold_then_warm(tiny_gguf, tmp_path, capsys):
    """Fresh processes: the warm one loads every executable from the store and maps its weights."""
    import json

    from minfer_bench.bench.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_gguf, path, progress=False)
    assert (
        main(
            [
                "--startup",
                "-m",
                str(path),
                "-n",
                "4",
                "-c",
                "256",
                "-o",
                "json",
                "--startup-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    cold, warm = result["cold"], result["warm"]
    assert cold["compiled"] >= 2 and cold["from_store"] == 0
    assert warm["compiled"] == 0 and warm["from_store"] == cold["compiled"]
    assert warm["executables"]["lower"] == warm["executables"]["compile"] == 0
    assert {"python + imports", "parse", "params", "tokenizer"} <= set(warm["phases"])
    assert 0 < warm["ready_s"] <= warm["wall_s"] and cold["ready_s"] > 0
    assert not list(tmp_path.glob("minfer-startup-*"))  # cache directories removed
