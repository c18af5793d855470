"""Kernel-level timing and GPU parity: one (format, out, in, nt) matmul, timed inside one
executable.

Random planes are generated on the device (speed does not depend on weight values; scales are
small and finite so the parity check is meaningful). Each case compiles one executable that runs
the matmul `reps` times, each on its own weight copy and activations (so calls stream from HBM,
not the 60 MB L2, and XLA cannot merge identical calls or work that depends on x alone).

On a GPU the time per call is read off the device, not the host clock: each timed run is traced
with jax.profiler (CUPTI), and the span from its first kernel's start to its last kernel's end,
divided by reps, is what a call costs inside a longer program (its kernels, the XLA fusions
around them, the gaps between). The host clock around an executable also counts the launch and,
for the ahead-of-time compiled executable, Python-side handling of every weight argument, which
grows with reps and cannot be subtracted away: on the H200 it read 18-22 us per Q4_0 4096 x 14336
call whose kernels take 12.6 us on the device timeline (docs/BENCHMARKS.md). Without device
events (CPU, interpret mode) the host clock is used, with the fixed cost cancelled by a second
executable of reps / 4 calls: per call = (t_reps - t_base) / (reps - base).
The kernel call and its jnp reference come from `ops.kernel_case`, the route ops.matmul takes
(the reference's rel err is the parity check); scripts/bench.py --kernels reports these cases.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.quant.planes import QType, get_format
from minfer_jax.sizes import round_up


def random_planes(key: jax.Array, qtype: QType, n: int, k: int) -> dict[str, jax.Array]:
    """Planes of a random [n, k] weight with valid fields: small-int planes in their Plane.sample
    range, small f16 scales."""
    fmt = get_format(qtype)
    npad = round_up(n, 128)
    out = {}
    for plane, pkey in zip(fmt.planes, jax.random.split(key, len(fmt.planes))):
        shape = (npad, k // plane.wpc)
        dt = jnp.dtype(plane.dtype)
        if dt in (jnp.float16, jnp.bfloat16, jnp.float32):
            scale = 1.0 if plane.wpc == 1 else 1e-2
            out[plane.name] = (jax.random.normal(pkey, shape, jnp.float32) * scale).astype(dt)
        elif plane.sample is not None:  # the plane's valid range (6-bit scales, E8M0 bytes)
            lo, hi = plane.sample
            out[plane.name] = jax.random.randint(pkey, shape, lo, hi, jnp.int32).astype(dt)
        elif dt == jnp.uint32:  # packed quant words: every bit pattern is valid
            out[plane.name] = jax.random.bits(pkey, shape, jnp.uint32)
        else:
            info = jnp.iinfo(dt)
            out[plane.name] = jax.random.randint(
                pkey, shape, info.min, info.max + 1, jnp.int32
            ).astype(dt)
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
    us: float  # best trial, microseconds per call
    gbps: float  # weight bytes / best time
    tflops: float  # 2 * nt * n * k / best time
    rel_err: float
    compile_s: float  # lower + compile of the timed executable (AOT), not its first run
    samples_us: list[float] = dataclasses.field(default_factory=list)  # every trial, us per call
    reps: int = 0  # calls unrolled inside the timed executable
    weight_bytes: int = 0

    @property
    def avg_us(self) -> float:
        return float(np.mean(self.samples_us)) if self.samples_us else self.us

    @property
    def stddev_us(self) -> float:
        """Sample standard deviation over trials (0 for one trial), as llama-bench's stdev()."""
        return float(np.std(self.samples_us, ddof=1)) if len(self.samples_us) > 1 else 0.0


def device_kernel_events(run) -> list[tuple[float, float, str]]:
    """Call run() under jax.profiler; the GPU kernels it ran as (start ns, duration ns, name),
    sorted by start (memcpy/memset excluded; empty when the trace holds no GPU events, or when
    another profiler session is running, so callers fall back to the host clock)."""
    import glob
    import tempfile

    events = []
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d):
                run()
        except RuntimeError:  # a profiler session is already running (the caller's own trace)
            run()
            return []
        for path in glob.glob(f"{d}/**/*.xplane.pb", recursive=True):
            for plane in jax.profiler.ProfileData.from_file(path).planes:
                if not plane.name.startswith("/device:GPU"):
                    continue
                for line in plane.lines:
                    events += [
                        (ev.start_ns, ev.duration_ns, ev.name)
                        for ev in line.events
                        if "memcpy" not in ev.name.lower() and "memset" not in ev.name.lower()
                    ]
    return sorted(events)


def device_span_us(run) -> float | None:
    """The span of run()'s GPU kernels, first start to last end, in us (None without GPU events)."""
    events = device_kernel_events(run)
    if not events:
        return None
    return (max(s + d for s, d, _ in events) - events[0][0]) / 1e3


def run_case(
    qtype: QType,
    n: int,
    k: int,
    nt: int,
    matmul,
    reference,
    *,
    impl: str,
    reps: int = 40,
    trials: int = 5,
    seed: int = 0,
    warmup: bool = True,
) -> KernelResult:
    """Time `matmul(x, planes)` and compare one call against `reference(x, planes)`.

    One executable runs `reps` unrolled calls, each on its own weight copy; it is compiled ahead of
    time (compile_s), run once to warm up, then timed `trials` times. A trial's time per call is
    its device span / reps on a GPU; elsewhere (t_reps - t_base) / (reps - base) with a second
    executable of base = reps // 4 calls (reps >= 2), or t_reps / reps. `us` is the best trial.
    """
    key = jax.random.PRNGKey(seed)
    wbytes = weight_nbytes(qtype, n, k)
    # Distinct weights for every call: the executable then streams from HBM, and XLA cannot
    # merge two identical calls.
    # Distinct activations too: work that depends on x alone (quantizing it, casting it) would
    # otherwise be computed once and shared by every call (XLA's CSE), hiding its cost.
    keys = jax.random.split(key, 2 * reps)
    weights = [random_planes(kk, qtype, n, k) for kk in keys[:reps]]
    xs = [jax.random.normal(kk, (nt, k), jnp.float32) for kk in keys[reps:]]
    jax.block_until_ready((weights, xs))

    def loop(xs, weights):
        # Unrolled: no loop overhead inside the timed executable.
        return [matmul(x, w) for x, w in zip(xs, weights)]

    t0 = time.perf_counter()
    exe = jax.jit(loop).lower(xs, weights).compile()
    compile_s = time.perf_counter() - t0

    def run(e=exe, ws=weights) -> float:
        t = time.perf_counter()
        jax.block_until_ready(e(xs[: len(ws)], ws))
        return time.perf_counter() - t

    if warmup:
        run()
    samples = []
    spans = [device_span_us(run)] if jax.devices()[0].platform == "gpu" else [None]
    while spans[-1] is not None and len(spans) < trials:
        spans.append(device_span_us(run))
    if spans[-1] is not None:
        samples = [span / reps for span in spans]
    else:
        base = reps // 4 if reps >= 2 else 0
        if base:
            t0 = time.perf_counter()
            exe_base = jax.jit(loop).lower(xs[:base], weights[:base]).compile()
            compile_s += time.perf_counter() - t0
            run(exe_base, weights[:base])
        for _ in range(trials):
            if base:
                tb = run(exe_base, weights[:base])
                samples.append(max(run() - tb, 0.0) / (reps - base) * 1e6)
            else:
                samples.append(run() / reps * 1e6)
    us = min(samples)
    if us <= 0.0:  # host timer noise larger than the calls themselves (tiny CPU cases)
        us = max(samples) or 1e-3

    got = np.asarray(jax.jit(matmul)(xs[0], weights[0]), np.float64)
    ref = np.asarray(jax.jit(reference)(xs[0], weights[0]), np.float64)
    rel = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    if not np.all(np.isfinite(got)):
        rel = float("nan")
    return KernelResult(
        QType(qtype).name,
        n,
        k,
        nt,
        impl,
        us,
        wbytes / us / 1e3,
        2.0 * nt * n * k / us / 1e6,
        rel,
        compile_s,
        samples_us=samples,
        reps=reps,
        weight_bytes=wbytes,
    )
