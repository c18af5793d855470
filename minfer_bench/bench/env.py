"""The environment a bench row records: device, backend, memory bandwidth, build, header line."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import subprocess
import time
from typing import Any

from minfer_bench.bench.parsing import BenchError

# Memory read bandwidth per device kind (bytes/s), the first key that is a substring of jax's
# device_kind (so the specific H100s before "H100"). H200: measured, a jitted jnp.sum over 1 GiB
# of f32 read 4.15 - 4.28 TB/s; H100s: the spec sheets' HBM bandwidth (one sum per dispatch read
# the SXM card at only 1.6 - 2.0 TB/s, under what the 7B's decode reaches, 1.89).
MEM_BW_TABLE: dict[str, float] = {
    "H200": 4.2e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,
}


@dataclasses.dataclass
class Env:
    platform: str  # "gpu" | "cpu" | ...
    device_kind: str  # "NVIDIA H200", "cpu"
    backend: str  # llama-bench's "backends" column: JAX-CUDA / JAX-CPU
    gpu_info: str
    cpu_info: str
    jax_version: str
    build_commit: str
    build_number: int
    n_threads: int
    mem_bw: float | None = None  # bytes/s
    mem_bw_source: str = "n/a"
    command: str = ""
    device: Any = None

    @property
    def is_cpu_backend(self) -> bool:
        return "CPU" in self.backend

    @property
    def device_label(self) -> str:
        return f"{self.device_kind} ({self.platform})"

    def peak_mem(self) -> int | None:
        try:
            stats = self.device.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            return None
        if not stats:
            return None
        v = stats.get("peak_bytes_in_use")
        return int(v) if v is not None else None


def _cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_build() -> tuple[str, int]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        count = subprocess.run(
            ["git", "-C", here, "rev-list", "--count", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        # a tree that differs from HEAD (a copy of a working tree, say) is not that commit's code
        dirty = subprocess.run(
            ["git", "-C", here, "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=10
        ).returncode
        commit = (commit or "unknown") + ("-dirty" if commit and dirty == 1 else "")
        return commit, int(count or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return "unknown", 0


def table_key(device_kind: str) -> str | None:
    """The MEM_BW_TABLE key for a jax device_kind (its first key inside it), or None."""
    return next((k for k in MEM_BW_TABLE if k.lower() in device_kind.lower()), None)


def measure_mem_bw(
    device=None, nbytes: int | None = None, trials: int = 5, reads: int = 10
) -> float:
    """Read bandwidth (bytes/s): best of `trials` runs of one executable that sums a large f32
    array `reads` times, each sum depending on the last (so XLA cannot hoist it): one dispatch
    per run, whose host-side cost a single sum of 1 GiB does not hide."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    if nbytes is None:
        nbytes = (1 << 30) if device.platform == "gpu" else (256 << 20)
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)

    @jax.jit
    def read_many(x):
        def read(_, acc):
            return acc + jnp.sum(x + acc * 1e-30)

        return jax.lax.fori_loop(0, reads, read, jnp.float32(0))

    jax.block_until_ready(read_many(x))
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(read_many(x))
        best = min(best, time.perf_counter() - t0)
    del x
    return reads * nbytes / best


def make_env(mem_bw: str = "auto", command: str = "") -> Env:
    import jax

    dev = jax.devices()[0]
    plat = dev.platform
    kind = str(getattr(dev, "device_kind", plat))
    if plat == "gpu":
        ver = str(getattr(dev.client, "platform_version", "") or "").lower()
        backend = "JAX-ROCm" if "rocm" in ver else "JAX-CUDA"
    else:
        backend = f"JAX-{plat.upper()}"
    commit, number = _git_build()
    env = Env(
        platform=plat,
        device_kind=kind,
        backend=backend,
        gpu_info=kind if plat == "gpu" else "",
        cpu_info=_cpu_info(),
        jax_version=jax.__version__,
        build_commit=commit,
        build_number=number,
        n_threads=os.cpu_count() or 1,
        command=command,
        device=dev,
    )
    setting = str(mem_bw).strip().lower()
    if setting in ("none", "off", "n/a", "na"):
        env.mem_bw, env.mem_bw_source = None, "n/a"
    elif setting == "auto":
        hit = table_key(kind)
        if hit:
            env.mem_bw, env.mem_bw_source = MEM_BW_TABLE[hit], f"table ({hit})"
        else:
            env.mem_bw = None
            env.mem_bw_source = "measure"  # filled in lazily by ensure_mem_bw()
    elif setting == "measure":
        env.mem_bw, env.mem_bw_source = None, "measure"
    else:
        try:
            gbps = float(setting)
        except ValueError:
            raise BenchError(
                f"--mem-bw: expected auto, measure, none or a number of GB/s, got {mem_bw!r}"
            ) from None
        if not gbps > 0:
            raise BenchError(f"--mem-bw: must be > 0 GB/s, got {mem_bw!r}")
        env.mem_bw, env.mem_bw_source = gbps * 1e9, "given"
    return env


def ensure_mem_bw(env: Env) -> None:
    if env.mem_bw is None and env.mem_bw_source == "measure":
        env.mem_bw = measure_mem_bw(env.device)
        env.mem_bw_source = "measured: jnp.sum"


def utc_stamp() -> str:
    """Now, as llama-bench's test_time: '2026-12-01T03:39:15Z'."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def header_line(env: Env, mode: str, impl: str) -> str:
    now = utc_stamp()
    import jax

    bw = "n/a" if env.mem_bw is None else f"{env.mem_bw / 1e9:.0f} GB/s ({env.mem_bw_source})"
    cache = "on" if jax.config.jax_compilation_cache_dir else "off"
    return (
        f"minfer_jax bench ({mode}) | {now} | device: {env.device_label}, {env.backend} | "
        f"jax {env.jax_version} | kernels: {impl} | mem bw: {bw} | compile cache: {cache} | "
        f"build: {env.build_commit} ({env.build_number}) | cmd: {env.command}"
    )
