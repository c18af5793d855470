"""The one host loop: requests join and leave between decode chunks, prompts prefill in chunks.

`Scheduler(model, plan)` owns the KV cache (`plan.n_seqs` slots), the per-slot device state and
the plan of executables; `generate()`, `generate_batch()`, the CLI and the server all run through
it. Each `step()`:
  1. admits waiting requests into free slots (and drops cancelled ones),
  2. dispatches prefill chunks, oldest prefilling request first, up to `plan.chunk` prompt
     tokens (at least one chunk): prompts interleave with decoding, and short prompts arriving
     together (a server's clients) start together instead of one per decode chunk. A prompt
     starts where the longest prefix its slot still holds ends (prefix reuse: a shared system
     prompt or a conversation's earlier turns are not prefilled again; off in the
     deterministic mode),
  3. dispatches one decode chunk (`plan.decode_steps` tokens) for every decoding sequence,
  4. only then reads the tokens of the previous chunk: JAX dispatches asynchronously, so the
     device runs chunk k while the host detokenizes chunk k - 1 and checks its stops. A stop
     found late discards the extra tokens of chunk k (their K/V lie past the sequence's end).
Speculating sequences (lookup.py) draft where slot_spec.py says a step drafts: then the whole
batch runs one verification step (verify_batch.py; a lone row: verify.py), read at once.
Every per-sequence choice a batch may differ in (sampler, seed, position) is a traced array;
only shapes (plan.py) pick an executable.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from minfer_jax import validate
from minfer_jax.engine import inflight, sampling, slot_spec, spec_plan, steps
from minfer_jax.engine.checkpoints import Checkpoints
from minfer_jax.engine.constraint import BatchMasks, TokenConstraint
from minfer_jax.engine.drafter import SpeculationSetting
from minfer_jax.engine.exe_pool import ExecutablePool
from minfer_jax.engine.inflight import DecodeChunk, FirstToken
from minfer_jax.engine.lookup import check_speculation
from minfer_jax.engine.plan import Plan
from minfer_jax.engine.request import (
    Request,
    chunk_inputs,
    deliver,
    follows_tokens,
    kept_tokens,
    position,
    row_places,
)
from minfer_jax.engine.sampling import RowSettings, Sampler, SamplerMode
from minfer_jax.engine.sharing import common_prefix, shared_prefix, slot_copier, waits_for_leader
from minfer_jax.engine.steps import StopReason
from minfer_jax.engine.text_stream import TextStream
from minfer_jax.errors import ContextOverflowError
from minfer_jax.model.cache import KVCache


class Scheduler:
    """Continuous batching over `plan.n_seqs` cache slots (see the module docstring)."""

    def __init__(self, model, plan: Plan, *, compile_in_loop: bool = True):
        self.model, self.plan = model, plan
        # compile_in_loop False (a server): never compile on this thread once something compiled
        # covers the key (exe_pool.py); engine/warmup.py compiles the rest in the background
        self.exes = ExecutablePool(model, compile_in_loop)
        # allocated on first use, donated through every step
        self.cache: KVCache | None = None
        self.state: steps.SlotState | None = None
        self.free_slots = list(range(plan.n_seqs))
        # per free slot, the tokens whose K/V it still holds at positions [0, len) (prefix reuse)
        self.slot_tokens: dict[int, list[int]] = {}
        # No prefix reuse in the deterministic mode (kept K/V came from another chunking or from
        # decode steps, so a prompt's K/V would depend on what ran in its slot before). With
        # recurrent layers (qwen35) only from a checkpoint of their state (checkpoints.py).
        self.reuse_prefixes = not model.impl.deterministic
        self.checkpoints: Checkpoints | None = None
        self._copy_slot: Callable | None = None  # n > 1: a follower's start (sharing.py)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: collections.deque[Request] = collections.deque()
        self.decoding: list[Request] = []
        # dispatched, not read
        self.inflight: collections.deque[inflight.Item] = collections.deque()
        self.incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._masks = BatchMasks(model.config.vocab_size)
        self.tokens_out = 0  # tokens handed to requests (metrics)
        self._wake = threading.Event()
        # set by refuse_queued: from then on every request not yet started ends with this error
        self._refusal: BaseException | None = None

    # -- submitting ------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        sampler: Sampler | None = None,
        seed: int = 0,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        on_done: Callable[[Request], None] | None = None,
        constraint: TokenConstraint | None = None,
        speculation: SpeculationSetting | None = None,
        logprobs: int | None = None,
        leader: Request | None = None,
    ) -> Request:
        """Queue a generation (thread-safe); the loop picks it up at its next step.

        constraint: the tokens it may sample at each step (constraint.py), built off this
        thread. speculation: draft and verify tokens (lookup.py, verify.py). logprobs: each
        token's logprob and this many alternatives (0..TOP_LOGPROBS) in the result (None: none).
        leader: a request with the same prompt submitted before this one, whose prefill this one
        shares (sharing.py: n > 1 choices)."""
        prompt_ids = validate.token_ids(prompt_ids, self.model.config.vocab_size, "prompt")
        validate.integer("max_new_tokens", max_new_tokens, 0, validate.INT32_MAX)
        if logprobs is not None:
            validate.integer("logprobs", logprobs, 0, sampling.TOP_LOGPROBS)
        req = Request(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampler=sampler or Sampler(temperature=0.0),
            seed=seed,
            stop=stop,
            on_text=on_text,
            on_done=on_done,
            constraint=constraint,
            speculation=speculation,
            logprobs=logprobs,
            leader=leader,
        )
        self.check(req)
        self.incoming.put(req)
        self._wake.set()
        return req

    def check(self, req: Request) -> None:
        """The context check and what speculation cannot combine with (ids and limits are
        validated by submit)."""
        if req.drafter is not None:
            check_speculation(self.model.config, req.constraint, req.logprobs)
        n, ctx = len(req.prompt), self.plan.ctx
        if n >= ctx:
            raise ContextOverflowError(
                f"the prompt is {n} tokens but the context holds {ctx}, which leaves no room "
                "to generate; use a larger context (-c, ctx_size) or a shorter prompt"
            )

    @property
    def busy(self) -> bool:
        live = self.waiting or self.prefilling or self.decoding or self.inflight
        return bool(live) or not self.incoming.empty()

    def run(self, requests: Sequence[Request] = ()) -> None:
        """Step until these requests (or, with none given, all) are done."""
        while (not all(r.done.is_set() for r in requests)) if requests else self.busy:
            self.step()

    def serve_forever(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """The server's loop thread: step while there is work, sleep on the wake event otherwise."""
        while not stop.is_set():
            if self.busy:
                try:
                    self.step()
                except Exception:  # the failing requests got the error; keep serving the rest
                    continue
            else:
                self._wake.wait(idle_wait)
                self._wake.clear()

    # -- one iteration -----------------------------------------------------------------------
    def step(self) -> None:
        try:
            self._admit()
            dispatched = self._dispatch_prefill()
            drafting = slot_spec.speculates(self.plan, self._live())
            if drafting or any(follows_tokens(r) for r in self.decoding):  # a draft, a mask
                while self.inflight:
                    self._read(self.inflight.popleft())
            dispatched = self._dispatch_decode(drafting) or dispatched
            keep = (
                1
                if dispatched and self.inflight and isinstance(self.inflight[-1], DecodeChunk)
                else 0
            )
            while len(self.inflight) > keep:
                self._read(self.inflight.popleft())
        except BaseException as e:
            self._fail_all(e)
            raise

    def refuse_queued(self, error: BaseException) -> None:
        """From now on, end every request that has not started (queued now or later) with error
        at the loop's next step (thread-safe); running ones go on."""
        self._refusal = error
        self._wake.set()

    def fail_pending(self, error: BaseException) -> None:
        """End every request not yet done with error, queued ones included. Only once the loop's
        thread has stopped: this touches its state."""
        self._take_incoming()
        self._fail_all(error)

    def _take_incoming(self) -> None:
        while not self.incoming.empty():
            self.waiting.append(self.incoming.get())

    def _admit(self) -> None:
        self._take_incoming()
        if self._refusal is not None:
            for req in list(self.waiting):
                req.error = self._refusal
                self._finish(req, StopReason.ERROR)
        for req in [
            r for r in itertools.chain(self.waiting, self.prefilling, self.decoding) if r.cancelled
        ]:
            self._finish(req, StopReason.CANCELLED)
        while self.free_slots:
            # a follower waits for its leader's prefill (sharing.py); the others go in order
            ready = next((r for r in self.waiting if not self._waits(r)), None)
            if ready is None:
                break
            self.waiting.remove(req := ready)
            try:
                self._start(req)
            except BaseException:
                # back among the live requests, so that step's _fail_all ends it and frees its
                # slot: a compile or cache allocation that fails must not strand a request
                self.waiting.appendleft(req)
                raise

    def _start(self, req: Request) -> None:
        plan, n = self.plan, len(req.prompt)
        req.limit = min(req.max_new_tokens, plan.ctx - n)
        req.stream = TextStream(
            self.model.tokenizer,
            max_new_tokens=req.max_new_tokens,
            limit=plan.ctx - n,
            stop=req.stop,
        )
        if req.max_new_tokens == 0:
            self._finish(req, StopReason.LENGTH)
            return
        self._ensure_state()
        req.slot, req.cached = self._take_slot(req.prompt)
        if self.checkpoints is not None and self.cache is not None:  # restored, never truncated
            self.cache, req.cached = self.checkpoints.restore(self.cache, req.slot, req.prompt)
        shared = shared_prefix(req) if self.shares_prefill else 0
        if shared > req.cached and self.cache is not None:  # n > 1: the leader's K/V copied
            assert req.leader and req.leader.slot is not None and self._copy_slot is not None
            self.cache = self._copy_slot(self.cache, req.leader.slot, req.slot)
            req.cached = shared
        if self.exes.compile_in_loop:
            spec = None if req.drafter is None else req.drafter.spec
            follows, logprobs = follows_tokens(req), req.logprobs is not None
            needed = self.needed(
                n, req.max_new_tokens, req.sampler, req.cached, follows, logprobs, spec
            )
            req.timing.compile_s = self.compile(needed)
        req.chunks = plan.chunks(n - req.cached, req.cached)
        req.timing.started(self.compile_s)
        self.prefilling.append(req)

    def _take_slot(self, prompt: list[int]) -> tuple[int, int]:
        """The free slot whose kept tokens share the longest prefix with prompt, and how many of
        them to reuse (at least one prompt token is prefilled: it yields the first token's
        logits). Without a match: a slot that keeps nothing, else the one freed longest ago."""

        def shared(slot: int) -> int:
            return common_prefix(self.slot_tokens.get(slot, ()), prompt)

        best = max(self.free_slots, key=lambda s: (shared(s), s not in self.slot_tokens))
        self.free_slots.remove(best)
        return best, min(shared(best), len(prompt) - 1)

    # -- what to compile ---------------------------------------------------------------------
    @staticmethod
    def mode(samplers: Sequence[Sampler]) -> SamplerMode:
        return SamplerMode.of(samplers)

    @staticmethod
    def _mode_of(reqs: Sequence[Request]) -> SamplerMode:
        """The mode of a batch of requests: their samplers', LOGPROBS where one wants them."""
        return SamplerMode.of([r.sampler for r in reqs], any(r.logprobs is not None for r in reqs))

    @property
    def shares_prefill(self) -> bool:
        """Followers (n > 1) start from a copy of their leader's slot (sharing.py)."""
        return (
            self.reuse_prefixes
            and self.plan.n_seqs > 1
            and not self.model.config.recurrent_layer_ids
        )

    def _waits(self, req: Request) -> bool:
        return self.shares_prefill and waits_for_leader(req)

    def needed(
        self,
        n_prompt: int,
        max_new: int,
        sampler: Sampler,
        start: int = 0,
        one_step: bool = False,
        logprobs: bool = False,
        speculation: SpeculationSetting | None = None,
    ) -> list:
        """The executables a request of n_prompt tokens will run first (for compile-ahead messages);
        start: prompt tokens a slot already holds (prefix reuse); one_step: it follows a grammar
        (plan.decode_key); logprobs: it asks for its tokens' logprobs; speculation: its
        verification buckets too."""
        mode = SamplerMode.of([sampler], logprobs)
        batch = (len(self.decoding) + 1, self._mode_of(self.decoding).join(mode))
        return self.plan.first_keys(n_prompt, max_new, mode, batch, start, one_step, speculation)

    def compile(self, keys) -> float:
        """Compile what is not compiled yet; returns the seconds spent."""
        return self.exes.compile(keys)

    @property
    def compile_s(self) -> float:
        """Every compile this loop waited for (seconds)."""
        return self.exes.compile_s

    @property
    def stand_ins(self) -> int:
        """Dispatches that ran on a covering executable instead of their own."""
        return self.exes.stand_ins

    def forget_trial(self) -> None:
        """Counts and wishes of a trial run (a server's before /health says ok) dropped: its
        tokens served no client, its stand-ins are not what the background should favour."""
        self.tokens_out = 0
        self.exes.stand_ins = 0
        self.exes.wanted.clear()

    # -- dispatch ------------------------------------------------------------------------------
    def _ensure_state(self) -> None:
        if self.cache is None:
            m, p = self.model, self.plan
            self.cache = m.new_cache(p.n_slots, p.cache_len)
            self.state = steps.init_slot_state(p.n_slots, p.history)
            if self.cache.conv and self.reuse_prefixes:
                self.checkpoints = Checkpoints(self.cache)
            if self.shares_prefill:
                self._copy_slot = slot_copier(self.cache)

    def _dispatch_prefill(self) -> bool:
        """Prefill chunks up to plan.chunk prompt tokens this step (at least one chunk)."""
        budget = self.plan.chunk
        dispatched = False
        while self.prefilling and budget > 0:
            budget -= self._dispatch_prefill_chunk(self.prefilling[0])
            dispatched = True
        return dispatched

    def _dispatch_prefill_chunk(self, req: Request) -> int:
        """Dispatch req's next prompt chunk; returns its bucket (tokens of prefill work)."""
        start, bucket, n_valid = req.chunks.pop(0)
        key = self.exes.runnable(self.plan.prefill_key(bucket, self._mode_of([req])), start)
        tokens, history = chunk_inputs(req.prompt, start, n_valid, key.bucket, self.plan.history)
        assert req.slot is not None  # prefilling requests hold a slot
        vocab = self.model.config.vocab_size
        # only the last chunk's token counts: the constraint's first mask goes to that one
        mask = self._masks([None if req.chunks else req.constraint], 1)
        settings = RowSettings.of([req.sampler], [req.seed], vocab=vocab, mask=mask)
        (token,) = self._run(
            key, tokens, np.int32(req.slot), np.int32(start), np.int32(n_valid), history, settings
        )
        if not req.chunks:
            if self.checkpoints is not None and self.cache is not None:
                self.checkpoints.take(self.cache, req.slot, req.prompt)
            self.prefilling.popleft()
            req.produced = 1
            self.decoding.append(req)
            self.inflight.append(FirstToken(req, token))
        return bucket

    def _run(self, key, *inputs) -> list:
        """key's executable on the params, the cache and the slots' state (donated: replaced by
        the ones it returns) and inputs; returns its other outputs."""
        *out, self.state, self.cache = self.exes.get(key)(
            self.model.params, self.cache, self.state, *inputs
        )
        return out

    def _settings(self, rows: Sequence[Request], width: int) -> RowSettings:
        """The rows' sampler settings and constraint masks, padded to width rows."""
        return RowSettings.of(
            [r.sampler for r in rows],
            [r.seed for r in rows],
            width,
            vocab=self.model.config.vocab_size,
            mask=self._masks([r.constraint for r in rows], width),
        )

    def _live(self) -> list[Request]:
        """The decoding sequences a decode step advances."""
        return [r for r in self.decoding if not r.finished and r.produced < r.limit]

    def _dispatch_decode(self, drafting: bool) -> bool:
        """One decode step for every live row: drafting (slot_spec.py), one batch verification
        or, where that does not apply, a verification per drafting row; the rest (all rows when
        not drafting) in a plain chunk."""
        rows = self._live()
        if not drafting:
            slot_spec.count_down(rows)
        drafts = (
            slot_spec.propose(rows, spec_plan.spec_drafts(self.plan, len(rows))) if drafting else {}
        )
        if drafts and slot_spec.batches(self.plan, rows):
            if self._dispatch_batch(rows, drafts):
                return True
            drafts = {}  # a plain step instead
        verified = [r for r, d in drafts.items() if self._dispatch_verify(r, d)]
        rows = [r for r in rows if r not in verified]
        if not rows:
            return bool(verified)
        plan, n = self.plan, len(rows)
        end = max(len(r.prompt) + r.produced - 1 for r in rows) + plan.decode_steps
        # a grammar row needs each token before its next mask: the whole batch steps once
        one_step = any(follows_tokens(r) for r in rows)
        key = self.exes.runnable(plan.decode_key(n, end, self._mode_of(rows), one_step))
        width = key.rows
        slots, positions = row_places(rows, width, plan.scratch_slot)
        (out,) = self._run(key, slots, positions, self._settings(rows, width))
        valid = []
        for r in rows:
            valid.append(min(key.n_steps, r.limit - r.produced))
            r.produced += key.n_steps
        self.inflight.append(DecodeChunk(list(zip(rows, valid)), out))
        return True

    def _dispatch_batch(self, rows: list[Request], drafts: dict[Request, list[int]]) -> bool:
        """One verification step for the whole batch (verify_batch.py); False where no row
        drafts a token or no executable for it is ready (a server's background compiles it)."""
        end = max(position(r) for r in rows) + 1
        n = max(len(d) for d in drafts.values())
        if n == 0:  # only one-token verifications: a plain step (one token a row) is the same
            return False
        key = self.exes.ready_key(
            spec_plan.verify_batch_key(self.plan, len(rows), n, end, self._mode_of(rows))
        )
        if key is None:
            return False
        inputs = slot_spec.batch_inputs(self.plan, rows, drafts, key.rows, key.drafts)
        tokens, n_out = self._run(key, *inputs, self._settings(rows, key.rows))
        row_drafts = [(r, len(drafts[r]) if r in drafts else None) for r in rows]
        self.inflight.append(slot_spec.VerifyBatch(row_drafts, tokens, n_out))
        return True

    def _dispatch_verify(self, req: Request, draft: list[int]) -> bool:
        """Dispatch a verification of req's draft alone; False where no executable for it is
        ready (req then takes the plain decode chunk)."""
        assert req.slot is not None and req.drafter is not None
        at, mode = position(req), self.mode([req.sampler])  # all tokens read
        on_device = req.drafter.spec.on_device  # MTP: the step drafts (verify.py)
        key = self.exes.ready_key(
            spec_plan.verify_key(self.plan, len(draft), at + 1, mode, on_device)
        )
        if key is None:
            return False
        drafts = np.array(draft + [0] * (key.drafts - len(draft)), np.int32)
        tokens, n_out = self._run(
            key, np.int32(req.slot), np.int32(at), drafts, np.int32(len(draft)),
            self._settings([req], 1),
        )  # fmt: skip
        self.inflight.append(slot_spec.VerifyBatch([(req, len(draft))], tokens, n_out))
        return True

    # -- reading results -----------------------------------------------------------------------
    def _read(self, item: inflight.Item) -> None:
        for req, tokens, lps in inflight.read(item, self.compile_s):
            self._deliver(req, tokens, lps)

    def _deliver(self, req: Request, tokens: list[int], lps=None) -> None:
        """Hand tokens to req (request.deliver); lps: their TokenLogprobs (host arrays)."""
        reason = deliver(req, tokens, lps)
        self.tokens_out += len(tokens)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: StopReason) -> None:
        if req.stream is None:
            req.stream = TextStream(None, max_new_tokens=0, limit=0, stop=())
        if req.stream.reason is None:
            req.stream.reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.decoding:
            self.decoding.remove(req)
        if req.slot is not None:
            if self.reuse_prefixes:
                self.slot_tokens[req.slot] = kept_tokens(req)
            self.free_slots.append(req.slot)
            req.slot = None
        req.timing.finished(self.compile_s)
        req.done.set()
        if req.on_done is not None:
            req.on_done(req)

    def _fail_all(self, error: BaseException) -> None:
        live = list(itertools.chain(self.waiting, self.prefilling, self.decoding))
        for req in live:
            req.error = error
            self._finish(req, StopReason.ERROR)
        self.inflight.clear()
        self.slot_tokens.clear()
        self.cache = self.state = None  # donated buffers may be gone: start from a fresh cache
