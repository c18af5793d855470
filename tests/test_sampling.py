"""The engine's sampler (engine/sampling.py): three static modes, every setting traced.

The filters are checked against a sort-based reference of llama.cpp's chain (top-k -> top-p ->
min-p on the top-k set at temperature 1); draws against the mode they run in (a row gets the same
token in any mode that serves it, so a sequence's samples do not depend on its batch)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minfer_jax.engine.sampling import (
    FULL_MODE,
    GREEDY,
    GREEDY_MODE,
    MODES,
    NARROW_CAP,
    SAMPLED_MODE,
    WIDE_CAP,
    RowSettings,
    Sampler,
    SamplerMode,
    first_max_index,
    keep_mask,
    row_keys,
    sample_rows,
)

VOCAB = 1000


def reference_keep(logits: np.ndarray, s: Sampler) -> set[int]:
    """The tokens llama.cpp's chain leaves a row, by sorting (ties broken by id, as a stable sort
    does)."""
    order = np.argsort(-logits, kind="stable")
    k = s.top_k if s.top_k > 0 else len(order)
    cand = order[:k]
    p = np.exp(logits[cand] - logits[cand].max())
    p /= p.sum()
    if s.top_p < 1.0:
        before = np.cumsum(p) - p
        cand, p = cand[before < s.top_p], p[before < s.top_p]
    if s.min_p > 0.0:
        keep = p >= s.min_p * p.max()
        cand = cand[keep]
    return set(cand.tolist())


SETTINGS = [
    Sampler(temperature=0.8, top_k=k, top_p=p, min_p=m)
    for k, p, m in itertools.product(
        (0, 1, 3, 40, 64, 65, 300), (1.0, 0.9, 0.5, 0.05), (0.0, 0.05, 0.3)
    )
    if (k, p, m) != (0, 1.0, 0.0)
]


@pytest.mark.parametrize("seed", [0, 1])
def test_filters_match_the_sorted_reference(seed):
    rng = np.random.default_rng(seed)
    logits = (
        rng.standard_normal((len(SETTINGS), VOCAB)) * rng.uniform(0.5, 4.0, (len(SETTINGS), 1))
    ).astype(np.float32)
    rows = RowSettings.of(SETTINGS, [0] * len(SETTINGS), vocab=VOCAB)
    got = np.asarray(keep_mask(jnp.asarray(logits), rows, WIDE_CAP))
    for i, s in enumerate(SETTINGS):
        assert set(np.flatnonzero(got[i]).tolist()) == reference_keep(logits[i], s), s


def test_every_setting_maps_to_one_of_three_modes():
    grid = [
        Sampler(temperature=t, top_k=k, top_p=p, min_p=m, repeat_penalty=r, repeat_last_n=n)
        for t, k, p, m, r, n in itertools.product(
            (0.0, 0.7), (0, 3, 64, 1000, 10**6), (1.0, 0.5), (0.0, 0.1), (1.0, 1.3), (0, 64, 4096)
        )
    ]
    assert {SamplerMode.of([s]) for s in grid} == set(MODES)
    assert SamplerMode.of([]) == GREEDY_MODE and SamplerMode.of([GREEDY, *grid]) == FULL_MODE
    assert (
        FULL_MODE.covers(SAMPLED_MODE)
        and SAMPLED_MODE.covers(GREEDY_MODE)
        and not SAMPLED_MODE.covers(FULL_MODE)
    )


def test_a_row_draws_the_same_token_in_every_mode_that_serves_it():
    """Rows whose filters fit NARROW_CAP candidates, and unfiltered ones, sample identically in the
    SAMPLED and the FULL mode (their batch decides the mode), and greedy rows take the argmax."""
    rng = np.random.default_rng(7)
    samplers = [
        Sampler(temperature=0.9, top_k=40),
        Sampler(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1),
        Sampler(temperature=0.5, top_k=NARROW_CAP, top_p=0.8),
        Sampler(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0),
        GREEDY,
    ]
    assert all(SAMPLED_MODE.covers(SamplerMode.of([s])) for s in samplers)
    n = len(samplers)
    history = jnp.full((n, 8), -1, jnp.int32)
    for trial in range(20):
        logits = jnp.asarray(rng.standard_normal((n, VOCAB)) * 3, jnp.float32)
        rows = RowSettings.of(samplers, list(range(trial, trial + n)), vocab=VOCAB)
        pos = jnp.arange(n, dtype=jnp.int32) + trial
        a = sample_rows(logits, pos, rows, history, SAMPLED_MODE)
        b = sample_rows(logits, pos, rows, history, FULL_MODE)
        assert a.tolist() == b.tolist()
        assert int(a[-1]) == int(jnp.argmax(logits[-1]))


def test_draws_follow_the_filtered_distribution():
    """top_k=2 with temperature 1 over logits (log 3, 0, -inf...): tokens 0 and 1 at 3:1."""
    logits = np.full((1, VOCAB), -30.0, np.float32)
    logits[0, :2] = [np.log(3.0), 0.0]
    s = Sampler(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    rows = RowSettings.of([s], [0], vocab=VOCAB)
    draw = jax.jit(
        lambda seed: sample_rows(
            jnp.asarray(logits),
            jnp.zeros((1,), jnp.int32),
            dataclasses.replace(rows, seed=seed[None]),
            jnp.zeros((1, 0), jnp.int32),
            SAMPLED_MODE,
        )
    )
    tokens = np.asarray([int(draw(jnp.uint32(i))[0]) for i in range(400)])
    assert set(tokens.tolist()) <= {0, 1}
    assert 0.65 < np.mean(tokens == 0) < 0.85  # 0.75 expected; 400 draws: sd 0.022


def test_seeds_use_all_64_bits_and_keep_the_32_bit_keys():
    pos = jnp.zeros((3,), jnp.int32)
    keys = row_keys(RowSettings.of([GREEDY] * 3, [42, 2**32 + 42, 2**64 - 1], vocab=VOCAB), pos)
    assert not np.array_equal(keys[0], keys[1]) and not np.array_equal(keys[1], keys[2])
    assert np.array_equal(keys[0], jax.random.fold_in(jax.random.PRNGKey(42), 0))


def test_the_repeat_penalty_reads_only_the_last_n_tokens():
    logits = jnp.asarray(np.tile(np.linspace(1.0, 2.0, VOCAB, dtype=np.float32), (2, 1)))
    top = VOCAB - 1  # the argmax; penalised, the runner-up wins
    history = jnp.asarray([[top, 5, 6, 7], [top, 5, 6, 7]], jnp.int32)  # oldest first
    samplers = [
        Sampler(temperature=0.0, repeat_penalty=1.5, repeat_last_n=4),
        Sampler(temperature=0.0, repeat_penalty=1.5, repeat_last_n=3),
    ]  # `top` is 4 tokens back
    out = sample_rows(
        logits,
        jnp.zeros((2,), jnp.int32),
        RowSettings.of(samplers, [0, 0], vocab=VOCAB),
        history,
        FULL_MODE,
    )
    assert out.tolist() == [top - 1, top]


def test_the_token_mask_limits_each_row_in_every_mode():
    """A row's bitmask leaves only its allowed tokens (greedy and drawn alike); an all-ones row
    samples exactly as without a mask."""
    from minfer_jax.engine.constraint import BannedTokens, batch_mask, clear_bits

    rng = np.random.default_rng(3)
    samplers = [GREEDY, Sampler(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0), GREEDY]
    allowed = [5, 37, 999]  # in three different 32-bit words
    mask = batch_mask([None, None, BannedTokens([0])], 3, VOCAB)
    for row in (0, 1):
        clear_bits(mask[row], [t for t in range(VOCAB) if t not in allowed])
    history = jnp.zeros((3, 0), jnp.int32)
    for trial in range(10):
        logits = jnp.asarray(rng.standard_normal((3, VOCAB)) * 3, jnp.float32)
        logits = logits.at[2, 0].set(100.0)  # the banned token would win row 2
        pos = jnp.full((3,), trial, jnp.int32)
        for mode in MODES:
            rows = RowSettings.of(samplers, [trial] * 3, vocab=VOCAB, mask=mask)
            out = sample_rows(logits, pos, rows, history, mode).tolist()
            assert out[0] in allowed and out[1] in allowed, (mode, out)
            assert out[0] == allowed[int(np.argmax(np.asarray(logits[0])[allowed]))]
            assert out[2] != 0 and out[2] == int(jnp.argmax(logits[2, 1:])) + 1
            free = RowSettings.of(samplers, [trial] * 3, vocab=VOCAB)
            masked_free = RowSettings.of(
                samplers, [trial] * 3, vocab=VOCAB, mask=batch_mask([], 3, VOCAB)
            )
            assert (
                sample_rows(logits, pos, free, history, mode).tolist()
                == sample_rows(logits, pos, masked_free, history, mode).tolist()
            )


def test_first_max_index_is_argmax_with_ties_infinities_and_nan():
    """The greedy pick's two-reduction argmax: the first maximum, -inf rows give 0, and a NaN
    counts as the maximum, as jnp.argmax."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1000)).astype(np.float32)
    x[1, [7, 500]] = 9.0  # a tie: the first
    x[2] = -np.inf
    x[3, [3, 900]] = np.nan
    x[4, 999] = np.inf
    x[5, [10, 20]] = [np.inf, np.nan]
    got = np.asarray(jax.jit(first_max_index)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.tolist()[1:] == [7, 0, 3, 999, 20] and got.dtype == np.int32
