"""Issue 25's attacks on a running local server, each timed beside /health and a running stream.

    python tools/attack_check.py --url http://127.0.0.1:8080 --pid PID [--json out.json]

Each attack runs while a background probe asks /health every 0.1 s and one client streams a
greedy completion (restarted when it ends); per attack: its status, its time, the slowest /health
answer and the longest gap between that stream's events meanwhile. Attacks: text prompts of 10 and
50 MB, 50 MB of token ids, JSON nested 100,000 deep, zero penalties as floats, a seed past 2**32,
every sampler setting that once compiled mid-serving (top_k 3 / 9 / 1000, top_p 0.5 with top_k 0,
repeat_last_n 4096, then a default sampled request), a body cut off mid-way, a text/plain body and
a foreign Host. With --pid the server's RSS before, at its peak and after. Exit status 1 when a
request froze /health or the stream for more than --max-stall seconds, got a 5xx, or the RSS after
grew more than 10 % over before. Loopback URLs only. Not part of the package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from urllib.parse import urlparse

import httpx

MB = 1_000_000


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def attacks() -> list[tuple[str, dict]]:
    """(name, request) pairs: request holds path, and json or content (+ headers)."""
    sampled = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.8, "seed": 1}
    return [
        ("text prompt 10 MB", {"json": {"prompt": "a " * (5 * MB), "max_tokens": 2}}),
        ("text prompt 50 MB", {"json": {"prompt": "a " * (25 * MB), "max_tokens": 2}}),
        (
            "token ids 50 MB",
            {"content": b'{"max_tokens":2,"prompt":[' + b"11," * (16 * MB) + b"11]}"},
        ),
        (
            "JSON nested 100,000 deep",
            {"content": b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
        ),
        (
            "zero penalties as floats",
            {
                "json": {
                    "prompt": "Hi",
                    "max_tokens": 2,
                    "frequency_penalty": 0.0,
                    "presence_penalty": 0.0,
                }
            },
        ),
        ("seed 2**32 + 42", {"json": {**sampled, "seed": 2**32 + 42}}),
        ("top_k 3", {"json": {**sampled, "top_k": 3}}),
        ("top_k 9", {"json": {**sampled, "top_k": 9}}),
        ("top_k 1000", {"json": {**sampled, "top_k": 1000}}),
        ("top_p 0.5, top_k 0", {"json": {**sampled, "top_p": 0.5, "top_k": 0}}),
        ("repeat_last_n 4096", {"json": {**sampled, "repeat_penalty": 1.1, "repeat_last_n": 4096}}),
        ("default sampled after it", {"json": sampled}),
        (
            "text/plain body",
            {"content": json.dumps(sampled).encode(), "headers": {"Content-Type": "text/plain"}},
        ),
        ("foreign Host", {"json": sampled, "headers": {"Host": "evil.example"}}),
    ]


class Probe:
    """/health every 0.1 s and one greedy stream, restarted as it ends: their worst waits."""

    def __init__(self, url: str):
        self.url, self.health_max, self.gap_max, self.errors = url, 0.0, 0.0, []
        self.stop = asyncio.Event()

    def reset(self) -> None:
        self.health_max = self.gap_max = 0.0

    async def health(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            r = await client.get(self.url + "/health")
            self.health_max = max(self.health_max, time.perf_counter() - t)
            if r.status_code != 200:
                self.errors.append(f"/health {r.status_code}")
            await asyncio.sleep(0.1)

    async def stream(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": "def fibonacci(n):", "max_tokens": 64, "stream": True, "ignore_eos": True}
        while not self.stop.is_set():
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                last = time.perf_counter()
                async for _ in r.aiter_lines():
                    now = time.perf_counter()
                    self.gap_max = max(self.gap_max, now - last)
                    last = now


def cut_body(url: str) -> str:
    """A POST that announces 1 MB and sends 10 bytes, then hangs up."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b'application/json\r\nContent-Length: 1000000\r\n\r\n{"prompt":'
        )
    return "sent 10 of 1,000,000 bytes, hung up"


async def run(url: str, pid: int | None, max_stall: float) -> tuple[list[dict], dict]:
    rss = {"before_mb": _rss_mb(pid), "peak_mb": _rss_mb(pid)}
    probe = Probe(url)
    timeout = httpx.Timeout(300.0)
    async with httpx.AsyncClient(timeout=timeout) as bg, httpx.AsyncClient(timeout=timeout) as cl:
        tasks = [asyncio.create_task(probe.health(bg)), asyncio.create_task(probe.stream(bg))]
        await asyncio.sleep(2.0)
        rows = []
        for name, req in attacks() + [("body cut off mid-way", {})]:
            probe.reset()
            t = time.perf_counter()
            if not req:
                status, detail = None, await asyncio.to_thread(cut_body, url)
            else:
                headers = {"Content-Type": "application/json", **req.get("headers", {})}
                r = await cl.post(
                    url + "/v1/completions",
                    json=req.get("json"),
                    content=req.get("content"),
                    headers=headers,
                )
                status, detail = r.status_code, r.text[:120]
            took = time.perf_counter() - t
            await asyncio.sleep(1.0)  # the probe's view of what came after
            rss["peak_mb"] = max(filter(None, [rss["peak_mb"], _rss_mb(pid)]), default=None)
            row = {
                "attack": name,
                "status": status,
                "seconds": round(took, 3),
                "health_max_s": round(probe.health_max, 3),
                "stream_gap_max_s": round(probe.gap_max, 3),
                "detail": detail,
            }
            row["ok"] = (status is None or status < 500) and max(
                probe.health_max, probe.gap_max
            ) <= max_stall
            rows.append(row)
            print(
                f"{'ok ' if row['ok'] else 'BAD'} {name:28s} {status!s:5s} {took:7.2f} s  "
                f"/health max {probe.health_max:.3f} s  stream gap max {probe.gap_max:.3f} s  "
                f"{detail[:70]!r}",
                flush=True,
            )
        probe.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(5.0)
    rss["after_mb"] = _rss_mb(pid)
    return rows, rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--pid", type=int, default=None, help="the server's process id, for its RSS")
    ap.add_argument(
        "--max-stall", type=float, default=1.0, help="seconds /health or a stream may wait"
    )
    ap.add_argument("--json", help="write the rows and RSS here")
    a = ap.parse_args(argv)
    if urlparse(a.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("error: --url must be a loopback address", file=sys.stderr)
        return 2
    rows, rss = asyncio.run(run(a.url, a.pid, a.max_stall))
    grew = None
    if rss["before_mb"] and rss["after_mb"]:
        grew = rss["after_mb"] / rss["before_mb"] - 1
        print(
            f"RSS before {rss['before_mb']:.0f} MB, peak {rss['peak_mb']:.0f} MB, after "
            f"{rss['after_mb']:.0f} MB ({grew:+.1%})"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "rss": rss}, f, indent=1)
    bad = [r["attack"] for r in rows if not r["ok"]] + (
        ["RSS"] if grew is not None and grew > 0.10 else []
    )
    print("all attacks held" if not bad else f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
