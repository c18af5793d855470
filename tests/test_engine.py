"""The engine on a tiny random model (XLA path): chunked prefill, the plan of executables, batched
decode and the scheduler's continuous batching, each against running one sequence alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine.plan import Plan, PlanError
from minfer_jax.engine.sampling import MODES, Sampler
from minfer_jax.engine.text_stream import TextStream
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
SAMPLED = dict(
    temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=16
)


@pytest.fixture(scope="module")
def tiny_gguf():
    return synthetic_model_from_config(TINY, "q8_0", seed=3)


def load(gm, chunk=16, ctx=512):
    return minfer_jax.load(
        gguf_model=gm, kernels="xla", weights="quantized", ctx_size=ctx, prefill_chunk=chunk
    )


@pytest.fixture(scope="module")
def chunked(tiny_gguf):
    return load(tiny_gguf, chunk=16)


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


def test_plan_chunks_buckets_and_cache_length():
    plan = Plan(ctx=100, chunk=32, decode_steps=16)
    assert plan.chunks(3) == [(0, 16, 3)]
    assert plan.chunks(40) == [(0, 32, 32), (32, 16, 8)]
    assert plan.chunks(70) == [(0, 32, 32), (32, 32, 32), (64, 16, 6)]
    assert plan.cache_len == 256 and plan.cache_len % plan.chunk == 0 and plan.cache_len >= 100 + 16
    assert [Plan(ctx=64, n_seqs=5).rows(n) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]
    assert (
        Plan(ctx=64, n_seqs=1).n_slots == 1 and Plan(ctx=64, n_seqs=3).n_slots == 4
    )  # + scratch slot
    assert Plan(ctx=4096).span(300) == 512 and Plan(ctx=4096, spans=False).span(300) is None
    with pytest.raises(PlanError, match="power of two"):
        Plan(ctx=64, chunk=48)
    with pytest.raises(PlanError, match="n_seqs"):
        Plan(ctx=64, n_seqs=0)
    with pytest.raises(minfer_jax.ContextOverflowError):
        plan.chunks(101)


def test_chunks_from_any_start_stay_inside_the_slot():
    """Prefix reuse starts a prompt's chunks anywhere: they cover it exactly and never pad past the
    slot's cache positions (the padded tail of a 2048 bucket from 2775 would)."""
    rng = np.random.default_rng(0)
    for ctx, chunk, steps in ((3800, 2048, 16), (300, 256, 1), (5000, 512, 4)):
        plan = Plan(ctx=ctx, chunk=chunk, decode_steps=steps)
        for _ in range(300):
            start = int(rng.integers(0, ctx))
            n = int(rng.integers(1, ctx - start + 1))
            chunks = plan.chunks(n, start)
            assert chunks[0][0] == start and sum(size for _, _, size in chunks) == n
            assert all(s + b <= plan.cache_len and size <= b <= chunk for s, b, size in chunks)
            assert all(b & (b - 1) == 0 for _, b, _ in chunks)
    assert Plan(ctx=3800, chunk=2048).chunks(1025, 2775) == [(2775, 1024, 1024), (3799, 16, 1)]


@pytest.mark.parametrize("n", [15, 16, 17, 40, 100])
def test_chunked_prefill_matches_one_shot(tiny_gguf, chunked, n):
    """Prompts that cross chunk boundaries: the same greedy tokens and logits as one chunk."""
    one_shot = load(tiny_gguf, chunk=256)
    ids = prompt(n, seed=n)
    a = minfer_jax.generate(chunked, ids, max_new_tokens=6)
    b = minfer_jax.generate(one_shot, ids, max_new_tokens=6)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(
        chunked.logits(ids), one_shot.logits(ids), atol=1e-3, rtol=0
    )  # f16 weights, other sum orders


def test_prompt_length_does_not_add_prefill_executables(tiny_gguf):
    m = load(tiny_gguf, chunk=32)
    # distinct seeds: prompts sharing a prefix would reuse it (generate() keeps the model's
    # scheduler)
    minfer_jax.generate(m, prompt(20, 41), max_new_tokens=2)
    minfer_jax.generate(m, prompt(45, 42), max_new_tokens=2)
    before = {k for k in m._compiled if k.label.startswith("prefill")}
    minfer_jax.generate(m, prompt(300, 43), max_new_tokens=2)  # ten chunks
    after = {k for k in m._compiled if k.label.startswith("prefill")}
    assert after == before and {k.bucket for k in after} == {16, 32}


def test_batch_rows_decode_like_single_sequences(chunked):
    prompts = [prompt(5, 1), prompt(40, 2), prompt(23, 3)]  # 3 rows: padded to 4, one scratch row
    alone = [minfer_jax.generate(chunked, p, max_new_tokens=10).tokens for p in prompts]
    batch = minfer_jax.generate_batch(chunked, prompts, max_new_tokens=10)
    assert [r.tokens for r in batch] == alone
    seeds = [11, 12, 13]
    alone = [
        minfer_jax.generate(chunked, p, max_new_tokens=10, seed=s, **SAMPLED).tokens
        for p, s in zip(prompts, seeds)
    ]
    batch = minfer_jax.generate_batch(chunked, prompts, max_new_tokens=10, seed=seeds, **SAMPLED)
    assert [r.tokens for r in batch] == alone
    assert (
        alone[0]
        != minfer_jax.generate(chunked, prompts[0], max_new_tokens=10, seed=99, **SAMPLED).tokens
    )


def test_requests_join_and_leave_between_steps(chunked):
    """A request submitted while another decodes, one cancelled mid-run: each gets its own
    tokens."""
    sched = minfer_jax.Scheduler(chunked, chunked.plan(n_seqs=2, decode_steps=4))
    long = sched.submit(prompt(30, 4), max_new_tokens=24)
    for _ in range(4):
        sched.step()
    late = sched.submit(prompt(50, 5), max_new_tokens=9, sampler=Sampler(**SAMPLED), seed=3)
    doomed = sched.submit(prompt(8, 6), max_new_tokens=100)  # waits: both slots are taken
    for _ in range(3):
        sched.step()
    doomed.cancel()
    sched.run([long, late, doomed])
    assert doomed.result().stop_reason == "cancelled"
    assert (
        long.result().tokens
        == minfer_jax.generate(chunked, prompt(30, 4), max_new_tokens=24).tokens
    )
    assert (
        late.result().tokens
        == minfer_jax.generate(chunked, prompt(50, 5), max_new_tokens=9, seed=3, **SAMPLED).tokens
    )
    assert sorted(sched.free_slots) == [0, 1] and not sched.busy


def test_short_prompts_prefill_together_up_to_the_chunk_budget(tiny_gguf):
    """Prompts waiting together start in the same step while their chunks fit plan.chunk tokens (a
    server's clients arriving at once), instead of one prompt per decode chunk; a long prompt still
    takes one budget per step."""
    m = load(tiny_gguf, chunk=32)
    sched = minfer_jax.Scheduler(m, m.plan(n_seqs=4, decode_steps=4))
    reqs = [
        sched.submit(prompt(5, 10 + i), max_new_tokens=6) for i in range(3)
    ]  # 16-token buckets: 2 fit in 32
    long = sched.submit(prompt(80, 13), max_new_tokens=6)  # chunks of 32, 32, 16
    sched.step()
    assert [r in sched.decoding for r in reqs] == [True, True, False] and long in sched.prefilling
    sched.step()  # the third short prompt (16) and the long prompt's first chunk (32)
    assert reqs[2] in sched.decoding and len(long.chunks) == 2
    sched.run([*reqs, long])
    for i, r in enumerate(reqs):
        assert (
            r.result().tokens == minfer_jax.generate(m, prompt(5, 10 + i), max_new_tokens=6).tokens
        )
    assert long.result().tokens == minfer_jax.generate(m, prompt(80, 13), max_new_tokens=6).tokens


def test_serving_keys_leave_nothing_to_compile(tiny_gguf):
    """What the server warms up (plan.serving_keys) is every executable its requests then run."""
    m = load(tiny_gguf, chunk=32, ctx=200)
    sched = minfer_jax.Scheduler(m, m.plan(n_seqs=4, ctx=200, decode_steps=4))
    greedy = Sampler(temperature=0.0)  # what submit() uses without a sampler
    keys = sched.plan.serving_keys([sched.mode([greedy])])
    assert len(keys) == 2 + 3  # prefill 16, 32; decode at 1, 2, 4 rows
    sched.compile(keys)
    before = dict(m._compiled)
    reqs = [
        sched.submit(prompt(n, n), max_new_tokens=7) for n in (3, 20, 45, 70, 9)
    ]  # 5 requests, 4 slots
    sched.run(reqs)
    assert all(r.result().stop_reason == "length" for r in reqs)
    assert dict(m._compiled) == before


def test_no_sampler_setting_compiles_once_serving_keys_are_compiled(tiny_gguf):
    """Sampler settings are traced values of three modes: once plan.serving_keys() is compiled,
    no setting a request may carry (top_k 3 / 9 / 1000, top-p alone, a long repeat window, ...)
    compiles anything, alone or mixed in one batch."""
    m = load(tiny_gguf, chunk=32, ctx=200)
    sched = minfer_jax.Scheduler(m, m.plan(n_seqs=4, ctx=200, decode_steps=4))
    keys = sched.plan.serving_keys(MODES)  # the samplers' (greedy with logprobs aside)
    assert (
        len(keys) == 2 * 2 + 3 * 3
    )  # prefill 16, 32 (greedy, full); decode 1, 2, 4 rows x 3 modes
    sched.compile(keys)
    before = dict(m._compiled)
    samplers = [
        Sampler(temperature=0.7, top_k=k, top_p=p, min_p=mp, repeat_penalty=r, repeat_last_n=n)
        for k, p, mp, r, n in [
            (3, 1.0, 0.0, 1.0, 64),
            (9, 0.9, 0.05, 1.0, 64),
            (1000, 0.95, 0.0, 1.0, 64),
            (0, 0.5, 0.0, 1.0, 64),
            (40, 0.95, 0.05, 1.3, 200),
            (0, 1.0, 0.2, 1.0, 0),
        ]
    ]
    samplers.append(Sampler(temperature=0.0, repeat_penalty=1.2, repeat_last_n=7))
    reqs = [
        sched.submit(prompt(5 + 7 * i, 60 + i), max_new_tokens=6, sampler=s, seed=i)
        for i, s in enumerate(samplers)
    ]
    sched.run(reqs)
    assert all(r.result().stop_reason == "length" for r in reqs)
    assert dict(m._compiled) == before


def _join_while_it_compiles(thread, model, idle_s: float = 120.0) -> None:
    """thread.join() with a deadline on progress, not on the whole warm-up: each executable must
    come within idle_s. The whole was join(120): its 15 keys took 64 s with a cold executable
    store at load 11 on the shared 2-core machine (2026-12-07); a stuck warm-up stops adding keys
    and still fails."""
    import time

    seen, last = len(model.compiled_keys()), time.monotonic()
    while thread.is_alive():
        thread.join(1.0)
        if len(model.compiled_keys()) != seen:
            seen, last = len(model.compiled_keys()), time.monotonic()
        assert time.monotonic() - last < idle_s, f"no executable compiled for {idle_s} s"


def test_ready_keys_stand_in_for_everything_while_the_rest_compiles(tiny_gguf):
    """A server compiles plan.ready_keys() and serves: every request runs on them (more rows, a
    larger bucket, the FULL mode) with the tokens its own executables give, nothing compiles on the
    loop, and the background warm-up then compiles the rest, which later steps use."""
    import threading

    from minfer_jax.engine.warmup import Warmup, background_order

    m = load(tiny_gguf, chunk=32, ctx=200)
    plan = m.plan(n_seqs=4, ctx=200, decode_steps=4)
    sched = minfer_jax.Scheduler(m, plan, compile_in_loop=False)
    warm = Warmup(m, plan)
    warm.ready()
    assert set(m.compiled_keys()) == set(plan.ready_keys())
    samplers = [Sampler(temperature=0.0), Sampler(**SAMPLED), Sampler(temperature=0.8, top_k=5)]
    reqs = [
        sched.submit(prompt(9 + 20 * i, 80 + i), max_new_tokens=6, sampler=s, seed=i)
        for i, s in enumerate(samplers)
    ]
    sched.run(reqs)
    assert set(m.compiled_keys()) == set(plan.ready_keys()) and sched.stand_ins > 0
    for i, (r, s) in enumerate(zip(reqs, samplers)):
        alone = load(tiny_gguf, chunk=32, ctx=200)
        want = minfer_jax.generate(
            alone,
            prompt(9 + 20 * i, 80 + i),
            max_new_tokens=6,
            seed=i,
            **{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
        )
        assert r.result().tokens == want.tokens
    assert len(background_order(plan)) == len(set(plan.serving_keys()) - set(plan.ready_keys()))
    _join_while_it_compiles(warm.start_background(threading.Event()), m)
    assert warm.done.is_set() and warm.error is None
    assert set(plan.serving_keys()) <= set(m.compiled_keys())
    used = sched.stand_ins
    req = sched.submit(prompt(5, 90), max_new_tokens=6)
    sched.run([req])
    assert sched.stand_ins == used  # its own executables now exist


@pytest.mark.real_model
@pytest.mark.parametrize("steps", [1, 4])
def test_text_streams_at_most_decode_steps_tokens_per_event(real_model, steps):
    """Each on_text event carries the text of at most plan.decode_steps new tokens (the server's
    default of 1: every token as it is made), with three sequences decoding together."""
    m = minfer_jax.load(gguf_model=real_model, ctx_size=256)
    sched = minfer_jax.Scheduler(m, m.plan(n_seqs=3, decode_steps=steps))
    prompts = ["def fibonacci(n):", "import numpy as np\n", "class Stack:"]
    events: dict[int, list[int]] = {i: [] for i in range(3)}
    reqs: list = []

    def watch(i):
        return lambda piece: events[i].append(len(reqs[i].stream.tokens) - sum(events[i]))

    for i, p in enumerate(prompts):
        reqs.append(sched.submit(m.encode(p), max_new_tokens=12, on_text=watch(i)))
    sched.run(reqs)
    for i, r in enumerate(reqs):
        n = len(r.result().tokens)
        assert n >= 4 and sum(events[i]) == n, (events[i], r.result().stop_reason)
        assert max(events[i]) <= steps and len(events[i]) >= n // steps, events[i]


def test_a_request_whose_start_fails_ends_with_the_error_and_frees_its_slot(chunked):
    """A compile (or cache allocation) that raises while a request starts ends that request with
    the error instead of leaving it waiting forever, and its slot serves the next request."""
    sched = minfer_jax.Scheduler(chunked, chunked.plan(n_seqs=1, decode_steps=4))

    def fail(keys):
        raise RuntimeError("compile failed")

    sched.compile = fail
    req = sched.submit(prompt(9, 30), max_new_tokens=3)
    with pytest.raises(RuntimeError, match="compile failed"):
        sched.step()
    assert req.done.is_set() and isinstance(req.error, RuntimeError)
    assert sched.free_slots == [0] and not sched.busy
    del sched.compile  # the class's own again
    after = sched.submit(prompt(9, 31), max_new_tokens=3)
    sched.run([after])
    assert after.error is None and len(after.result().tokens) == 3


def fresh_run(model, ids, n):
    """ids' greedy tokens through a new scheduler: nothing kept to reuse
    (generate() keeps the model's)."""
    sched = minfer_jax.Scheduler(model, model.plan(decode_steps=4))
    req = sched.submit(ids, max_new_tokens=n)
    sched.run([req])
    assert req.result().cached_tokens == 0
    return req.result().tokens


def test_prefix_reuse_skips_what_a_slot_still_holds(chunked):
    """A prompt that starts like a finished sequence (a shared system prompt, or the conversation so
    far) prefills only past the shared prefix in that sequence's slot, and gets the same tokens as
    when run alone; a prompt that shares nothing takes a slot that keeps nothing."""
    sched = minfer_jax.Scheduler(chunked, chunked.plan(n_seqs=2, decode_steps=4))
    system = prompt(37, 20)
    first = sched.submit(system + prompt(5, 21), max_new_tokens=6)
    sched.run([first])
    other = sched.submit(prompt(9, 22), max_new_tokens=3)  # shares nothing: the empty slot
    turn = (
        first.prompt + first.result().tokens + prompt(4, 23)
    )  # the conversation so far + a new message
    again = sched.submit(turn, max_new_tokens=6)
    sched.run([other, again])
    sibling = sched.submit(
        system + prompt(6, 24), max_new_tokens=6
    )  # the same system prompt, another question
    sched.run([sibling])
    assert other.result().cached_tokens == 0
    assert again.result().cached_tokens == len(first.prompt) + len(first.result().tokens) - 1
    assert sibling.result().cached_tokens == len(system)
    for r in (first, other, again, sibling):
        assert r.result().tokens == fresh_run(chunked, r.prompt, len(r.result().tokens))


def test_prefix_reuse_after_a_cancel_mid_prefill(chunked):
    """A request cancelled between its prompt chunks leaves only the dispatched chunks' K/V to
    reuse."""
    sched = minfer_jax.Scheduler(chunked, chunked.plan(n_seqs=1, decode_steps=4))
    long = prompt(60, 30)  # chunks of 16
    doomed = sched.submit(long, max_new_tokens=5)
    sched.step()  # one 16-token chunk: the whole per-step budget
    doomed.cancel()
    sched.run([doomed])
    assert doomed.result().stop_reason == "cancelled" and sched.slot_tokens[0] == long[:16]
    again = sched.submit(long, max_new_tokens=5)
    sched.run([again])
    assert again.result().cached_tokens == 16
    assert again.result().tokens == fresh_run(chunked, long, 5)


def test_lengths_and_context_limit(tiny_gguf):
    m = load(tiny_gguf, chunk=16, ctx=40)
    r = minfer_jax.generate(m, prompt(30), max_new_tokens=100, decode_steps=4)
    assert r.stop_reason == "context" and len(r.prompt_tokens) + len(r.tokens) == 40
    for n in (0, 1, 6):  # late stops inside a 4-token chunk are cut exactly
        r = minfer_jax.generate(m, prompt(10), max_new_tokens=n, decode_steps=4)
        assert len(r.tokens) == n and r.stop_reason == "length"
    with pytest.raises(minfer_jax.ContextOverflowError):
        minfer_jax.generate(m, prompt(40), max_new_tokens=1)
    with pytest.raises(minfer_jax.InvalidArgumentError, match="outside the vocabulary"):
        minfer_jax.generate(m, [1, TINY.vocab_size], max_new_tokens=1)
    with pytest.raises(minfer_jax.InvalidArgumentError, match="empty"):
        minfer_jax.generate(m, [], max_new_tokens=1)
    sched = minfer_jax.Scheduler(m, m.plan())
    with pytest.raises(
        minfer_jax.InvalidArgumentError, match="outside the vocabulary"
    ):  # submit's own check
        sched.submit([1, TINY.vocab_size], max_new_tokens=1)


@pytest.mark.real_model
def test_text_stream_stops_across_chunks_and_holds_back(real_model):
    from minfer_jax.files.tokenizer import Tokenizer

    tok = Tokenizer.from_model(real_model)
    ids = tok.encode("def fibonacci(n):\n    if n <= 1:\n        return n", add_special=False)
    stream = TextStream(tok, max_new_tokens=100, limit=100, stop=["<= 1"])
    pieces = []
    for t in ids:
        stream.push(t)
        pieces.append(stream.take())
    assert stream.reason == "stop" and stream.text == "def fibonacci(n):\n    if n "
    assert "".join(pieces) == stream.text and "<" not in "".join(pieces)
    stream = TextStream(tok, max_new_tokens=3, limit=100, stop=[])
    for t in ids:
        stream.push(t)
    assert stream.reason == "length" and stream.tokens == ids[:3]
