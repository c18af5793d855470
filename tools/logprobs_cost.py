"""What each token's logprobs cost per decode step (issue 54 item 4), on whatever JAX backend runs
it: the jitted sampler (engine/sampling.sample_rows) of each mode alone and with
`token_logprobs` (log-softmax of the raw logits, the chosen token's entry and the top 20), for a
batch of B greedy rows at a real vocabulary. The difference is what a batch pays in the
logprobs variant of its mode (SamplerMode.logprobs); a batch with no logprobs row never pays it.

    PYTHONPATH=$PWD python tools/logprobs_cost.py [--rows 1 8 32] [--vocab 151936] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.engine.sampling import GREEDY, MODES, RowSettings, sample_rows, token_logprobs


def _ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, vocabulary {args.vocab}: ms per step")
    for rows in args.rows:
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, args.vocab)), jnp.float32)
        settings = RowSettings.of([GREEDY] * rows, [0] * rows, vocab=args.vocab)
        history = jnp.zeros((rows, 0), jnp.int32)
        positions = jnp.zeros((rows,), jnp.int32)
        for mode in MODES:

            def plain(lg, r, p, mode=mode, history=history):
                return sample_rows(lg, p, r, history, mode)

            def with_logprobs(lg, r, p, mode=mode, history=history):
                return token_logprobs(lg, sample_rows(lg, p, r, history, mode))

            a = _ms(jax.jit(plain), logits, settings, positions, iters=args.iters)
            b = _ms(jax.jit(with_logprobs), logits, settings, positions, iters=args.iters)
            print(f"  {rows:3d} rows {mode.label:8s} {a:9.2f}  with logprobs {b:9.2f}")


if __name__ == "__main__":
    main()
