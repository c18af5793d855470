"""Speculation per slot (issue 55): a batch of the server's continuous batching mixes drafting and
plain rows in one verification step (engine/verify_batch.py, engine/slot_spec.py).

Every row's tokens are the ones it gets without speculation, bit for bit on the CPU: greedy rows
and a sampled one (the acceptance is coupled to the plain sampler's draw), drafts accepted and
rejected, rows that draft nothing beside them. The plan of a speculating server holds the
verification executables, and a plain one none.
"""

from __future__ import annotations

import numpy as np
import pytest

import minfer_jax
from minfer_jax.engine import plan as plan_mod
from minfer_jax.engine import spec_plan
from minfer_jax.engine.lookup import Speculation
from minfer_jax.engine.sampling import Sampler
from minfer_jax.engine.scheduler import Scheduler
from tests.configs import tiny_config

from minfer_bench.synthetic import synthetic_model_from_config

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
SAMPLED = Sampler(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.1, repeat_last_n=16)


@pytest.fixture(scope="module")
def tiny():
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    return minfer_jax.load(
        gguf_model=gm, kernels="xla", weights="quantized", ctx_size=512, prefill_chunk=16
    )


def ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


def workload():
    """(prompt, sampler, seed, speculates) per request: two copying prompts that draft, one whose
    quoted block is cut short (drafts the model rejects), a sampled drafting one, and two plain
    rows (one sampled) that never draft."""
    block = ids(24, 7)
    return [
        (ids(6, 2) + block + ids(5, 3) + block[:8], None, 0, True),
        (block + ids(4, 4) + block[:3], None, 0, True),
        (ids(3, 5) + block + ids(2, 6) + block[:5], SAMPLED, 11, True),
        (ids(30, 1), None, 0, False),
        (ids(20, 8) + block[:6], SAMPLED, 3, False),
        (ids(12, 9) + block + block[:4], None, 0, True),
    ]


def run(model, plan, spec, n_new=32):
    sched = Scheduler(model, plan)
    reqs = [
        sched.submit(
            prompt,
            max_new_tokens=n_new,
            sampler=sampler,
            seed=seed,
            speculation=spec if speculates else None,
        )
        for prompt, sampler, seed, speculates in workload()
    ]
    sched.run(reqs)
    return [r.result() for r in reqs], sched


def test_a_batch_mixing_drafting_and_plain_rows_gives_each_row_its_plain_tokens(tiny):
    plan = tiny.plan(n_seqs=4, decode_steps=1)  # 6 requests on 4 slots: rows join and leave
    plain, _ = run(tiny, plan, None)
    spec, sched = run(tiny, plan, Speculation(draft_max=3))
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b.tokens == a.tokens, i
    stats = [r.speculation for r in spec if r.speculation is not None]
    accepted = sum(s.accepted for s in stats)
    assert accepted > 10 and sum(s.drafted for s in stats) > accepted  # accepted and rejected
    batched = [k for k in tiny.compiled_keys() if isinstance(k, spec_plan.VerifyBatchKey)]
    assert {k.rows for k in batched} >= {4}  # the 4-row steps verified in one executable
    assert all(r.speculation is None for r in spec[3:5])


def test_large_batches_do_not_draft_and_the_cap_is_one_place():
    plan = plan_mod.Plan(ctx=256, n_seqs=64, decode_steps=1, draft_max=15)
    assert [spec_plan.spec_drafts(plan, n) for n in (1, 2, 3, 4, 8, 9, 16, 64)] == [
        15,
        7,
        3,
        3,
        1,
        0,
        0,
        0,
    ]
    batch_keys = [k for k in plan.serving_keys() if isinstance(k, spec_plan.VerifyBatchKey)]
    assert max(k.rows * (1 + k.drafts) for k in batch_keys) == spec_plan.SPEC_ROWS_BUDGET
    assert {k.rows for k in batch_keys} == {2, 4, 8}


def test_the_plan_has_verify_executables_only_when_it_speculates():
    kinds = (spec_plan.VerifyKey, spec_plan.VerifyBatchKey)
    off = plan_mod.Plan(ctx=256, n_seqs=4, decode_steps=1)
    on = plan_mod.Plan(ctx=256, n_seqs=4, decode_steps=1, draft_max=3)
    assert not [k for k in off.serving_keys() if isinstance(k, kinds)]
    keys = [k for k in on.serving_keys() if isinstance(k, kinds)]
    # buckets 1 and 3 for a lone row, 2 and 4 rows, in the three sampler modes
    assert len(keys) == 3 * (2 + 2 + 2)
    assert all(k.drafts <= 3 and not k.mode.logprobs for k in keys)
    with pytest.raises(plan_mod.PlanError, match="draft_max"):
        plan_mod.Plan(ctx=256, draft_max=16)
    # several tokens per plain step: no batch ever verifies, so none is compiled
    chunked = plan_mod.Plan(ctx=256, n_seqs=4, decode_steps=4, draft_max=3)
    assert not [k for k in chunked.serving_keys() if isinstance(k, spec_plan.VerifyBatchKey)]
    assert [k for k in chunked.serving_keys() if isinstance(k, spec_plan.VerifyKey)]


def test_a_paused_drafter_drafts_again_after_its_pause(tiny):
    """Steps that do not draft count a paused drafter's pause down (they never read its row)."""
    sched = Scheduler(tiny, tiny.plan(n_seqs=4, decode_steps=1))  # the executables above
    req = sched.submit(workload()[0][0], max_new_tokens=24, speculation=Speculation())
    assert req.drafter is not None
    req.drafter.pacing.pause = 2
    sched.run([req])
    stats = req.result().speculation
    assert stats.plain_chunks >= 2 and stats.verify_steps > 0
