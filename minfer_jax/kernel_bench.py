"""Kernel-level timing and GPU parity: one (format, out, in, nt) matmul, timed inside one executable.

Random planes are generated on the device (speed does not depend on weight values; scales are
small and finite so the parity check is meaningful). Each case compiles one executable that runs
the matmul `reps` times, each on its own weight copy (so calls stream from HBM, not the 60 MB
L2, and XLA cannot merge identical calls); the time per call is the executable's time / reps.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.quant.planes import QType, get_format


def random_planes(key: jax.Array, qtype: QType, n: int, k: int) -> dict[str, jax.Array]:
    """Planes of a random [n, k] weight with valid fields: 6-bit sub-scales in range, small f16 scales."""
    fmt = get_format(qtype)
    npad = -(-n // 128) * 128
    out = {}
    for plane, pkey in zip(fmt.planes, jax.random.split(key, len(fmt.planes))):
        shape = (npad, k // plane.wpc)
        dt = jnp.dtype(plane.dtype)
        if dt in (jnp.float16, jnp.bfloat16, jnp.float32):
            scale = 1.0 if plane.wpc == 1 else 1e-2
            out[plane.name] = (jax.random.normal(pkey, shape, jnp.float32) * scale).astype(dt)
        elif plane.name in ("sc", "m") and qtype in (QType.Q4_K, QType.Q5_K):
            out[plane.name] = jax.random.randint(pkey, shape, 0, 64, jnp.int32).astype(dt)
        elif plane.name == "sc" and qtype == QType.Q3_K:
            out[plane.name] = jax.random.randint(pkey, shape, -32, 32, jnp.int32).astype(dt)
        else:
            info = jnp.iinfo(dt)
            out[plane.name] = jax.random.randint(pkey, shape, info.min, info.max + 1, jnp.int32).astype(dt)
    return out


def weight_nbytes(qtype: QType, n: int, k: int) -> int:
    """Bytes a matmul must stream: the planes of the unpadded rows."""
    fmt = get_format(qtype)
    return int(sum(n * (k // p.wpc) * np.dtype(p.dtype).itemsize for p in fmt.planes))


@dataclasses.dataclass
class KernelResult:
    qtype: str
    n: int
    k: int
    nt: int
    impl: str
    us: float
    gbps: float
    tflops: float
    rel_err: float
    compile_s: float


def run_case(qtype: QType, n: int, k: int, nt: int, matmul, reference, *, impl: str, reps: int = 40,
             trials: int = 5, seed: int = 0) -> KernelResult:
    """Time `matmul(x, planes)` and compare one call against `reference(x, planes)`."""
    key = jax.random.PRNGKey(seed)
    wbytes = weight_nbytes(qtype, n, k)
    # Distinct weights for every call: the executable then streams from HBM, and XLA cannot
    # merge two identical calls.
    copies = reps
    keys = jax.random.split(key, copies + 1)
    weights = [random_planes(kk, qtype, n, k) for kk in keys[:copies]]
    x = jax.random.normal(keys[-1], (nt, k), jnp.float32)

    @jax.jit
    def loop(x, weights):
        # Unrolled: no loop overhead inside the timed executable.
        return [matmul(x, w) for w in weights]

    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, weights))
    compile_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(x, weights))
        best = min(best, time.perf_counter() - t0)
    us = best / reps * 1e6

    got = np.asarray(jax.jit(matmul)(x, weights[0]), np.float64)
    ref = np.asarray(jax.jit(reference)(x, weights[0]), np.float64)
    rel = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    if not np.all(np.isfinite(got)):
        rel = float("nan")
    return KernelResult(qtype.name, n, k, nt, impl, us, wbytes / us / 1e3, 2.0 * nt * n * k / us / 1e6, rel, compile_s)
