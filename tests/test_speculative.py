"""Speculative decoding (issue 55): prompt lookup drafts, verified 1 + K rows per step.

Greedy and sampled output are the plain decoder's, token for token (the acceptance is coupled to
the plain sampler's draw, engine/verify.py); the first sampled token after a draft follows the
model's distribution (a chi-square test over many seeds, with a control it must reject);
rejected drafts leave nothing behind (a later request reusing the slot's prefix gets a fresh
slot's tokens).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import minfer_jax
from minfer_jax.cli.arguments import build_parser
from minfer_jax.engine import plan as plan_mod
from minfer_jax.engine import spec_plan
from minfer_jax.engine.lookup import Drafter, Speculation, check_speculation, speculation_of
from minfer_jax.engine.sampling import GREEDY_MODE, SAMPLED_MODE, RowSettings, Sampler
from minfer_jax.engine.spec_flags import speculation_from_args
from minfer_jax.engine.steps import init_slot_state, prefill_chunk
from minfer_jax.engine.verify import verify_chunk
from minfer_jax.errors import InvalidArgumentError
from tests.configs import tiny_config

from minfer_bench.spec_replay import replayed
from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
SAMPLED = dict(
    temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=16
)


@pytest.fixture(scope="module")
def tiny():
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    return minfer_jax.load(
        gguf_model=gm, kernels="xla", weights="quantized", ctx_size=512, prefill_chunk=16
    )


def ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


def prompts():
    """Nothing to copy; a block quoted twice (the output may re-emit it); a block whose repeat
    is cut short, so lookup drafts what the model may not say."""
    block = ids(24, 7)
    return {
        "plain": ids(30, 1),
        "copying": ids(6, 2) + block + ids(5, 3) + block[:8],
        "misleading": block + ids(4, 4) + block[:3],
    }


@pytest.mark.parametrize("name", ["plain", "copying", "misleading"])
def test_greedy_tokens_are_plain_decodings(tiny, name):
    prompt = prompts()[name]
    plain = minfer_jax.generate(tiny, prompt, max_new_tokens=40)
    spec = minfer_jax.generate(tiny, prompt, max_new_tokens=40, speculative="lookup")
    assert spec.tokens == plain.tokens
    assert spec.speculation is not None and plain.speculation is None


def test_drafts_are_accepted_and_rejected_and_both_leave_plain_tokens(tiny):
    """Across the prompts some drafts were accepted (steps of several tokens) and some rejected
    (rolled back), with every sequence's tokens the plain ones (test above)."""
    total = [0, 0]
    for prompt in prompts().values():
        s = minfer_jax.generate(tiny, prompt, max_new_tokens=40, speculative="lookup").speculation
        total[0] += s.accepted
        total[1] += s.drafted - s.accepted
    assert total[0] > 10 and total[1] > 0


def test_sampled_tokens_are_plain_samplings(tiny):
    """Same seed, same tokens (the repeat penalty's window grows with the accepted drafts)."""
    for name, prompt in prompts().items():
        for seed in (0, 5):
            plain = minfer_jax.generate(tiny, prompt, max_new_tokens=24, seed=seed, **SAMPLED)
            spec = minfer_jax.generate(
                tiny, prompt, max_new_tokens=24, seed=seed, speculative="lookup", draft_max=3,
                **SAMPLED,
            )  # fmt: skip
            assert spec.tokens == plain.tokens, (name, seed)


def test_a_rejected_draft_leaves_no_trace_in_the_slot(tiny):
    """After a speculating request with rejections, a request extending its prompt and output
    reuses the slot's K/V (prefix reuse) and gets the tokens a fresh slot gives it."""
    for seed in range(20):  # a prompt whose drafts the model rejects at least once
        prompt = ids(10, 100 + seed) + ids(6, 7) + ids(4, 200 + seed) + ids(3, 7)
        first = minfer_jax.generate(tiny, prompt, max_new_tokens=30, speculative="lookup")
        if first.speculation.drafted > first.speculation.accepted:
            break
    else:
        raise AssertionError("no prompt made the model reject a draft")
    follow = prompt + first.tokens + ids(3, 9)
    reused = minfer_jax.generate(tiny, follow, max_new_tokens=12)
    assert reused.cached_tokens > len(prompt)  # it did reuse the speculating request's slot
    fresh = minfer_jax.generate(tiny, follow, max_new_tokens=12, decode_steps=8)  # new scheduler
    assert fresh.cached_tokens == 0 and reused.tokens == fresh.tokens


def _sampling_setup(model, prompt):
    """The cache and slot state after prefilling prompt[:-1]... fed like the scheduler does, so
    that verify_chunk feeds prompt[-1] at position len(prompt) - 1."""
    plan = model.plan()
    cache = model.new_cache(1, plan.cache_len)
    state = init_slot_state(1, 0)
    head = prompt[:-1]
    tokens = np.zeros((32,), np.int32)
    tokens[: len(head)] = head
    rows = RowSettings.of([Sampler(temperature=0.0)], [0], vocab=model.config.vocab_size)
    fn = jax.jit(
        lambda p, c, s, t, n: prefill_chunk(
            p,
            c,
            s,
            t,
            jnp.int32(0),
            jnp.int32(0),
            n,
            jnp.zeros((0,), jnp.int32),
            rows,
            cfg=model.config,
            impl=model.impl,
            mode=GREEDY_MODE,
        )  # fmt: skip
    )
    _, state, cache = fn(model.params, cache, state, tokens, jnp.int32(len(head)))
    state = state.__class__(
        last_token=state.last_token.at[0].set(prompt[-1]), history=state.history
    )
    return cache, state


def test_sampled_acceptance_keeps_the_model_distribution(tiny):
    """The token drawn after the fed one, over 2000 seeds with a fixed draft d of moderate
    probability: its counts fit p (softmax of logits / T) by chi-square, and the distribution of a
    wrong rejection rule is rejected by the same bound."""
    prompt = ids(12, 21)
    logits = tiny.logits(prompt)[-1].astype(np.float64)  # a random model's: nearly flat

    def softmax(temperature):
        p = np.exp((logits - logits.max()) / temperature)
        return p / p.sum()

    # the temperature that makes the likeliest token neither certain nor rare: the draft
    temperature = next(t for t in (0.01, 0.02, 0.03, 0.05, 0.08) if softmax(t).max() < 0.6)
    p = softmax(temperature)
    draft = int(np.argmax(p))
    assert 0.1 < p[draft] < 0.6
    cache, state = _sampling_setup(tiny, prompt)
    sampler = Sampler(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)

    def first_token(rows):
        return verify_chunk(
            tiny.params, cache, state, jnp.int32(0), jnp.int32(len(prompt) - 1),
            jnp.asarray([draft], jnp.int32), jnp.int32(1), rows, cfg=tiny.config,
            impl=tiny.impl, mode=SAMPLED_MODE,
        )[0][0]  # fmt: skip

    vocab, n = tiny.config.vocab_size, 2000
    seeds = RowSettings.of([sampler] * n, range(n), vocab=vocab)
    per_seed = jax.tree.map(lambda a: a[:, None], seeds)  # one [1]-row setting per seed
    draws = np.asarray(jax.jit(jax.vmap(first_token))(per_seed))
    counts = np.bincount(draws, minlength=vocab)
    bins = p * n >= 5  # tokens expected 5+ times each get a bin, the rest share one
    observed = np.append(counts[bins], counts[~bins].sum())

    def chi2(q):
        expected = np.append(q[bins], q[~bins].sum()) * n
        return float((((observed - expected) ** 2) / np.maximum(expected, 1e-12)).sum())

    bound = stats.chi2.ppf(0.9995, bins.sum())  # df: the bins less one, plus the pooled bin
    assert chi2(p) < bound
    # the classic mistake, redrawing from p without removing d after a rejection, gives d
    # p(d) (2 - p(d)): the test must see it
    naive = p * (1 - p[draft])
    naive[draft] = p[draft] * (2 - p[draft])
    assert chi2(naive) > bound


def test_lookup_drafts_the_longest_latest_match_and_continues_periodically():
    d = Drafter(Speculation(draft_max=7, ngram_max=3, ngram_min=1))
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at the start: its continuation, not (2, 3)'s latest (7, 8)
    assert d.propose(seq, room=100) == [4, 5, 9, 2, 3, 7, 8]
    d2 = Drafter(Speculation(draft_max=5, ngram_max=2, ngram_min=2))
    assert d2.propose([5, 6, 6, 6], room=100) == [6, 6, 6, 6, 6]  # period 1, run into the end
    assert d2.propose([5, 6, 6, 6, 7], room=3) in ([], None)  # no 2-gram (6, 7) before: no draft
    d3 = Drafter(Speculation(draft_max=7, draft_min=3, ngram_max=2, ngram_min=1))
    assert d3.propose([1, 2, 1], room=3) is None  # 2 tokens of room: shorter than draft_min
    assert d3.propose([1, 2, 1], room=100) == [2, 1, 2, 1, 2, 1, 2]


def test_draft_length_adapts_and_drafting_pauses_where_it_does_not_pay():
    d = Drafter(Speculation(draft_max=7))
    d.record(7, 1)  # nothing accepted
    assert d.pacing.k == 3
    for _ in range(4):
        d.record(3, 1)
    assert d.pacing.pause > 0  # the running mean fell below PAYS: plain chunks for a while
    pause = d.pacing.pause
    assert all(d.propose([1, 2, 1, 2], room=50) is None for _ in range(pause))
    d.record(1, 2)
    assert d.pacing.k == 3  # a whole draft accepted: the next bucket up
    assert d.stats.verify_steps == 6 and d.stats.accepted == 1 and d.stats.plain_chunks == pause
    misses = Drafter(Speculation(ngram_min=2))  # nothing repeats: every lookup misses
    waits = []
    for i in range(4):
        assert misses.propose(list(range(10 + i)), room=50) is None
        assert misses.pacing.pause == 2**i - 1
        waits.append(misses.wants_tokens)
        while misses.pacing.pause:
            misses.propose([], room=50)  # paused: plain chunks without reading the sequence
    assert waits == [True, False, False, False]


def test_verify_buckets_are_bounded_and_compiled_with_the_request(tiny):
    assert [spec_plan.draft_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15)] == [
        1,
        1,
        3,
        3,
        7,
        7,
        15,
        15,
    ]
    with pytest.raises(plan_mod.PlanError):
        spec_plan.draft_bucket(16)
    sched = tiny.scheduler(1)
    keys = sched.needed(20, 10, Sampler(temperature=0.0), speculation=Speculation(draft_max=3))
    assert sorted(k.drafts for k in keys if isinstance(k, spec_plan.VerifyKey)) == [1, 3]


def test_refusals_say_what_is_missing():
    with pytest.raises(InvalidArgumentError, match="not implemented"):
        speculation_of("draft-eagle3")
    with pytest.raises(InvalidArgumentError, match="speculative"):
        speculation_of("ngram-fancy")
    with pytest.raises(InvalidArgumentError, match="draft_max"):
        speculation_of("lookup", draft_max=16)
    with pytest.raises(InvalidArgumentError, match="need speculative"):
        speculation_of(None, draft_max=4)
    hybrid = types.SimpleNamespace(recurrent_layer_ids=(0, 1, 2), family="qwen35")
    check_speculation(hybrid, None)  # rolled back by snapshots (tests/test_hybrid_speculative.py)
    dense = types.SimpleNamespace(recurrent_layer_ids=(), family="qwen2")
    with pytest.raises(InvalidArgumentError, match="grammar"):
        check_speculation(dense, types.SimpleNamespace(dynamic=True))
    check_speculation(dense, None)


def test_generate_refuses_speculation_with_a_grammar_row(tiny):
    constraint = types.SimpleNamespace(dynamic=True)
    sched = tiny.scheduler(1)
    with pytest.raises(InvalidArgumentError, match="grammar"):
        sched.submit(ids(5, 0), constraint=constraint, speculation=Speculation())


def test_cli_flags_take_llama_cpp_spellings():
    parse = build_parser().parse_args
    spec = speculation_from_args(parse(["--spec-type", "ngram-simple", "--draft-max", "3"]))
    assert spec == Speculation(kind="ngram-simple", draft_max=3)
    spec = speculation_from_args(
        parse(["--spec-type", "lookup", "--spec-draft-n-max", "5", "--spec-draft-n-min", "2"])
    )
    assert (spec.draft_max, spec.draft_min) == (5, 2)
    assert speculation_from_args(parse(["--draft-max", "3"])) is None
    with pytest.raises(InvalidArgumentError, match="not implemented"):
        speculation_from_args(parse(["--spec-type", "draft-eagle3"]))


def test_the_server_refuses_speculative_fields_with_a_reason():
    from minfer_jax.server import schemas

    body = b'{"prompt": "hi", "speculative.type": "draft-mtp"}'  # n_max etc.: test_server_spec
    with pytest.raises(schemas.BadRequest, match="--spec-type") as e:
        schemas.parse(schemas.CompletionRequest, body)
    assert e.value.param == "speculative.type"


def test_right_partly_right_and_wrong_drafts_all_give_plain_tokens(tiny):
    """Drafts replayed from the plain output, spoiled on purpose (last token, first token,
    none): accepted up to the first wrong token, the rest rolled back, the tokens the plain ones
    (greedy and sampled with the penalty)."""
    prompt = ids(20, 31)
    for settings in ({}, SAMPLED):
        plain = minfer_jax.generate(tiny, prompt, max_new_tokens=24, seed=4, **settings)
        sampler = None if not settings else Sampler(**settings)
        spec = replayed(tiny, prompt, plain.tokens, draft_max=3, sampler=sampler, seed=4)
        s = spec.speculation
        assert s.verify_steps >= 6 and 0 < s.accepted < s.drafted
        assert spec.tokens == plain.tokens
