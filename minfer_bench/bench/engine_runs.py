"""Timed runs of the engine's own executables, for the model tests and the batched mode.

Every run allocates its KV cache and slot state before the timer, fills `depth` positions of each
sequence untimed (llama-bench's -d), then times prefill chunks and one decode executable of all
the test's steps, exactly the executables the scheduler runs (plan.py keys), ending on
block_until_ready. Prompts are random token ids (speed does not depend on them).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from minfer_jax.engine import steps
from minfer_jax.engine.plan import Plan
from minfer_jax.engine.sampling import GREEDY, GREEDY_MODE, RowSettings


@dataclasses.dataclass
class Runner:
    """One model and plan: compiles the plan's executables once and runs them on fresh caches."""

    model: object
    plan: Plan
    seed: int = 0
    compile_s: float = 0.0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.rows1 = RowSettings.of([GREEDY], [0], vocab=self.model.config.vocab_size)
        self.history = np.full((self.plan.history,), -1, np.int32)
        self.seen = set()

    def exe(self, key):
        """The key's executable; compile_s sums each key's compile cost once (now or earlier)."""
        exe, _ = self.model.executable(key)
        if key not in self.seen:
            self.seen.add(key)
            self.compile_s += self.model.compile_seconds(key)
        return exe

    def fresh(self):
        m, p = self.model, self.plan
        cache = m.new_cache(p.n_slots, p.cache_len)  # sharded under tensor parallelism
        return jax.block_until_ready((cache, steps.init_slot_state(p.n_slots, p.history)))

    def prepare(self, n_prompt: int, start: int, rows: int = 1) -> list:
        """Compile the prefill buckets of n_prompt tokens from `start` and the decode rows; the
        chunks."""
        chunks = self.plan.chunks(n_prompt, start) if n_prompt else []
        for _, bucket, _ in chunks:
            self.exe(self.plan.prefill_key(bucket, GREEDY_MODE))
        return chunks

    def prefill(self, cache, state, slot: int, chunks: Sequence[tuple[int, int, int]]):
        """Dispatch one sequence's prefill chunks (random tokens); returns (cache, state)."""
        vocab = self.model.config.vocab_size
        for start, bucket, n_valid in chunks:
            tokens = self.rng.integers(0, vocab, bucket).astype(np.int32)
            exe = self.exe(self.plan.prefill_key(bucket, GREEDY_MODE))
            _, state, cache = exe(
                self.model.params,
                cache,
                state,
                tokens,
                np.int32(slot),
                np.int32(start),
                np.int32(n_valid),
                self.history,
                self.rows1,
            )
        return cache, state

    def decode(self, cache, state, slots: Sequence[int], position: int):
        """Dispatch one decode executable (plan.decode_steps tokens) for rows `slots` at
        `position`."""
        n = len(slots)
        key = self.plan.decode_key(n, position + self.plan.decode_steps, GREEDY_MODE)
        exe = self.exe(key)
        rows = self.plan.rows(n)
        slot_arr = np.full((rows,), self.plan.scratch_slot, np.int32)
        slot_arr[:n] = slots
        positions = np.full((rows,), position, np.int32)
        return exe(
            self.model.params,
            cache,
            state,
            slot_arr,
            positions,
            RowSettings.of([GREEDY] * rows, [0] * rows, vocab=self.model.config.vocab_size),
        )


def time_sequence(
    model,
    *,
    n_prompt: int,
    n_gen: int,
    depth: int,
    n_ctx: int,
    reps: int,
    warmup: bool,
    seed: int = 0,
    log=lambda s: None,
) -> tuple[list[int], float, Plan]:
    """llama-bench's ppN / tgN / pgN+M at depth d for one sequence:
    (samples ns, compile s, plan)."""
    plan = model.plan(ctx=n_ctx, decode_steps=max(n_gen, 1))
    runner = Runner(model, plan, seed)
    fill = runner.prepare(depth, 0)
    chunks = runner.prepare(n_prompt, depth)
    if n_gen:
        runner.exe(plan.decode_key(1, depth + n_prompt + n_gen, GREEDY_MODE))

    def once() -> int:
        cache, state = runner.fresh()
        if fill:
            cache, state = jax.block_until_ready(runner.prefill(cache, state, 0, fill))
        t0 = time.perf_counter_ns()
        cache, state = runner.prefill(cache, state, 0, chunks)
        out = runner.decode(cache, state, [0], depth + n_prompt) if n_gen else (cache, state)
        jax.block_until_ready(out)
        return time.perf_counter_ns() - t0

    if warmup:
        once()
    samples = []
    for i in range(reps):
        samples.append(once())
        log(f"run {i + 1}/{reps}: {samples[-1] / 1e6:.3f} ms")
    return samples, runner.compile_s, plan


def time_batched(model, *, n_pp: int, n_tg: int, n_seqs: int, seed: int = 0) -> dict:
    """llama-batched-bench's row for B = n_seqs sequences of n_pp prompt + n_tg generated tokens."""
    plan = model.plan(n_seqs=n_seqs, ctx=n_pp + n_tg + 1, decode_steps=max(n_tg, 1))
    runner = Runner(model, plan, seed)
    chunks = runner.prepare(n_pp, 0)
    slots = list(range(n_seqs))
    runner.exe(plan.decode_key(n_seqs, n_pp + n_tg, GREEDY_MODE))

    def once() -> tuple[float, float]:
        cache, state = runner.fresh()
        t0 = time.perf_counter()
        for s in slots:
            cache, state = runner.prefill(cache, state, s, chunks)
        cache, state = jax.block_until_ready((cache, state))
        t1 = time.perf_counter()
        jax.block_until_ready(runner.decode(cache, state, slots, n_pp) if n_tg else cache)
        return t1 - t0, time.perf_counter() - t1

    once()  # warm-up
    t_pp, t_tg = once()
    n_kv = n_seqs * (n_pp + n_tg)
    return {
        "PP": n_pp,
        "TG": n_tg,
        "B": n_seqs,
        "N_KV": n_kv,
        "T_PP s": t_pp,
        "S_PP t/s": n_seqs * n_pp / t_pp,
        "T_TG s": t_tg,
        "S_TG t/s": n_seqs * n_tg / t_tg if n_tg else float("nan"),
        "T s": t_pp + t_tg,
        "S t/s": n_kv / (t_pp + t_tg),
        "compile_s": runner.compile_s,
    }
