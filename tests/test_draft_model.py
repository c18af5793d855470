"""Speculative decoding with a draft model (issue 55, engine/draft_model.py).

Greedy output is plain decoding's token for token, with the target as its own draft (every draft
accepted) and with a different draft model of the same vocabulary (the target with one layer's
FFN output matrix from another seed: partly accepted); sampled output keeps plain decoding's
tokens for the same seed. The draft itself is the draft model's own greedy continuation, also
after a rejected draft rolled its cache back; p_min cuts it. Vocabularies that differ are refused
by name, and so are settings that make no sense, in generate() and on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

import minfer_jax
from minfer_jax.cli.arguments import build_parser
from minfer_jax.engine.draft_model import DraftModel, DraftSpeculation, VocabularyMismatchError
from minfer_jax.engine.drafter import CostPacing, best_length
from minfer_jax.engine.spec_flags import draft_speculation, speculation_from_args
from minfer_jax.errors import InvalidArgumentError
from tests.configs import tiny_config

from minfer_bench.synthetic import (
    SYNTHETIC_CONFIGS,
    placeholder_tokenizer,
    synthetic_model_from_config,
    write_gguf,
)

TINY = tiny_config(n_layers=2, d_model=128, d_ff=256, context_length=1024)
LOAD = dict(kernels="xla", weights="quantized", ctx_size=512, prefill_chunk=16)
PERTURBED = "blk.1.ffn_down.weight"  # the draft's one tensor from another seed


@pytest.fixture(scope="module")
def target():
    return minfer_jax.load(gguf_model=synthetic_model_from_config(TINY, "q8_0", seed=3), **LOAD)


@pytest.fixture(scope="module")
def other_draft(target):
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    swapped = synthetic_model_from_config(TINY, "q8_0", seed=4).tensors[PERTURBED]
    tensors = {**gm.tensors, PERTURBED: swapped}
    model = minfer_jax.load(gguf_model=dataclasses.replace(gm, tensors=tensors), **LOAD)
    return DraftModel(model, target)


def ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


PROMPTS = {"plain": ids(30, 1), "copying": ids(6, 2) + ids(24, 7) + ids(5, 3) + ids(24, 7)[:8]}


def _draft(target, prompt, draft_model, max_new_tokens=40, **kw):
    return minfer_jax.generate(
        target, prompt, max_new_tokens=max_new_tokens, speculative="draft", draft_model=draft_model,
        draft_p_min=0.0, **kw,
    )  # fmt: skip


def _free_drafts(target, prompt, draft, max_new_tokens=40, **kw):
    """generate() with drafts that cost nothing (cost 0: every draft of draft_max tokens, not
    the length the measured times would pick), through the scheduler as generate() runs."""
    spec = DraftSpeculation(draft, target.config.vocab_size, cost=0.0, p_min=0.0)
    sched = target.scheduler(1)
    req = sched.submit(prompt, max_new_tokens=max_new_tokens, speculation=spec, **kw)
    sched.run([req])
    return req.result()


def test_the_target_as_its_own_draft_is_always_accepted(target):
    draft = DraftModel(target, target)  # kept across prompts: its cache's prefixes carry over
    for prompt in PROMPTS.values():
        plain = minfer_jax.generate(target, prompt, max_new_tokens=40)
        spec = _draft(target, prompt, draft)  # a draft as dear as a step: one token at a time
        s = spec.speculation
        assert spec.tokens == plain.tokens and s.accepted == s.drafted >= 15
        free = _free_drafts(target, prompt, draft)  # 7 tokens a draft: the 8-row verification
        s = free.speculation
        assert free.tokens == plain.tokens and s.accepted == s.drafted >= 30
        assert s.tokens_per_step > 6


def test_another_draft_model_is_partly_accepted_and_changes_no_token(target, other_draft):
    accepted = rejected = 0
    for prompt in PROMPTS.values():
        plain = minfer_jax.generate(target, prompt, max_new_tokens=40)
        runs = (_draft(target, prompt, other_draft), _free_drafts(target, prompt, other_draft))
        for spec in runs:
            assert spec.tokens == plain.tokens
            accepted += spec.speculation.accepted
            rejected += spec.speculation.drafted - spec.speculation.accepted
    assert accepted >= 10 and rejected >= 10


def test_sampled_tokens_with_a_draft_model_are_plain_samplings(target, other_draft):
    settings = dict(temperature=0.9, top_k=40, seed=5)
    prompt = PROMPTS["plain"]
    plain = minfer_jax.generate(target, prompt, max_new_tokens=24, **settings)
    spec = _draft(target, prompt, other_draft, 24, draft_max=3, **settings)
    assert spec.tokens == plain.tokens and spec.speculation.verify_steps > 0


def test_the_draft_is_the_draft_models_greedy_text_also_after_a_rollback(target, other_draft):
    """Drafts compared with the draft model's own greedy generation, after the sequence was cut
    back and went on differently (its stale K/V overwritten), and cut by p_min."""
    model, owner = other_draft.model, argparse.Namespace()  # a drafter stand-in (weakref-able)
    seq = PROMPTS["plain"]
    greedy = minfer_jax.generate(model, seq, max_new_tokens=7).tokens
    assert other_draft.draft(owner, seq, 7, 0.0) == greedy
    other = seq[:-3] + [(seq[-3] + 1) % TINY.vocab_size]  # the last 3 tokens replaced by one
    assert (
        other_draft.draft(owner, other, 5, 0.0)
        == minfer_jax.generate(model, other, max_new_tokens=5).tokens
    )
    assert other_draft.draft(owner, seq, 7, 1.0) == []  # no token is certain


def test_vocabularies_that_differ_are_refused_by_name(target):
    wide = tiny_config(n_layers=1, d_model=64, d_ff=128, vocab_size=TINY.vocab_size + 200)
    other = minfer_jax.load(gguf_model=synthetic_model_from_config(wide, "q8_0"), **LOAD)
    with pytest.raises(VocabularyMismatchError, match="500 and 300 tokens, more than 128 apart"):
        DraftModel(other, target)
    gm = synthetic_model_from_config(TINY, "q8_0", seed=3)
    with_vocab = dataclasses.replace(gm, metadata={**gm.metadata, **placeholder_tokenizer(300)})
    named = minfer_jax.load(gguf_model=with_vocab, **LOAD)
    with pytest.raises(VocabularyMismatchError, match="no tokenizer metadata"):
        DraftModel(target, named)
    vocab = placeholder_tokenizer(300)
    vocab["tokenizer.ggml.tokens"] = [*vocab["tokenizer.ggml.tokens"]]
    vocab["tokenizer.ggml.tokens"][280] = "<|renamed|>"
    renamed = minfer_jax.load(
        gguf_model=dataclasses.replace(gm, metadata={**gm.metadata, **vocab}), **LOAD
    )
    with pytest.raises(VocabularyMismatchError, match="token 280: '<.renamed.>'"):
        DraftModel(renamed, named)
    DraftModel(named, named)  # the same vocabulary passes


def test_settings_that_make_no_sense_are_refused(target):
    prompt = PROMPTS["plain"]
    with pytest.raises(InvalidArgumentError, match="needs draft_model"):
        minfer_jax.generate(target, prompt, speculative="draft")
    with pytest.raises(InvalidArgumentError, match="need speculative='draft'"):
        minfer_jax.generate(target, prompt, speculative="lookup", draft_model=target)
    with pytest.raises(InvalidArgumentError, match="draft_p_min"):
        minfer_jax.generate(
            target, prompt, speculative="draft", draft_model=target, draft_p_min=1.5
        )
    with pytest.raises(InvalidArgumentError, match="draft_model must be"):
        minfer_jax.generate(target, prompt, speculative="draft", draft_model=3)
    hybrid = dataclasses.replace(target, config=SYNTHETIC_CONFIGS["qwen3.6-27b"])  # no weights
    with pytest.raises(InvalidArgumentError, match="hybrid family 'qwen35'.*rolled back"):
        DraftModel(hybrid, target)


def test_cli_flags_take_llama_cpp_spellings_and_load_the_draft(tmp_path):
    parse = build_parser().parse_args
    args = parse(["-md", "d.gguf", "--draft-p-min", "0.5", "--draft-max", "4"])
    assert args.model_draft == "d.gguf" and speculation_from_args(args) is None  # after the load
    for bad, reason in (
        (["--spec-type", "ngram-simple", "-md", "d.gguf"], "pick one"),
        (["--spec-type", "draft-simple"], "needs a draft model"),
        (["-md", "d.gguf", "--draft-p-min", "2"], "p-min"),
        (["-md", "d.gguf", "--draft-max", "16"], "--draft-max"),
        (["-md", "d.gguf", "--draft-max", "3", "--draft-min", "4"], "--draft-min"),
    ):
        with pytest.raises(InvalidArgumentError, match=reason):
            speculation_from_args(parse(bad))
    small = tiny_config(n_layers=1, d_model=64, d_ff=128)
    path = tmp_path / "draft.gguf"
    write_gguf(synthetic_model_from_config(small, "q8_0"), path, progress=False)
    gm = synthetic_model_from_config(small, "q8_0", seed=1)
    named = dataclasses.replace(gm, metadata={**gm.metadata, **placeholder_tokenizer(300)})
    target = minfer_jax.load(gguf_model=named, **LOAD)
    spec = draft_speculation(parse(["-md", str(path), "--spec-draft-p-min", "0.5"]), target)
    assert isinstance(spec, DraftSpeculation) and spec.p_min == 0.5
    assert spec.draft.model.ctx_size == target.ctx_size
    assert draft_speculation(argparse.Namespace(model_draft=None), target) is None


def test_the_draft_length_makes_the_most_tokens_per_unit_of_time():
    """best_length at a drafted token's cost of 0.27 steps (the real 0.5B's decode over the 7B's
    on the H200, docs/BENCHMARKS.md); CostPacing follows the acceptance rate and the times."""
    assert [best_length(r, 0.27, 15) for r in (0.5, 0.7, 0.8, 0.9)] == [1, 2, 3, 5]
    assert best_length(1.0, 1.0, 7) == 7 and best_length(0.9, 1.0, 7) == 1  # a draft as dear
    pacing = CostPacing(7, 0.27)
    assert pacing.k == 3  # the prior rate, 0.75
    for _ in range(3):
        pacing.record(pacing.k, pacing.k)
    assert pacing.k == 7 and pacing.rate > 0.95
    for _ in range(3):
        pacing.record(pacing.k, 0)
    assert pacing.k == 2 and 0.6 < pacing.rate < 0.7
    pacing.observe(0.010, 0.002, 5)  # 1 ms a drafted token, 2 ms a verification: 0.5
    assert 0.27 < pacing.cost < 0.5
