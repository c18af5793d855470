"""Streams on a cold server: their token gaps while its background executables compile.

    python -m minfer_bench.cold_start [-m MODEL] -np 4 -c 4096 --clients 2 --max-tokens 64 \\
        --prompt-tokens 32 [--json out.json] [--server-log server.log] [-- more server flags]

Starts `python -m minfer_bench.serve` with an empty executable store (a fresh
MINFER_COMPILATION_CACHE in a temporary directory: every executable compiles), waits for
/health, then at once runs `--clients` streaming clients that send requests back to back, and one
small probe request (`--probe-tokens` tokens, not streamed) every `--probe-every` seconds, until
/metrics says every planned executable is compiled (plus `--tail` seconds; `--duration S`: at
most S seconds). Prints, as JSON:
seconds from the server's spawn to /health ok (`ready_s`) and to the last background compile
(`settled_s`), the gaps between text events of the streams while compiles ran (p50, p99, max:
`itl_ms_*`), the probes' latencies, the tokens per second.
Bounded like load_test: loopback only, at most `--timeout` seconds after /health.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from minfer_jax.engine.flags import StrictParser

from minfer_bench import load_bench, load_test


async def _compiles_done(client, url: str, t_spawn: float, stop: asyncio.Event) -> float:
    """Seconds from spawn until /metrics' executables_compiled reaches executables_planned."""
    while not stop.is_set():
        text = (await client.get(f"{url}/metrics")).text
        done = load_bench.metric(text, "executables_compiled")
        planned = load_bench.metric(text, "executables_planned")
        if done is not None and planned is not None and done >= planned:
            return time.monotonic() - t_spawn
        await asyncio.sleep(0.25)
    return float("nan")


async def _streams(client, url, bodies, clients: int, until: asyncio.Event) -> list:
    todo = iter(bodies)
    out: list[load_test.Timing] = []

    async def worker():
        for body in todo:
            if until.is_set():
                return
            out.append(await load_test._one(client, url, body))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return out


async def _probes(client, url: str, tokens: int, every: float, until: asyncio.Event) -> list:
    """Latency of one small request every `every` seconds (the issue's 'small request')."""
    out = []
    while not until.is_set():
        t0 = time.perf_counter()
        body = {"prompt": "Hello", "max_tokens": tokens, "temperature": 0}
        r = await client.post(f"{url}/v1/completions", json=body)
        out.append((time.perf_counter() - t0) if r.status_code == 200 else float("nan"))
        try:
            await asyncio.wait_for(until.wait(), every)
        except TimeoutError:
            pass
    return out


async def measure(url: str, args, t_spawn: float, ready_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout)) as client:
        vocab = await load_test._vocab(client, url)
        bodies = load_test._bodies(
            10_000, 0, args.prompt_tokens, args.max_tokens, vocab, 0.0, 0, True
        )
        stop_load, stop_poll = asyncio.Event(), asyncio.Event()
        t0 = time.perf_counter()
        streams = asyncio.ensure_future(_streams(client, url, bodies, args.clients, stop_load))
        probes = asyncio.ensure_future(
            _probes(client, url, args.probe_tokens, args.probe_every, stop_load)
        )
        try:
            settled_s = await asyncio.wait_for(
                _compiles_done(client, url, t_spawn, stop_poll), args.duration or args.timeout
            )
        except TimeoutError:  # --duration: measured while compiles ran, not until they ended
            stop_poll.set()
            settled_s = float("nan")
        text = (await client.get(f"{url}/metrics")).text
        compiled = [load_bench.metric(text, f"executables_{k}") for k in ("compiled", "planned")]
        settled_at = time.perf_counter()
        await asyncio.sleep(args.tail)
        stop_load.set()
        timings, probe_s = await streams, await probes
        wall = time.perf_counter() - t0
    during = [
        b - a
        for t in timings
        if t.error is None
        for a, b in zip(t.events, t.events[1:])
        if b <= settled_at
    ]
    summary = load_test.summarize(timings, wall, dict(clients=args.clients))
    pct = lambda v, q: float(np.percentile(v, q)) * 1e3 if v else None  # noqa: E731
    return {
        "ready_s": ready_s,
        "settled_s": settled_s,
        "compiled_of_planned": compiled,
        "compiling_itl_ms_p50": pct(during, 50),
        "compiling_itl_ms_p99": pct(during, 99),
        "compiling_itl_ms_max": max(during, default=0.0) * 1e3,
        "compiling_gaps": len(during),
        "probe_s": [round(p, 3) for p in probe_s],
        "probe_s_max": max(probe_s, default=None),
        **{k: summary[k] for k in ("ok", "failed", "errors", "tokens_per_s", "itl_ms_p99")},
        "itl_ms_max_all": summary["itl_ms_max"],
    }


def build_parser():
    p = StrictParser(
        prog="python -m minfer_bench.cold_start",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("-m", "--model", default=None, help="served model (serve.py's -m)")
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="default: 1024 per slot")
    p.add_argument("--clients", type=int, default=2, help="streaming clients (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--probe-tokens", type=int, default=4)
    p.add_argument("--probe-every", type=float, default=3.0)
    p.add_argument("--tail", type=float, default=3.0, help="seconds of load after the compiles")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds of load even if compiles still run (default: wait)",
    )
    p.add_argument("--server-log", default=None, help="the server's output (default: discarded)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("server_args", nargs="*", help="more server flags (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = load_bench.free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = args.ctx_size or 1024 * args.parallel
    cmd = [
        *(sys.executable, "-m", "minfer_bench.serve", "--port", str(port)),
        *("-np", str(args.parallel), "-c", str(ctx), "--log-level", "info"),
        *args.server_args,
    ]
    if args.model:
        cmd += ["-m", args.model]
    log = open(args.server_log or os.devnull, "w")  # noqa: SIM115  closed below
    with tempfile.TemporaryDirectory(prefix="minfer-cold-") as cache:
        env = {**os.environ, "MINFER_COMPILATION_CACHE": cache}
        t_spawn = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            load_bench.wait_healthy(url, proc, args.ready_timeout)
            ready_s = time.monotonic() - t_spawn
            result = asyncio.run(measure(url, args, t_spawn, ready_s))
        finally:
            load_bench.stop_server(proc)
            log.close()
    result = {"command": cmd[1:], **result}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
