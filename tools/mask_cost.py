"""What the constrained-decoding token mask costs per decode step (issue 54).

Three figures, on whatever JAX backend runs it (CPU here, the GPU there):
  1. the jitted sampler (engine/sampling.sample_rows) with its always-present bitmask input
     against the same sampler whose mask XLA folds away (an all-true constant): the price every
     batch pays for a constrained row and free rows sharing one executable;
  2. the host's per-token llguidance mask for a JSON Schema on the built-in model's tokenizer
     (what a constrained row adds on the host each step);
  3. building and sending one [B, words] mask to the device (what a step with a grammar row sends).

    PYTHONPATH=$PWD python tools/mask_cost.py [--rows 1 8 32] [--vocab 151936] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.engine import sampling
from minfer_jax.engine.sampling import GREEDY, MODES, RowSettings, Sampler, sample_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "n": {"type": "integer"},
    },
    "required": ["name", "tags", "n"],
}


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def sampler_cost(rows: int, vocab: int, iters: int) -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)), jnp.float32)
    pos = jnp.zeros((rows,), jnp.int32)
    history = jnp.full((rows, 64), -1, jnp.int32)
    samplers = [GREEDY if i % 2 else Sampler(temperature=0.8) for i in range(rows)]
    settings = jax.device_put(RowSettings.of(samplers, list(range(rows)), vocab=vocab))
    folded = lambda mask, ids=None, vocab=0: jnp.ones((mask.shape[0], vocab), bool)  # noqa: E731
    for mode in MODES:
        with_mask = jax.jit(lambda lg, p, r, h, m=mode: sample_rows(lg, p, r, h, m))
        real = sampling.allowed_bits
        sampling.allowed_bits = folded  # traced now: this executable has no mask work
        try:
            no_mask = jax.jit(lambda lg, p, r, h, m=mode: sample_rows(lg, p, r, h, m))
            jax.block_until_ready(no_mask(logits, pos, settings, history))
        finally:
            sampling.allowed_bits = real
        a = _time(with_mask, logits, pos, settings, history, iters=iters)
        b = _time(no_mask, logits, pos, settings, history, iters=iters)
        print(
            f"sampler B={rows:2d} {mode.label:7s}: {a:9.1f} us with the mask, {b:9.1f} us "
            f"without: +{a - b:8.1f} us"
        )


def host_cost(vocab: int, iters: int) -> None:
    from minfer_jax.engine.grammar import Grammars, GrammarSpec
    from minfer_jax.files.gguf import load_gguf
    from minfer_jax.files.model_source import resolve_model
    from minfer_jax.files.tokenizer import Tokenizer

    tok = Tokenizer.from_model(load_gguf(resolve_model(None)))
    grammars = Grammars(tok, vocab)
    t0 = time.perf_counter()
    grammars.ll_tokenizer()
    print(f"llguidance tokenizer from the GGUF's: {time.perf_counter() - t0:.2f} s (once)")
    spec = GrammarSpec.json_schema(SCHEMA)
    t0 = time.perf_counter()
    grammars.compile(spec)
    t1 = time.perf_counter()
    grammars.compile(spec)
    t2 = time.perf_counter()
    print(f"schema compile: first {1e3 * (t1 - t0):.2f} ms, cached {1e3 * (t2 - t1):.2f} ms")
    # a reply drawn at random from the allowed tokens, as a sampler would (bounded length)
    rng = np.random.default_rng(0)
    mask = grammars.compile(spec)
    row = np.full((sampling.mask_words(vocab),), -1, np.int32)
    times = []
    while len(times) < 64 and not mask.finished:
        t0 = time.perf_counter()
        mask.fill(row)
        times.append(time.perf_counter() - t0)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
        mask.advance(int(rng.choice(np.flatnonzero(bits))))
    print(
        f"host mask per token ({len(times)} tokens): median "
        f"{1e6 * float(np.median(times)):.1f} us, max {1e6 * max(times):.1f} us"
    )
    for rows in (1, 8, 32):
        host = np.full((rows, sampling.mask_words(vocab)), -1, np.int32)
        us = _time(lambda h: jax.device_put(h), host, iters=iters)
        print(f"send a [{rows}, {host.shape[1]}] mask to {jax.default_backend()}: {us:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    for rows in args.rows:
        sampler_cost(rows, args.vocab, args.iters)
    host_cost(args.vocab, args.iters)


if __name__ == "__main__":
    main()
