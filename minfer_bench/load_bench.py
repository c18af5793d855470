"""Serve a model and load-test it at several client counts: one command for BENCHMARKS.md's rows.

    python -m minfer_bench.load_bench -m MODEL -np 32 -c 32768 --clients 8,32 \\
        --max-tokens 128 --prompt-tokens 512 --out server.md --json server.json

Starts `python -m minfer_bench.serve` (the server; -m also takes synthetic:<spec>) on 127.0.0.1 and
a free port (extra flags after `--` go to it), waits for /health, runs load_test.run once per client
count (each with its own warm-up pass, `--requests-per-client` x clients measured requests), writes
one markdown table (a row per client count) and the JSON of every run, and stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from minfer_jax.engine.flags import StrictParser

from minfer_bench import load_test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise load_test.LoadTestError(
                f"the server exited with status {proc.returncode} before it was ready"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise load_test.LoadTestError(f"the server was not ready after {timeout:g} s")


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"minfer_{name} "):
            return float(line.split()[1])
    return None


def wait_settled(url: str, timeout: float) -> float | None:
    """Seconds until every planned executable is compiled (None: the server does not say)."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        done, planned = metric(text, "executables_compiled"), metric(text, "executables_planned")
        if done is None or planned is None:
            return None
        if done >= planned:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise load_test.LoadTestError(
        f"the server's background compiles were not done after {timeout:g} s"
    )


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = StrictParser(
        prog="python -m minfer_bench.load_bench",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("-m", "--model", default=None, help="served model (serve.py's -m)")
    p.add_argument("-np", "--parallel", type=int, default=32, help="server slots (default 32)")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="server total context (default: 1024 per slot)",
    )
    p.add_argument("--clients", default="8,32", help="comma-separated client counts (default 8,32)")
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=4,
        help="measured requests per client (default 4)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=420.0,
        help="seconds to wait for the model to load (default 420)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for each warm-up and each run"
    )
    p.add_argument(
        "--no-settle",
        dest="settle",
        action="store_false",
        help="measure right after /health (default: first wait until the server's background "
        "compiles are done, /metrics' executables_compiled reaching executables_planned)",
    )
    p.add_argument("--out", default=None, help="markdown table file")
    p.add_argument("--json", default=None, help="JSON file of every run")
    p.add_argument("server_args", nargs="*", help="more server flags (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clients = [int(c) for c in args.clients.split(",") if c]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = args.ctx_size or 1024 * args.parallel
    cmd = [
        sys.executable,
        "-m",
        "minfer_bench.serve",  # the server, whose -m also takes synthetic:<spec>
        "--port",
        str(port),
        "-np",
        str(args.parallel),
        "-c",
        str(ctx),
        "--log-level",
        "warning",
        "--max-queued",
        str(4 * max(clients + [args.parallel])),
        *args.server_args,
    ]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd)
    runs = []
    try:
        ready_s = wait_healthy(url, proc, args.ready_timeout)
        print(f"server ready after {ready_s:.1f} s: {' '.join(cmd[1:])}", file=sys.stderr)
        settled_s = wait_settled(url, args.ready_timeout) if args.settle else None
        if settled_s is not None:
            print(f"background compiles done {settled_s:.1f} s after that", file=sys.stderr)
        for n in clients:
            runs.append(
                asyncio.run(
                    load_test.run(
                        url,
                        clients=n,
                        requests=args.requests_per_client * n,
                        max_tokens=args.max_tokens,
                        prompt_tokens=args.prompt_tokens,
                        timeout=args.timeout,
                    )
                )
            )
            print(load_test.markdown(runs[-1]), file=sys.stderr)
    finally:
        stop_server(proc)
    table = load_test.markdown(runs[0]).split("\n")[:2] + [
        load_test.markdown(r).split("\n")[2] for r in runs
    ]
    head = (
        f"model `{args.model or 'default'}`, server -np {args.parallel} -c {ctx} "
        f"{' '.join(args.server_args)}, host {platform.node()}, ready after {ready_s:.1f} s"
        + (f", background compiles done {settled_s:.1f} s later" if settled_s is not None else "")
    )
    text = head + "\n\n" + "\n".join(table) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"command": cmd[1:], "ready_s": ready_s, "settled_s": settled_s, "runs": runs},
                f,
                indent=2,
            )
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
