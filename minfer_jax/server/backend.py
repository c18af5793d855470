"""The server's side of the engine: loads the model in the background, runs the scheduler's loop
thread, admits requests (or refuses them when the queue is full) and bridges each request's text
from the loop thread into the asyncio event loop that serves it.

The scheduler (minfer_jax.engine.scheduler) is the one host loop; this module only owns its thread
and the bookkeeping the HTTP side needs (live requests, counters for /metrics).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

from minfer_jax.engine.grammar import SERVING_COMPILE_NICE
from minfer_jax.engine.lookup import Speculation
from minfer_jax.engine.options import Options
from minfer_jax.engine.phases import process_age
from minfer_jax.engine.plan import MAX_DECODE_STEPS
from minfer_jax.engine.runtime import Model, load
from minfer_jax.engine.steps import StopReason
from minfer_jax.errors import MinferError

_log = logging.getLogger("uvicorn.error")  # uvicorn's configured logger: lines appear with its own

DEFAULT_SLOT_CTX = 4096  # tokens per slot when -c is 0 (capped by the model's trained context)
# One token per event: on the H200 (7B, -np 32) 1 step kept ITL p50 at ~1x TPOT and served 8 / 32
# clients at 0.80-0.89x / 1.09x the tokens/s of 16 steps (docs/BENCHMARKS.md "Server start and
# streaming")
DEFAULT_DECODE_STEPS = 1
SHUTTING_DOWN = "the server is shutting down; retry on another server or once it is back"
THROUGHPUT_WINDOW_S = 10.0  # tokens/s on /metrics: tokens generated over about this many seconds


class ServerBusy(MinferError):
    """Every slot is busy and the queue is full: the client should retry later (HTTP 429)."""


class ShuttingDown(MinferError):
    """The server is shutting down: a request that had not started ends with this (HTTP 503)."""

    def __init__(self, message: str = SHUTTING_DOWN):
        super().__init__(message)


class ServerSettingsError(MinferError, ValueError):
    """A server setting outside what the engine supports (-np, -c, ...)."""


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    # -m: path, hf:repo:file (load_model; others through the loader), None: the built-in default
    model: str | None = None
    n_parallel: int = 1  # -np: sequences decoded at once (KV cache slots)
    ctx_size: int = 0  # -c: total context over all slots (0: DEFAULT_SLOT_CTX per slot)
    n_predict: int = -1  # -n: default max_tokens (-1: until the slot's context is full)
    # requests waiting for a slot beyond the running ones (None: 4 x -np)
    max_queued: int | None = None
    # tokens per decode executable: text streams once per such chunk
    decode_steps: int = DEFAULT_DECODE_STEPS
    alias: str | None = None  # the model id /v1/models reports (default: the file's name)
    api_key: str | None = None
    warmup: bool = True  # compile the first executables before /health says ok
    # how the model loads and runs (kernels, deterministic, precise, ...); ctx_size is the slots'
    options: Options = Options()
    # --spec-type and its draft sizes: every request's default, and the most one may draft
    speculation: Speculation | None = None
    seed: int = -1  # -s: the seed of a request that gives none (-1: a random one each)

    def __post_init__(self):
        from minfer_jax.engine.plan import MAX_SEQS

        if not 1 <= self.n_parallel <= MAX_SEQS:
            raise ServerSettingsError(
                f"-np/--parallel must be in 1..{MAX_SEQS}, got {self.n_parallel}"
            )
        if self.ctx_size < 0 or (self.ctx_size and self.ctx_size < self.n_parallel * 16):
            raise ServerSettingsError(
                f"-c/--ctx-size {self.ctx_size} leaves fewer than 16 tokens for each of "
                f"{self.n_parallel} slots (use 0 for {DEFAULT_SLOT_CTX} per slot)"
            )
        if self.n_predict < -1:
            raise ServerSettingsError(f"-n/--n-predict must be >= -1, got {self.n_predict}")
        if self.max_queued is not None and self.max_queued < 0:
            raise ServerSettingsError(f"--max-queued must be >= 0, got {self.max_queued}")
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ServerSettingsError(
                f"--decode-steps must be in 1..{MAX_DECODE_STEPS}, got {self.decode_steps}"
            )
        if not -1 <= self.seed < 2**32:
            raise ServerSettingsError(
                f"-s/--seed must be -1 (random) or in 0..{2**32 - 1}, got {self.seed}"
            )

    def seed_of(self, requested: int | None) -> int:
        """A request's seed: its own, else -s/--seed, else a random one (llama-server's rule;
        the Anthropic API has no seed field, so -s is its only way to reproduce a sample)."""
        if requested is not None and requested >= 0:
            return requested
        return self.seed if self.seed >= 0 else secrets.randbits(32)

    @property
    def slot_ctx(self) -> int | None:
        """Tokens per slot (None: the loader's default), -c divided among -np like llama-server."""
        return self.ctx_size // self.n_parallel if self.ctx_size else None

    @property
    def queue_limit(self) -> int:
        return 4 * self.n_parallel if self.max_queued is None else self.max_queued


def load_model(ref: str | None, options: Options) -> Model:
    """minfer_jax.load(ref, options): the server's loader unless create_app is given another
    (minfer_bench.serve's also knows synthetic:<spec> models)."""
    return load(ref, options)


def _log_phases(model, started: float | None, load_s: float) -> None:
    """One log line per load phase (Model.startup), as the CLI's --verbose prints them; started:
    the process's age when the load began; load_s: the loader's seconds."""
    from minfer_jax.engine.phases import format_phase

    phases = getattr(model, "startup", {})
    if started is not None:
        _log.info("%s", format_phase("python + imports + server", started))
    outside = load_s - sum(phases.values())
    if outside > 0.005:  # e.g. a synthetic model's random weights, made before load()
        _log.info("%s", format_phase("model before load", outside))
    for name, seconds in phases.items():
        _log.info("%s", format_phase(name, seconds))
    if getattr(model, "weights_from", None) == "cache":
        _log.info("weights: mapped from the weights cache")


class Throughput:
    """Tokens per second over the last `window` seconds, from samples of a growing counter."""

    def __init__(self, window: float = THROUGHPUT_WINDOW_S):
        self.window = window
        self.samples: collections.deque[tuple[float, int]] = collections.deque(
            [(time.monotonic(), 0)]
        )
        self.lock = threading.Lock()

    def note(self, total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            self.samples.append((now, total))
            # keep one sample at or before the window's start: the baseline of the rate
            while len(self.samples) > 2 and self.samples[1][0] <= now - self.window:
                self.samples.popleft()

    def rate(self, total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            base_t, base_total = self.samples[0]
            for t, n in self.samples:  # the latest sample at or before the window's start
                if t <= now - self.window:
                    base_t, base_total = t, n
        span = max(now - base_t, self.window)
        return max(total - base_total, 0) / span


class Handle:
    """One submitted request as the event loop sees it: text pieces in an asyncio queue."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stream: bool,
        on_progress: Callable[[], None],
        on_finished: Callable,
    ):
        self.loop, self.stream = loop, stream
        self.on_progress, self.on_finished = on_progress, on_finished
        # streamed (piece, logprobs of the tokens since the last piece), then None
        self.queue: asyncio.Queue[tuple[str, list] | None] = asyncio.Queue()
        self.done: asyncio.Future = loop.create_future()  # resolved once the request is done
        self.req = None
        self._closed = False
        self._sent = 0  # token logprobs put in the queue

    # called from the scheduler's thread: must never raise into the loop
    def on_text(self, piece: str) -> None:
        self.on_progress()
        if self.stream:
            self._put((piece, self._new_logprobs(self.req)))

    def _new_logprobs(self, req) -> list:
        """The request's token logprobs not yet put in the queue (the loop's thread appends them
        before it calls on_text or on_done)."""
        if req is None:  # on_text before submit returned: they go with the next piece
            return []
        entries = req.token_logprobs[self._sent :]
        self._sent += len(entries)
        return entries

    def on_done(self, req) -> None:
        if self._closed:
            return
        self._closed = True
        self.on_finished(req)
        if self.stream:
            self._put(("", self._new_logprobs(req)))
        self._put(None)
        self._call(self._resolve)

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _put(self, item) -> None:
        self._call(self.queue.put_nowait, item)

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    async def pieces(self):
        """Text pieces as they become final; ends when the request is done."""
        async for piece, _ in self.items():
            if piece:
                yield piece

    async def items(self):
        """(text piece, logprobs of its tokens) as they become final; ends when the request is
        done (the last with what came after the last piece)."""
        while (item := await self.queue.get()) is not None:
            yield item

    def cancel(self) -> None:
        """The client went away: free the slot (no-op once the request is done)."""
        if self.req is not None and not self.req.done.is_set():
            self.req.cancel()


class Backend:
    """Model + scheduler + loop thread, loaded in the background (see the module docstring)."""

    def __init__(
        self,
        settings: ServerSettings,
        loader: Callable | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        self.settings = settings
        self.loader = loader
        self.on_fatal = on_fatal
        self.model = self.scheduler = self.warmup = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.closing = threading.Event()  # shutting down: no new requests, queued ones refused
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.live = 0  # submitted, not yet done
        self.preparing = 0  # read, not yet submitted: parsed, tokenized, its grammar compiled
        self.requests_total = 0
        self.finish_reasons: collections.Counter[StopReason] = collections.Counter()
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached = 0  # of those, reused from a slot (Request.cached)
        self.drafted = self.accepted = 0  # speculative decoding's draft tokens (finished requests)
        self.throughput = Throughput()
        self.started = time.time()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        t = threading.Thread(target=self._load, name="minfer-load", daemon=True)
        self.threads.append(t)
        t.start()

    def _load(self) -> None:
        try:
            loader = self.loader or load_model
            s = self.settings
            started, t0 = process_age(), time.perf_counter()
            model = loader(
                s.model, dataclasses.replace(s.options, ctx_size=s.slot_ctx, progress=False)
            )
            _log_phases(model, started, time.perf_counter() - t0)
            # grammar compiles yield the cores to decoding streams (engine/grammar.py)
            model.grammars.compile_nice = SERVING_COMPILE_NICE
            from minfer_jax.engine.scheduler import Scheduler
            from minfer_jax.engine.warmup import Warmup

            if (
                s.slot_ctx is not None and model.ctx_size < s.slot_ctx
            ):  # clamped like -c of the CLI and load()
                _log.warning(
                    "-c/--ctx-size: %d tokens per slot is more than the model's trained context; "
                    "using %d",
                    s.slot_ctx,
                    model.ctx_size,
                )
            plan = model.plan(s.n_parallel, model.ctx_size, s.decode_steps)
            if s.speculation is not None:  # its verification executables compile in the background
                plan = dataclasses.replace(plan, draft_max=s.speculation.draft_max)
            sched = Scheduler(model, plan, compile_in_loop=not s.warmup)
            warm = self.warmup = Warmup(model, plan, log=_log.info)
            if s.warmup:
                t0 = time.perf_counter()
                warm.ready()
                self._trial_run(model, sched)
                _log.info(
                    "ready: %d executables serve every request (%.1f s); %d more compile in the "
                    "background",
                    len(plan.ready_keys()),
                    time.perf_counter() - t0,
                    len(warm.plan.serving_keys()) - len(plan.ready_keys()),
                )
            loop = threading.Thread(
                target=sched.serve_forever, args=(self.stop,), name="minfer-loop", daemon=True
            )
            self.threads.append(loop)
            self.model, self.scheduler = model, sched
            loop.start()
            self.ready.set()
            if s.warmup:
                self.threads.append(warm.start_background(self.stop, sched.exes.wanted_keys))
        except BaseException as e:  # any failure to load ends the server (llama-server exits too)
            self.error = e
            if self.on_fatal is not None:
                self.on_fatal(e)

    @staticmethod
    def _trial_run(model, sched) -> None:
        """One short sampled request through the ready set before /health says ok (it runs on
        those executables: compile_in_loop is off)."""
        from minfer_jax.engine.sampling import sampler_of
        from minfer_jax.server.schemas import DEFAULT_TEMPERATURE

        token = (
            model.tokenizer.bos_id
            if model.tokenizer is not None and model.tokenizer.bos_id is not None
            else 0
        )
        req = sched.submit(
            [token], max_new_tokens=2, sampler=sampler_of(temperature=DEFAULT_TEMPERATURE), seed=0
        )
        sched.run([req])
        req.result()
        sched.forget_trial()

    def begin_shutdown(self) -> None:
        """The server is going down (its first SIGINT / SIGTERM): new requests are refused and
        queued ones end at once with ShuttingDown; running ones may finish in uvicorn's grace
        period. Never blocks (it runs in a signal handler)."""
        self.closing.set()
        if self.scheduler is not None:
            self.scheduler.refuse_queued(ShuttingDown())

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads; every request still open ends (running ones cancelled, the rest
        with ShuttingDown), so that no waiter is left hanging."""
        self.begin_shutdown()
        self.stop.set()
        sched = self.scheduler
        if sched is not None:
            for req in list(sched.waiting) + list(sched.prefilling) + list(sched.decoding):
                req.cancel()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout)
        if sched is not None and not any(t.is_alive() for t in self.threads):
            sched.fail_pending(ShuttingDown())

    @property
    def status(self) -> str:
        return "ok" if self.ready.is_set() else ("error" if self.error is not None else "loading")

    @property
    def model_id(self) -> str:
        import os

        if self.settings.alias:
            return self.settings.alias
        if self.model is not None:
            return os.path.basename(str(self.model.source))
        return os.path.basename(self.settings.model or "default")

    # -- requests --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def preparing_request(self):
        """A request between its body and its last choice queued: counted in /metrics, so that a
        server compiling a request's grammar never looks idle."""
        with self.lock:
            self.preparing += 1
        try:
            yield
        finally:
            with self.lock:
                self.preparing -= 1

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None,
        sampler,
        seed: int | None,
        stop: Sequence[str],
        stream: bool,
        constraint=None,
        logprobs: int | None = None,
        leader: Handle | None = None,
        speculation: Speculation | None = None,
    ) -> Handle:
        """Queue one generation; ServerBusy when the queue is full, MinferError for a bad
        request. logprobs: alternatives per token (None: no logprobs); leader: the choice whose
        prefill this one shares (n > 1); speculation: its drafts (server/speculation.py)."""
        sched, s = self.scheduler, self.settings
        limit = s.n_parallel + s.queue_limit
        if self.closing.is_set():
            raise ShuttingDown()
        handle = Handle(asyncio.get_running_loop(), stream, self._progress, self._finished)
        with self.lock:
            if self.live >= limit:
                raise ServerBusy(
                    f"{self.live} requests are running or queued (the limit is {limit}: "
                    f"{s.n_parallel} slots + {s.queue_limit} queued); retry later"
                )
            self.live += 1
        n = s.n_predict if max_tokens is None else max_tokens
        try:
            handle.req = sched.submit(
                prompt_ids,
                max_new_tokens=sched.plan.ctx if n < 0 else n,
                sampler=sampler,
                seed=s.seed_of(seed),
                stop=stop,
                on_text=handle.on_text,
                on_done=handle.on_done,
                constraint=constraint,
                logprobs=logprobs,
                leader=None if leader is None else leader.req,
                speculation=speculation,
            )
        except BaseException:
            with self.lock:
                self.live -= 1
            raise
        with self.lock:
            self.requests_total += 1
            self.prompt_tokens_total += len(handle.req.prompt)
        return handle

    def _progress(self) -> None:
        self.throughput.note(self.scheduler.tokens_out)

    def _finished(self, req) -> None:
        """A request is done (scheduler thread): update the counters behind /metrics."""
        with self.lock:
            self.live -= 1
            self.finish_reasons[
                req.stream.reason if req.stream is not None else StopReason.ERROR
            ] += 1
            self.prompt_tokens_cached += req.cached
            if req.drafter is not None:
                self.drafted += req.drafter.stats.drafted
                self.accepted += req.drafter.stats.accepted
        self._progress()
