"""Everything around the model works for a mixture-of-experts file unchanged: generate() (prefill
through the sorted expert path, decode through the gathered one), the scheduler's continuous
batching and prefix reuse, the deterministic and precise modes, the weights cache, the CLI, and
the Pallas kernel path (interpreted here; compiled on a GPU, tests/kernel_mode.py). One tiny
Qwen2-MoE file (8 experts, 2 used, a gated shared expert)."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

import minfer_jax

from minfer_bench.synthetic import synthetic_model, write_gguf

SPEC = "qwen2moe-tiny:q8_0"


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


@pytest.fixture(scope="module")
def gm():
    return synthetic_model(SPEC, seed=2)


@pytest.fixture(scope="module")
def model(gm):
    return minfer_jax.load(gguf_model=gm, ctx_size=256)


def fresh_run(model, ids, n):
    sched = minfer_jax.Scheduler(model, model.plan(decode_steps=4))
    req = sched.submit(ids, max_new_tokens=n)
    sched.run([req])
    return req.result().tokens


def test_generate_takes_the_argmax_of_every_prefix(model):
    """Greedy decode (T = 1: the gathered experts) gives the argmax of the prefill logits (T > 8:
    the experts sorted into tiles) at every step."""
    ids = prompt(1, 40)
    out = minfer_jax.generate(model, ids, max_new_tokens=6, decode_steps=3).tokens
    logits = np.asarray(model.logits(ids + out))
    assert list(logits[len(ids) - 1 : -1].argmax(-1)) == out


def test_continuous_batching_and_prefix_reuse(model):
    sched = minfer_jax.Scheduler(model, model.plan(n_seqs=3, decode_steps=4))
    system = prompt(3, 20)
    first = sched.submit(system + prompt(4, 9), max_new_tokens=5)
    sched.run([first])
    others = [sched.submit(prompt(5 + i, 12 + 7 * i), max_new_tokens=6) for i in range(2)]
    sibling = sched.submit(system + prompt(9, 5), max_new_tokens=5)
    sched.run([*others, sibling])
    assert sibling.result().cached_tokens == len(system)
    for r in (first, *others, sibling):
        assert r.result().tokens == fresh_run(model, r.prompt, len(r.result().tokens))


def test_deterministic_and_precise_modes_give_each_row_its_lone_tokens(gm):
    m = minfer_jax.load(gguf_model=gm, ctx_size=256, deterministic=True, precise=True)
    prompts = [prompt(20 + i, n) for i, n in enumerate((5, 30, 12))]
    alone = [minfer_jax.generate(m, p, max_new_tokens=4, decode_steps=4).tokens for p in prompts]
    batched = minfer_jax.generate_batch(m, prompts, max_new_tokens=4, decode_steps=4)
    assert [r.tokens for r in batched] == alone


def test_weights_cache_and_cli(gm, tmp_path, monkeypatch):
    """The file written and loaded twice (the second maps the cached expert planes), and the CLI
    on it."""
    from minfer_jax.cli import generate as cli

    path = tmp_path / "moe.gguf"
    write_gguf(gm, path, progress=False)
    monkeypatch.setenv("MINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))
    monkeypatch.setenv("MINFER_COMPILATION_CACHE", "off")
    ids = prompt(30, 20)
    first = minfer_jax.load(str(path), ctx_size=128, weights="quantized", kernels="xla")
    want = np.asarray(first.logits(ids))
    first.weights_saving.join()
    again = minfer_jax.load(str(path), ctx_size=128, weights="quantized", kernels="xla")
    assert again.weights_from == "cache"
    np.testing.assert_array_equal(np.asarray(again.logits(ids)), want)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    rc = cli.main(["-m", str(path), "-p", "hello", "-n", "4", "--temp", "0", "-c", "64"])
    assert rc == 0 and out.getvalue()


def test_kernel_path_matches_reference_path():
    """Prefill (attention kernels, the dequant GEMM, the experts through ragged_dot) and decode
    (GEMVs, Qwen2's fused q/k/v epilogue and attention, the gathered experts, the shared expert)
    through the kernels against the XLA path."""
    from tests.kernel_mode import KERNELS

    gm = synthetic_model("qwen2moe-tiny:q8_0", seed=3)
    kern, ref = (
        minfer_jax.load(gguf_model=gm, kernels=k, weights="quantized", ctx_size=64)
        for k in (KERNELS, "xla")
    )
    ids = prompt(40, 16)  # past 8 tokens: prefill takes the sorted (ragged) expert route
    want = minfer_jax.generate(ref, ids, max_new_tokens=2).tokens
    got = minfer_jax.generate(kern, ids, max_new_tokens=2).tokens
    seq = ids + want
    lk, lr = np.asarray(kern.logits(seq)), np.asarray(ref.logits(seq))
    tol = 2e-2 * float(np.max(np.abs(lr)))  # the kernels' f16 / int8 activations
    np.testing.assert_allclose(lk, lr, atol=tol)
    top2 = np.sort(lr, axis=-1)[:, -2:]
    if (top2[len(ids) - 1 :, 1] - top2[len(ids) - 1 :, 0] > tol).all():
        assert got == want


def test_server_batches_requests_and_reuses_a_prefix():
    """The OpenAI server on a synthetic MoE model (minfer_bench.serve's loader): three concurrent
    completions of token-id prompts, each the tokens generate() gives alone; a prompt that starts
    like a finished one reports the reused tokens."""
    import concurrent.futures
    import time

    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    from minfer_bench.serve import load_model

    ref = "synthetic:qwen3moe-tiny:q8_0:seed=3"
    settings = ServerSettings(model=ref, n_parallel=3, ctx_size=3 * 128, warmup=False)
    app = create_app(settings, loader=load_model)
    prompts = [prompt(50 + i, 10 + 9 * i) for i in range(3)]
    with TestClient(app, base_url="http://localhost") as c:
        deadline = time.monotonic() + 300
        while app.state.backend.status == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"max_tokens": 4, "temperature": 0}

        def complete(ids):
            r = c.post("/v1/completions", json={**body, "prompt": ids})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(complete, prompts))
        again = complete(prompts[2] + prompt(60, 3))
    model = load_model(ref, minfer_jax.Options(ctx_size=128))
    for ids, answer in zip(prompts, answers):
        alone = minfer_jax.generate(model, ids, max_new_tokens=4)
        assert answer["choices"][0]["text"] == alone.text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompts[2])
