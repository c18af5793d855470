"""One greedy stream's token gaps while background compiles run, in one process (no HTTP).

    MINFER_COMPILATION_CACHE=/tmp/stall_cache python tools/compile_stall.py --mode new \\
        --nice 10 -np 2 --seconds 45

Loads the built-in model (or -m), compiles or loads the ready set (`plan.ready_keys()`: keep the
cache directory between runs so that this is a load), then compiles the background order fresh
(the store is off for it) on one thread while greedy requests of 48 tokens decode back to back
on the scheduler's loop thread (compile_in_loop off: stand-ins until their own key is ready) and a
third thread sleeps 2 ms in a loop (its oversleep: how long it waited for the GIL). `--mode old`
runs the whole compile thread niced (main a752f56), `new` lowers at the normal priority and
compiles on a niced worker (engine/warmup.NicedWorker). Prints JSON: gaps within a request (p50,
p99, max, ms), each compiled key's lower / compile seconds, the GIL waits (p99, max, ms).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import threading
import time

import numpy as np

import minfer_jax
from minfer_jax.engine.sampling import Sampler
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.engine.warmup import NicedWorker, Warmup, background_order


def _background(model, keys, mode: str, nice: int, stop, compiled: list) -> None:
    compile_on = NicedWorker(nice).run if mode == "new" else None
    if mode == "old":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    for key in keys:
        if stop.is_set():
            return
        model.executable(key, compile_on)
        record = model.executable_record(key)
        compiled.append((key.label, round(record.lower_s, 2), round(record.compile_s, 2)))


def _gil_waits(stop, waits: list) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.002)
        waits.append(time.perf_counter() - t0 - 0.002)


def _arrived(events: list[float], _piece: str) -> None:
    events.append(time.perf_counter())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--mode", choices=("old", "new"), default="new")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("--seconds", type=float, default=45.0)
    args = p.parse_args()
    model = minfer_jax.load(args.model, minfer_jax.Options(ctx_size=1024, progress=False))
    plan = model.plan(args.parallel, 1024, decode_steps=1)
    Warmup(model, plan).ready()
    model.store = None  # the background compiles fresh every run
    sched = Scheduler(model, plan, compile_in_loop=False)
    stop = threading.Event()
    threading.Thread(target=sched.serve_forever, args=(stop,), daemon=True).start()
    ids = model.encode("def quicksort(items):")
    sched.submit(ids, max_new_tokens=4).result()
    compiled: list = []
    waits: list[float] = []
    threading.Thread(target=_gil_waits, args=(stop, waits), daemon=True).start()
    keys = background_order(plan)
    args_bg = (model, keys, args.mode, args.nice, stop, compiled)
    threading.Thread(target=_background, args=args_bg, daemon=True).start()
    gaps: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        events: list[float] = []
        on_text = functools.partial(_arrived, events)
        greedy = Sampler(temperature=0.0)
        req = sched.submit(ids, max_new_tokens=48, sampler=greedy, on_text=on_text)
        req.result()
        gaps += np.diff(events).tolist()
    stop.set()
    ms = lambda v, q: round(float(np.percentile(v, q)) * 1e3, 1)  # noqa: E731
    print(
        json.dumps(
            dict(
                mode=args.mode,
                nice=args.nice,
                gap_ms_p50=ms(gaps, 50),
                gap_ms_p99=ms(gaps, 99),
                gap_ms_max=ms(gaps, 100),
                compiled=compiled,
                gil_wait_ms_p99=ms(waits, 99),
                gil_wait_ms_max=ms(waits, 100),
            )
        ),
        flush=True,
    )
    os._exit(0)  # daemon threads may be inside XLA: skip the interpreter's teardown


if __name__ == "__main__":
    main()
