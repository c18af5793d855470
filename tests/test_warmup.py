"""A cold server's background compiles (engine/warmup.py): what running requests wait for compiles
first, tracing and lowering keep the normal priority, XLA's compile runs niced."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine.sampling import Sampler
from minfer_jax.engine.warmup import (
    COMPILE_THREADS_ENV,
    Warmup,
    background_order,
    compile_nice,
    compile_threads,
)
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.server.backend import Backend
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=1, d_model=64, d_ff=128, context_length=256)


def _nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_compile_threads_leave_a_small_cpu_one_and_take_the_setting(monkeypatch):
    monkeypatch.delenv(COMPILE_THREADS_ENV, raising=False)
    assert [compile_threads(c) for c in (1, 2, 4, 8, 16, 128)] == [1, 1, 1, 2, 4, 4]
    monkeypatch.setenv(COMPILE_THREADS_ENV, "3")
    assert compile_threads(2) == 3
    monkeypatch.setenv(COMPILE_THREADS_ENV, "0")
    with pytest.raises(InvalidArgumentError, match=COMPILE_THREADS_ENV):
        compile_threads(2)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is Linux's")
def test_what_requests_wait_for_compiles_first_lowered_at_normal_priority(monkeypatch):
    """After a sampled request ran on the ready set's stand-ins, the background compiles that
    request's own keys before the rest of its order (a stand-in costs up to ~16x on a CPU). The
    thread that traces and lowers keeps the process's priority (it holds the GIL: niced and
    starved, it would stall the loop thread); XLA's compile runs on workers at compile_nice()."""
    monkeypatch.setenv(COMPILE_THREADS_ENV, "1")
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    m = minfer_jax.load(
        gguf_model=gm, kernels="xla", weights="quantized", ctx_size=128, prefill_chunk=32
    )
    plan = m.plan(n_seqs=2, ctx=128, decode_steps=1)
    sched = minfer_jax.Scheduler(m, plan, compile_in_loop=False)
    lines: list[str] = []
    priorities: list[tuple[int, list[int]]] = []  # (the lowering thread's, the XLA workers')
    stop = threading.Event()
    warm = Warmup(m, plan, log=lines.append)
    warm.ready()
    Backend._trial_run(m, sched)  # a server's run before /health: it counts for no client
    assert (sched.tokens_out, sched.stand_ins, sched.exes.wanted) == (0, 0, {})
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 9).tolist()
    sampler = Sampler(temperature=0.9, top_k=40, top_p=0.95)
    req = sched.submit(ids, max_new_tokens=3, sampler=sampler, seed=1)
    sched.run([req])
    assert req.result().stop_reason == "length" and sched.stand_ins > 0
    assert sched.tokens_out == 3  # minfer_tokens_generated_total: the client's tokens only
    wanted = sched.exes.wanted_keys()
    order = background_order(plan)
    assert len(wanted) == 2 and wanted != order[:2], (wanted, order[:2])

    def log(line: str) -> None:  # runs on the thread that lowered the key
        lines.append(line)
        xla = [t.native_id for t in threading.enumerate() if t.name.startswith("minfer-xla")]
        priorities.append((_nice(threading.get_native_id()), [_nice(n) for n in xla if n]))
        if sum(line.startswith("background") for line in lines) == len(wanted):
            stop.set()  # the rest of the order is not this test's business

    warm.log = log
    warm.start_background(stop, sched.exes.wanted_keys).join(120)
    assert warm.done.is_set() and warm.error is None
    compiled = [line.split(": ")[1].split(" in ")[0] for line in lines if "background" in line]
    assert compiled == [k.label for k in wanted], lines
    mine = _nice(threading.get_native_id())
    assert all(lowering == mine for lowering, _ in priorities), priorities
    assert all(xla == [max(mine, compile_nice())] for _, xla in priorities), priorities
