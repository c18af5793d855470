"""Compiling a long-running process's executables without making anyone wait for them.

A server first compiles `plan.ready_keys()`, the two executables that serve every request on
their own (the largest prefill bucket and decode at every row in the FULL sampler mode), and only
then says it is ready. The rest of `plan.serving_keys()` compile on background threads while it
serves; until a request's own executable is ready, the scheduler (compile_in_loop=False) runs it
on a compiled one that covers it (more rows, a larger bucket, a wider mode), so no stream waits
for a compile. A stand-in costs more than the key it stands for (on a 2-core CPU a short prompt
pays for the whole 256-token bucket, decode in the FULL mode with logprobs ~5x greedy), so the
keys that running requests wait for compile first (ExecutablePool.wanted_keys), then the
likeliest (greedy, then the default sampled mode; small buckets and few rows first). Tracing and
lowering run at the normal priority (they hold the GIL: a niced holder starved of CPU would
stall the loop thread that waits for it); XLA's compile, which releases the GIL, runs on niced
workers, `compile_threads()` at a time.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

from minfer_jax.engine.plan import MIN_BUCKET, DecodeKey, Plan
from minfer_jax.engine.spec_plan import VerifyBatchKey, VerifyKey
from minfer_jax.errors import InvalidArgumentError


def background_order(plan: Plan) -> list:
    """serving_keys() minus ready_keys(), the likeliest first: lower sampler modes, then decode
    and prefill interleaved by size (rows 1, bucket 16, rows 2, bucket 32, ...: the smallest prefill
    bucket early, its stand-in being the costliest); speculation's verification keys last (steps
    decode plainly until theirs is ready)."""
    ready = set(plan.ready_keys())
    rest = [k for k in plan.serving_keys() if k not in ready]

    def likeliest(k):
        if isinstance(k, (VerifyKey, VerifyBatchKey)):
            return (1, k.mode, 0, getattr(k, "rows", 1) * (1 + k.drafts))
        decode = isinstance(k, DecodeKey)
        size = k.rows if decode else k.bucket // MIN_BUCKET
        return (0, k.mode, size, not decode)

    return sorted(rest, key=likeliest)


BACKGROUND_NICE = 10
COMPILE_NICE_ENV = "MINFER_COMPILE_NICE"
COMPILE_THREADS_ENV = "MINFER_COMPILE_THREADS"


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r}: expected an integer in {lo}..{hi}") from None
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{name}={value}: expected an integer in {lo}..{hi}")
    return value


def compile_nice() -> int:
    """The nice value of the XLA compile workers (MINFER_COMPILE_NICE, default 10)."""
    return _env_int(COMPILE_NICE_ENV, BACKGROUND_NICE, 0, 19)


def compile_threads(cpus: int | None = None) -> int:
    """Background compiles at once (MINFER_COMPILE_THREADS): by default one per 4 cores, at most
    4, so that the decoding streams keep the rest (one on a 2-core CPU: a second would take the
    core decoding uses)."""
    cpus = cpus or os.cpu_count() or 1
    return _env_int(COMPILE_THREADS_ENV, max(1, min(4, cpus // 4)), 1, 64)


def _lower_priority(nice: int) -> None:
    """Nice this thread (Linux: a thread has its own nice value, and the threads it starts, such
    as LLVM's, inherit it), so that compiling yields the CPU to the loop and the handlers."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at the normal priority
        pass


class NicedWorker:
    """One daemon thread at a nice value that runs what `run(fn)` hands it (the caller waits); a
    daemon, so that a compile in flight never holds up the process's exit."""

    def __init__(self, nice: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._serve, args=(nice,), name="minfer-xla", daemon=True
        )
        self.thread.start()

    def _serve(self, nice: int) -> None:
        _lower_priority(nice)
        while (job := self.jobs.get()) is not None:
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            done.set()

    def run(self, fn: Callable):
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)


class Warmup:
    """Compiles a model's executables for one plan: `ready()` in the caller's thread, then the rest
    with `start_background()`. `log(message)` receives a line per executable."""

    def __init__(self, model, plan: Plan, log: Callable[[str], None] = lambda message: None):
        self.model, self.plan, self.log = model, plan, log
        self.done = threading.Event()  # set once every background key is compiled (or it stopped)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _one(self, key, what: str, compile_on: Callable | None = None) -> None:
        _, dt = self.model.executable(key, compile_on)
        record = self.model.executable_record(key)
        source = ""
        if record is not None and dt > 0:
            source = f" ({record.source}"
            if record.source != "store":
                source += f": lower {record.lower_s:.1f} s, compile {record.compile_s:.1f} s"
            source += ")"
        self.log(f"{what}: {key.label} in {dt:.1f} s{source}")

    def _compile(self, keys, what: str) -> float:
        t0 = time.perf_counter()
        for i, key in enumerate(keys, 1):
            self._one(key, f"{what} {i}/{len(keys)}")
        return time.perf_counter() - t0

    def ready(self) -> float:
        """Compile (or load) what serves every request; returns the seconds it took."""
        return self._compile(self.plan.ready_keys(), "ready set")

    def start_background(
        self, stop: threading.Event, wanted: Callable[[], list] = list
    ) -> threading.Thread:
        """Compile background_order(plan) on compile_threads() threads; before each key, what
        `wanted()` names first (the keys running requests wait for: ExecutablePool.wanted_keys).
        Each thread traces and lowers at the normal priority (Python: it holds the GIL, and a
        niced holder that the CPU starves stalls the loop thread waiting for it) and hands XLA's
        compile to a worker at compile_nice()."""
        order = background_order(self.plan)
        n_threads, nice = compile_threads(), compile_nice()
        picked: set = set()
        lock = threading.Lock()

        def pick():
            with lock:
                for key in [*wanted(), *order]:
                    if key not in picked and not self.model.is_compiled(key):
                        picked.add(key)
                        return key, len(picked)
            return None, 0

        def drive() -> None:
            xla = NicedWorker(nice)
            try:
                while not stop.is_set() and self.error is None:
                    key, i = pick()
                    if key is None:
                        return
                    self._one(key, f"background {i}/{len(order)}", xla.run)
            except BaseException as e:  # the stand-ins keep serving; report it, don't kill it
                self.error = e
                self.log(
                    f"background compile failed: {e!r}; requests keep running on the ready set"
                )
            finally:
                xla.close()

        def run():
            t0 = time.perf_counter()
            try:
                drivers = [
                    threading.Thread(target=drive, name=f"minfer-lower-{i}", daemon=True)
                    for i in range(n_threads)
                ]
                for d in drivers:
                    d.start()
                for d in drivers:
                    d.join()
                if not stop.is_set() and self.error is None:
                    self.log(
                        f"background: all {len(order)} executables ready in "
                        f"{time.perf_counter() - t0:.1f} s ({n_threads} at a time, nice {nice})"
                    )
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name="minfer-compile", daemon=True)
        self.thread.start()
        return self.thread
