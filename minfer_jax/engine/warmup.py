"""Compiling a long-running process's executables without making anyone wait for them.

A server first compiles `plan.ready_keys()`, the two executables that serve every request on
their own (the largest prefill bucket and decode at every row in the FULL sampler mode), and only
then says it is ready. The rest of `plan.serving_keys()` compile on a background thread while it
serves; until a request's own executable is ready, the scheduler (compile_in_loop=False) runs it
on a compiled one that covers it (more rows, a larger bucket, a wider mode), so no stream stalls
for a compile. The order puts the executables a typical load meets first (greedy and default
sampled decode at few rows, then prefill buckets, then the rest).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from minfer_jax.engine.plan import DecodeKey, Plan
from minfer_jax.engine.spec_plan import VerifyBatchKey, VerifyKey


def background_order(plan: Plan) -> list:
    """serving_keys() minus ready_keys(), the likeliest first: lower sampler modes, decode before
    prefill, fewer rows and smaller buckets first; speculation's verification keys last (steps
    decode plainly until theirs is ready)."""
    ready = set(plan.ready_keys())
    rest = [k for k in plan.serving_keys() if k not in ready]

    def likeliest(k):
        if isinstance(k, (VerifyKey, VerifyBatchKey)):
            return (1, k.mode, 0, getattr(k, "rows", 1) * (1 + k.drafts))
        decode = isinstance(k, DecodeKey)
        return (0, k.mode, not decode, k.rows if decode else k.bucket)

    return sorted(rest, key=likeliest)


def _lower_priority() -> None:
    """Nice this thread (Linux: a thread has its own nice value), so that tracing and compiling in
    the background yield the CPU to the loop thread and the request handlers."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at the normal priority
        pass


BACKGROUND_NICE = 10


class Warmup:
    """Compiles a model's executables for one plan: `ready()` in the caller's thread, then the rest
    with `start_background()`. `log(message)` receives a line per executable."""

    def __init__(self, model, plan: Plan, log: Callable[[str], None] = lambda message: None):
        self.model, self.plan, self.log = model, plan, log
        self.done = threading.Event()  # set once every background key is compiled (or it stopped)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _one(self, key, what: str) -> None:
        _, dt = self.model.executable(key)
        record = self.model.executable_record(key)
        source = f" ({record.source})" if record is not None and dt > 0 else ""
        self.log(f"{what}: {key.label} in {dt:.1f} s{source}")

    def _compile(self, keys, what: str) -> float:
        t0 = time.perf_counter()
        for i, key in enumerate(keys, 1):
            self._one(key, f"{what} {i}/{len(keys)}")
        return time.perf_counter() - t0

    def ready(self) -> float:
        """Compile (or load) what serves every request; returns the seconds it took."""
        return self._compile(self.plan.ready_keys(), "ready set")

    def start_background(self, stop: threading.Event) -> threading.Thread:
        keys = background_order(self.plan)

        def run():
            t0 = time.perf_counter()
            _lower_priority()
            try:
                for i, key in enumerate(keys, 1):
                    if stop.is_set():
                        return
                    self._one(key, f"background {i}/{len(keys)}")
                self.log(
                    f"background: all {len(keys)} executables ready in "
                    f"{time.perf_counter() - t0:.1f} s"
                )
            except (
                BaseException
            ) as e:  # the stand-ins keep serving; report it, don't kill the server
                self.error = e
                self.log(
                    f"background compile failed: {e!r}; requests keep running on the ready set"
                )
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name="minfer-compile", daemon=True)
        self.thread.start()
        return self.thread
