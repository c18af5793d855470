"""The MTP block of Qwen3.5 / 3.6 files (issue 55 item 2, model/mtp.py): its forward against a
float64 numpy one written from llama.cpp's graph_mtp (no llama.cpp reference for MTP logits exists
in the CPU build), and speculative="draft-mtp" against plain decoding: the same greedy tokens, on
a model whose MTP block predicts well (most drafts accepted, some rejected), with the block's own
cache afterwards what a prefill of the whole sequence writes (its rows follow the accepted
tokens)."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import minfer_jax
from minfer_jax.cli.arguments import build_parser
from minfer_jax.engine import slot_spec, spec_plan
from minfer_jax.engine.lookup import (
    DEFAULT_MTP_DRAFT,
    Drafter,
    MtpDrafter,
    Speculation,
    speculation_of,
)
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.engine.spec_flags import speculation_from_args
from minfer_jax.errors import InvalidArgumentError, UnsupportedError
from minfer_jax.files.gguf import QType, RawTensor
from minfer_jax.model.mtp import has_mtp, mtp_forward
from minfer_jax.server import cli as server_cli

from minfer_bench.synthetic_qwen35 import qwen35_model

NAME = "qwen35-tiny-v3-mtp"
SCALE = 0.02  # the residual writes of _predictable


@functools.cache
def _model(predictable: bool = False):
    gm = _predictable(qwen35_model(NAME)) if predictable else qwen35_model(NAME)
    return minfer_jax.load(gguf_model=gm, kernels="xla", ctx_size=256, prefill_chunk=64, mtp=True)


def _predictable(gm):
    """The model with every layer's residual writes (attn_output, ssm_out, ffn_down) scaled to
    SCALE, eh_proj passing the embedding (and a little of h) and the block's head norm the
    trunk's: the trunk's next token is nearly a function of its input token, and the block's
    draft for t_{i+2} from t_{i+1} nearly that function again. Near, not equal: some drafts are
    rejected."""
    t, n, d = dict(gm.tensors), gm.config.n_layers, gm.config.d_model

    def f32(name, values):
        t[name] = RawTensor(name, QType.F32, values.shape, values.astype(np.float32))

    for name, raw in gm.tensors.items():
        if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
            f32(name, SCALE * np.asarray(raw.data))
    mix = 0.1 * np.random.default_rng(1).standard_normal((d, d)) / np.sqrt(d)  # h: a little
    f32(f"blk.{n}.nextn.eh_proj.weight", np.concatenate([np.eye(d), mix], axis=1))
    f32(f"blk.{n}.nextn.enorm.weight", np.ones(d))
    f32(f"blk.{n}.nextn.shared_head_norm.weight", np.asarray(t["output_norm.weight"].data))
    return dataclasses.replace(gm, tensors=t)


def _np_forward(gm, tokens, hidden, start):
    """float64 MTP forward of rows at positions start + [0, T) over an empty cache."""
    cfg, n = gm.config, gm.config.n_layers

    def w(name):
        raw = gm.tensors[name]
        return np.asarray(raw.data, np.float64).reshape(raw.shape)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_eps) * g

    def rope(x, pos):  # NeoX pairs (i, i + r/2) on the first r = rope_dims dims of each head
        r = cfg.rope_dims
        ang = pos[:, None] * cfg.rope_theta ** (-np.arange(0, r, 2) / r)  # [T, r/2]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        return np.concatenate([a * c - b * s, b * c + a * s, x[..., r:]], axis=-1)

    p, q_len = f"blk.{n}.", len(tokens)
    e = rms(w("token_embd.weight")[tokens], w(p + "nextn.enorm.weight"))
    h = rms(hidden, w(p + "nextn.hnorm.weight"))
    x = np.concatenate([e, h], axis=-1) @ w(p + "nextn.eh_proj.weight").T
    a = rms(x, w(p + "attn_norm.weight"))
    hd, heads, kv_heads = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    qg = (a @ w(p + "attn_q.weight").T).reshape(q_len, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(q_len, heads * hd)
    k = (a @ w(p + "attn_k.weight").T).reshape(q_len, kv_heads, hd)
    v = (a @ w(p + "attn_v.weight").T).reshape(q_len, kv_heads, hd)
    pos = start + np.arange(q_len, dtype=np.float64)
    q = rope(rms(q, w(p + "attn_q_norm.weight")), pos)
    k = rope(rms(k, w(p + "attn_k_norm.weight")), pos)
    out = np.zeros((q_len, heads, hd))
    for head in range(heads):
        kh = head // (heads // kv_heads)
        scores = q[:, head] @ k[:, kh].T / np.sqrt(hd)
        scores[np.triu_indices(q_len, 1)] = -np.inf
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = (prob / prob.sum(-1, keepdims=True)) @ v[:, kh]
    attn = out.reshape(q_len, heads * hd) / (1 + np.exp(-gate))
    x = x + attn @ w(p + "attn_output.weight").T
    f = rms(x, w(p + "post_attention_norm.weight"))
    g, u = f @ w(p + "ffn_gate.weight").T, f @ w(p + "ffn_up.weight").T
    x = x + (g / (1 + np.exp(-g)) * u) @ w(p + "ffn_down.weight").T
    out = rms(x, w(p + "nextn.shared_head_norm.weight"))
    return out @ w("output.weight").T, out


def test_mtp_forward_matches_a_float64_reference():
    """Three rows at positions 0, 1, 2 of an empty cache (causal attention among them)."""
    gm, model = qwen35_model(NAME), _model()
    assert has_mtp(gm) and model.has_mtp
    tokens = np.array([7, 300, 42])
    hidden = np.random.default_rng(0).standard_normal((3, gm.config.d_model))
    k, v, _ = model.new_cache(1, 64).mtp
    logits, out, _ = mtp_forward(
        model.params.mtp, model.params, jnp.asarray(tokens), jnp.asarray(hidden, jnp.float32),
        jnp.int32(0), jnp.int32(0), (k, v), model.config, model.impl,
    )  # fmt: skip
    want_logits, want_out = _np_forward(gm, tokens, hidden, 0)
    assert np.abs(np.asarray(logits) - want_logits).max() < 1e-4 * want_logits.std()
    assert np.abs(np.asarray(out) - want_out).max() < 1e-4 * want_out.std()


def test_mtp_speculation_gives_plain_tokens_and_keeps_its_cache_in_step():
    model = _model(predictable=True)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 320, 40)]
    plain = minfer_jax.generate(model, prompt, max_new_tokens=40)
    spec = minfer_jax.generate(model, prompt, max_new_tokens=40, speculative="draft-mtp")
    assert spec.tokens == plain.tokens
    s = spec.speculation
    assert s.accepted > 10 and s.drafted > s.accepted and s.verify_steps < 30
    fed = len(prompt) + len(spec.tokens) - 1  # every token but the last was fed
    k, v, _ = (np.asarray(a[0]) for a in model.scheduler(1).cache.mtp)
    # the block's rows of the whole sequence, written by one prefill of it
    minfer_jax.generate(model, prompt + spec.tokens[:-1], max_new_tokens=1, decode_steps=8)
    k_ref, v_ref, _ = (np.asarray(a[0]) for a in model.scheduler(1, decode_steps=8).cache.mtp)
    for got, want in ((k, k_ref), (v, v_ref)):
        err = np.abs(got[:, : fed - 1] - want[:, : fed - 1]).max()
        assert err < 1e-3 * np.abs(want[:, : fed - 1]).max()


def test_a_hybrid_batch_verifies_each_drafting_row_alone():
    """Batched verification (verify_batch.py) rolls no recurrent state back and drafts nothing
    with the MTP block: a hybrid's plan keeps it off (no batch keys, slot_spec.batches False), so
    each MTP row of a batch verifies alone (its drafts made in the step) beside the plain row's
    chunk; every row gets its plain tokens."""
    model = _model(predictable=True)
    plan = model.plan(3, decode_steps=1)
    speculating = dataclasses.replace(plan, draft_max=3)
    assert not plan.batch_verify
    keys = spec_plan.speculation_keys(speculating)
    assert not any(isinstance(k, spec_plan.VerifyBatchKey) for k in keys)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (30, 21, 17)]
    mtp = speculation_of("draft-mtp")
    sched = Scheduler(model, plan)
    reqs = [
        sched.submit(p, max_new_tokens=24, speculation=mtp if i < 2 else None)
        for i, p in enumerate(prompts)
    ]
    assert not slot_spec.batches(plan, reqs)
    sched.run(reqs)
    for p, req in zip(prompts, reqs):
        assert req.result().tokens == minfer_jax.generate(model, p, max_new_tokens=24).tokens
    stats = [r.result().speculation for r in reqs[:2]]
    assert all(s.accepted > 5 and s.drafted > s.accepted for s in stats)


def test_mtp_needs_the_block_loaded_and_in_the_file():
    plain_load = minfer_jax.load(gguf_model=qwen35_model(NAME), kernels="xla", ctx_size=64)
    with pytest.raises(InvalidArgumentError, match="mtp=True"):
        minfer_jax.generate(plain_load, [1, 2, 3], max_new_tokens=4, speculative="draft-mtp")
    with pytest.raises(UnsupportedError, match="no MTP block"):
        minfer_jax.load(gguf_model=qwen35_model("qwen35-tiny"), kernels="xla", mtp=True)


def test_cli_takes_llama_cpps_draft_mtp():
    parse = build_parser().parse_args
    spec = speculation_from_args(parse(["--spec-type", "draft-mtp"]))
    assert spec == Speculation(kind="draft-mtp", draft_max=DEFAULT_MTP_DRAFT) and spec.on_device
    spec = speculation_from_args(parse(["--spec-type", "mtp", "--spec-draft-n-max", "1"]))
    assert spec.on_device and spec.draft_max == 1
    assert not speculation_from_args(parse(["--spec-type", "lookup"])).on_device
    assert isinstance(spec.new_drafter([1, 2]), MtpDrafter)  # drafter.SpeculationSetting's maker
    lookup = Speculation()
    assert type(lookup.new_drafter()) is Drafter and not lookup.on_device


def test_the_server_refuses_draft_mtp_at_start():
    """Its background-compiled verification keys run without the block (lone rows only)."""
    args = server_cli.build_parser().parse_args(["-m", "x.gguf", "--spec-type", "draft-mtp"])
    with pytest.raises(server_cli._UsageError, match="draft-mtp .*not served"):
        server_cli.settings_from(args)
    args = server_cli.build_parser().parse_args(["-m", "x.gguf", "--spec-type", "lookup"])
    assert server_cli.settings_from(args).speculation == Speculation(kind="lookup")
