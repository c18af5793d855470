"""Logprobs and n > 1 choices in the engine (tiny random model, XLA path): each token's logprob and
top alternatives against log_softmax of the model's logits computed independently (prompt_logits,
the whole sequence at once), rows that ask for nothing unchanged beside rows that do, and
followers that share a leader's prefill getting the tokens they get alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine.sampling import (
    FULL_MODE,
    GREEDY_LOGPROBS_MODE,
    GREEDY_MODE,
    LOGPROBS_MODE,
    TOP_LOGPROBS,
    Sampler,
    SamplerMode,
)
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
HOT = Sampler(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)  # draws far from argmax


@pytest.fixture(scope="module")
def model():
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    return minfer_jax.load(
        gguf_model=gm, kernels="xla", weights="quantized", ctx_size=256, prefill_chunk=16
    )


def scheduler(model):
    """Every scheduler of this file has this plan: the executables compile once (~4 s each on
    2 busy cores), and prompts stay under one 16-token chunk."""
    return minfer_jax.Scheduler(model, model.plan(n_seqs=4, decode_steps=4))


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


def reference(model, ids, tokens) -> np.ndarray:
    """log_softmax of the logits at the positions that drew `tokens` ([len(tokens), vocab])."""
    logits = model.logits(ids + tokens)[len(ids) - 1 : len(ids) - 1 + len(tokens)]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def check_logprobs(model, ids, result, top: int, greedy: bool) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)
    ref = reference(model, ids, result.tokens)
    for row, token, entry in zip(ref, result.tokens, result.logprobs):
        assert entry.token == token
        np.testing.assert_allclose(entry.logprob, row[token], atol=2e-4)
        assert len(entry.top) == top
        alt_ids, alt_lps = [a for a, _ in entry.top], [b for _, b in entry.top]
        assert alt_lps == sorted(alt_lps, reverse=True)
        np.testing.assert_allclose(alt_lps, row[alt_ids], atol=2e-4)
        np.testing.assert_allclose(alt_lps, np.sort(row)[::-1][:top], atol=2e-4)
        if greedy:  # the drawn token is the most likely one
            assert top == 0 or alt_ids[0] == token


def test_logprobs_are_the_log_softmax_of_the_models_logits(model):
    """Greedy and sampled (hot: the temperature does not enter the reported distribution), in one
    batch beside a row that asks for nothing: that row's tokens are those it gets alone."""
    sched = scheduler(model)
    ids = prompt(15, 1)
    greedy = sched.submit(ids, max_new_tokens=10, logprobs=3)
    hot = sched.submit(prompt(9, 2), max_new_tokens=10, sampler=HOT, seed=5, logprobs=TOP_LOGPROBS)
    plain = sched.submit(prompt(12, 3), max_new_tokens=10, sampler=HOT, seed=6)
    sched.run([greedy, hot, plain])
    check_logprobs(model, greedy.prompt, greedy.result(), 3, greedy=True)
    check_logprobs(model, hot.prompt, hot.result(), TOP_LOGPROBS, greedy=False)
    drawn = hot.result().logprobs
    assert drawn is not None and any(e.token != e.top[0][0] for e in drawn)  # not all argmax
    assert plain.result().logprobs is None
    # beside rows that ask for nothing (the batch of the same width, without logprobs)
    alone = scheduler(model)
    again = [alone.submit(plain.prompt, max_new_tokens=10, sampler=HOT, seed=6)]
    again += [alone.submit(prompt(6, 4 + i), max_new_tokens=10, sampler=HOT) for i in (0, 1)]
    alone.run(again)
    assert again[0].result().tokens == plain.result().tokens
    # the library call: generate(..., logprobs=k) (one token: its prefill only compiles)
    lib = minfer_jax.generate(model, ids, max_new_tokens=1, logprobs=0)
    first = (greedy.result().logprobs or [])[0]
    assert lib.tokens == greedy.result().tokens[:1] and lib.logprobs is not None
    assert lib.logprobs[0].logprob == pytest.approx(first.logprob, abs=2e-4)
    assert lib.logprobs[0].top == ()


def test_a_logprobs_row_picks_the_logprobs_mode_and_bad_counts_are_refused(model):
    assert SamplerMode.of([Sampler(temperature=0.0)], logprobs=True) == GREEDY_LOGPROBS_MODE
    assert SamplerMode.of([HOT], logprobs=True).covers(GREEDY_LOGPROBS_MODE)
    assert not FULL_MODE.covers(GREEDY_LOGPROBS_MODE) and not GREEDY_MODE.logprobs
    assert GREEDY_LOGPROBS_MODE.join(FULL_MODE) == LOGPROBS_MODE
    plan = model.plan(n_seqs=2)
    # the ready set serves every batch (no compile while serving); greedy ones with logprobs get
    # their own executables in the background
    assert {k.mode for k in plan.ready_keys()} == {LOGPROBS_MODE}
    assert plan.ready_keys()[1].covers(plan.decode_key(1, 20, GREEDY_LOGPROBS_MODE))
    assert plan.decode_key(1, 20, GREEDY_LOGPROBS_MODE) in plan.serving_keys()
    sched = minfer_jax.Scheduler(model, plan)
    for bad in (-1, TOP_LOGPROBS + 1, 2.5):
        with pytest.raises(minfer_jax.InvalidArgumentError, match="logprobs"):
            sched.submit(prompt(5), logprobs=bad)


def test_n_choices_share_one_prefill(model):
    """A follower starts from a copy of its leader's slot and prefills its last prompt token only;
    each choice gets the tokens it gets alone with its seed (greedy: all the same)."""
    ids = prompt(14, 7)
    sched = scheduler(model)
    lead = sched.submit(ids, max_new_tokens=8, sampler=HOT, seed=11)
    rest = [
        sched.submit(ids, max_new_tokens=8, sampler=HOT, seed=11 + i, leader=lead) for i in (1, 2)
    ]
    sched.run([lead, *rest])
    assert lead.result().cached_tokens == 0
    assert [r.result().cached_tokens for r in rest] == [len(ids) - 1] * 2
    apart = scheduler(model)  # three unrelated requests: each prefills its whole prompt
    solos = [apart.submit(ids, max_new_tokens=8, sampler=HOT, seed=11 + i) for i in range(3)]
    apart.run(solos)
    assert [s.result().cached_tokens for s in solos] == [0, 0, 0]
    assert [r.result().tokens for r in [lead, *rest]] == [s.result().tokens for s in solos]
    assert len({tuple(r.result().tokens) for r in [lead, *rest]}) == 3
    # generate_batch: an equal prompt shares the first one's prefill (one token each: the same
    # executables as above)
    same = minfer_jax.generate_batch(
        model, [ids, ids], sampler=HOT, seed=[11, 12], max_new_tokens=1, max_batch=4
    )
    assert [r.tokens for r in same] == [r.result().tokens[:1] for r in (lead, rest[0])]
    assert [r.cached_tokens for r in same] == [0, len(ids) - 1]
