"""Soak test of a running local server: many clients mixing valid, malformed, oversized and
disconnecting requests for a bounded time, then checks that nothing leaked or drifted.

    python -m minfer_bench.soak --url http://127.0.0.1:8080 --clients 64 --minutes 10 \\
        [--pid PID] [--json out.json]

First every reference request (a few short greedy prompts: text, token ids, chat; streamed and not)
runs alone, one at a time, and its text is kept. Then `--clients` clients send, one request after
another until `--minutes` are up, a random mix (seeded per client):
  valid       a reference request again, whose text must equal its text alone, or a seeded sampled
              one
  malformed   broken JSON, JSON nested 100,000 deep, wrong types, unsupported settings, lone
              surrogates, a wrong Content-Type or Host: each must get its 4xx
  oversized   a body over --max-body-bytes (413), a prompt over the character limit, the context,
              the message count (400): the limits come from /v1/models
  disconnect  a stream closed after its first event, a non-streamed request abandoned, a body cut
              off
A 429 (queue full) is retried after its Retry-After. Meanwhile a thread of its own times /health
every 0.25 s and scrapes /metrics every 5 s. At the end: the server must go idle with no slot in
use and every accepted request finished (/metrics), the references run alone must still give their
texts, and with --pid the server's RSS is reported before, at its peak and after.

Bounded: at most MAX_CLIENTS clients and MAX_MINUTES minutes, loopback URLs only; it stops by
itself. Exit status 0 when every check passed, 1 when one failed, 2 for a bad flag or an unreachable
server.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import sys
import threading
import time
from collections.abc import Sequence

from minfer_jax.engine.flags import StrictParser

from minfer_bench.load_test import LOOPBACK, LoadTestError, server_metrics, wait_idle

MAX_CLIENTS = 256
MAX_MINUTES = 60.0
HEALTH_EVERY_S, METRICS_EVERY_S = 0.25, 5.0
MAX_RETRIES_429 = 30
IDLE_TIMEOUT_S = 120.0
MIX = {"valid": 0.45, "sampled": 0.10, "malformed": 0.20, "oversized": 0.10, "disconnect": 0.15}
REFERENCES = [  # (endpoint, body): short greedy requests whose text must never change
    ("completions", {"prompt": "def fibonacci(n):", "max_tokens": 8}),
    ("completions", {"prompt": "The capital of France is", "max_tokens": 6}),
    ("completions", {"prompt": [785, 3974, 13876, 38835], "max_tokens": 6}),
    ("completions", {"prompt": "import numpy as np\n", "max_tokens": 8, "stop": ["\n\n"]}),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "Name a prime number."}], "max_tokens": 6},
    ),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Say hi <|im_start|>"},
            ],
            "max_tokens": 6,
        },
    ),
]
MALFORMED = [  # (endpoint, raw body, headers, expected status)
    ("completions", b'{"prompt": "hi", "max_tokens": 4', None, 400),
    ("completions", b"[" * 100_000 + b"]" * 100_000, None, 400),
    ("completions", b'{"prompt": "hi", "temperature": "hot"}', None, 400),
    ("completions", b'{"prompt": "hi", "n": 0}', None, 400),
    ("completions", b'{"prompt": "a\\ud800b"}', None, 400),
    ("completions", b'{"prompt": [151936]}', None, 400),
    ("completions", b'{"prompt": "hi", "stop": ["\\udc80"]}', None, 400),
    ("chat/completions", b'{"messages": []}', None, 400),
    ("chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', None, 400),
    ("completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415),
    (
        "completions",
        b'{"prompt": "hi"}',
        {"Content-Type": "application/json", "Host": "evil.example"},
        403,
    ),
    (
        "completions",
        b'{"prompt": "hi"}',
        {"Content-Type": "application/json", "Origin": "https://evil.example"},
        403,
    ),
    ("nothing-here", b'{"prompt": "hi"}', None, 404),
]


class SoakError(LoadTestError):
    """A soak setting out of its bounds, or a server that cannot be soaked."""


@dataclasses.dataclass
class Tally:
    """Counts and failures of the run: kind -> status -> count; mismatches and unexpected
    answers."""

    counts: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    failures: list = dataclasses.field(default_factory=list)
    health_s: list = dataclasses.field(default_factory=list)
    slots_seen: int = 0
    rss_peak_mb: float = 0.0

    def note(self, kind: str, status) -> None:
        self.counts[kind][str(status)] += 1

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _check(url: str, clients: int, minutes: float) -> None:
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SoakError(
            f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), got host {host!r}"
        )
    if not 1 <= clients <= MAX_CLIENTS:
        raise SoakError(f"--clients must be in 1..{MAX_CLIENTS}, got {clients}")
    if not 0 < minutes <= MAX_MINUTES:
        raise SoakError(f"--minutes must be in (0, {MAX_MINUTES:g}], got {minutes}")


async def _text_of(
    client, url: str, endpoint: str, body: dict, stream: bool
) -> tuple[int, str | None]:
    """(status, generated text) of one request, retried on 429."""
    body = {**body, "temperature": body.get("temperature", 0), "stream": stream}
    for _ in range(MAX_RETRIES_429):
        if not stream:
            r = await client.post(f"{url}/v1/{endpoint}", json=body)
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            if r.status_code != 200:
                return r.status_code, None
            choice = r.json()["choices"][0]
            return 200, choice["message"]["content"] if endpoint.startswith("chat") else choice[
                "text"
            ]
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            pieces = []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, None
                for choice in chunk.get("choices", []):
                    pieces.append(
                        (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    )
            return 200, "".join(pieces)
    return 429, None


async def _references(client, url: str) -> list[str]:
    out = []
    for endpoint, body in REFERENCES:
        status, text = await _text_of(client, url, endpoint, body, stream=False)
        if status != 200 or text is None:
            raise SoakError(f"reference request {endpoint} {body} answered {status}")
        out.append(text)
    return out


async def _valid(client, url, rng, refs, tally: Tally) -> None:
    i = rng.randrange(len(REFERENCES))
    endpoint, body = REFERENCES[i]
    status, text = await _text_of(client, url, endpoint, body, stream=rng.random() < 0.5)
    tally.note("valid", status)
    if status != 200:
        tally.fail(f"valid request #{i} answered {status}")
    elif text != refs[i]:
        tally.fail(f"valid request #{i} gave {text!r}, alone {refs[i]!r}")


async def _sampled(client, url, rng, tally: Tally) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": rng.randrange(2**64),
    }
    status, _ = await _text_of(client, url, "completions", body, stream=rng.random() < 0.5)
    tally.note("sampled", status)
    if status != 200:
        tally.fail(f"sampled request answered {status}")


async def _malformed(client, url, rng, tally: Tally) -> None:
    endpoint, raw, headers, want = rng.choice(MALFORMED)
    r = await client.post(
        f"{url}/v1/{endpoint}", content=raw, headers=headers or {"Content-Type": "application/json"}
    )
    tally.note("malformed", r.status_code)
    if r.status_code != want:
        tally.fail(
            f"malformed {raw[:40]!r} answered {r.status_code}, expected {want}: {r.text[:120]}"
        )


async def _oversized(client, url, rng, meta: dict, tally: Tally) -> None:
    ctx, chars, body_limit = meta["n_ctx"], meta["max_prompt_chars"], meta["max_body_bytes"]
    kind = rng.randrange(5)
    if kind == 0:
        raw, endpoint, want = b'{"prompt": "' + b"a" * (body_limit + 1) + b'"}', "completions", 413
    elif kind == 1:
        raw, endpoint, want = (
            json.dumps({"prompt": "a" * (chars + 1)}).encode(),
            "completions",
            413 if chars + 16 > body_limit else 400,
        )
    elif kind == 2:
        raw, endpoint, want = json.dumps({"prompt": [1] * ctx}).encode(), "completions", 400
    elif kind == 3:
        messages = [{"role": "user", "content": "hi"}] * (meta["max_messages"] + 1)
        raw, endpoint, want = json.dumps({"messages": messages}).encode(), "chat/completions", 400
    else:
        raw, endpoint, want = (
            json.dumps({"prompt": "hello world " * ctx}).encode(),
            "completions",
            400,
        )
    r = await client.post(
        f"{url}/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"}
    )
    tally.note("oversized", r.status_code)
    if r.status_code != want:
        tally.fail(
            f"oversized kind {kind} answered {r.status_code}, expected {want}: {r.text[:120]}"
        )


async def _disconnect(client, url, rng, tally: Tally) -> None:
    kind = rng.randrange(3)
    body = {"prompt": f"keep talking {rng.randrange(10**6)}", "max_tokens": -1, "temperature": 0}
    try:
        if kind == 0:  # a stream closed after its first event
            async with client.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}
            ) as r:
                async for _ in r.aiter_lines():
                    break
        elif kind == 1:  # a non-streamed request abandoned
            await asyncio.wait_for(
                client.post(f"{url}/v1/completions", json=body), timeout=rng.uniform(0.1, 2.0)
            )
        else:  # a body cut off half way
            host, port = url.split("//")[1].rsplit(":", 1)
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                b'Content-Length: 4096\r\n\r\n{"prompt": "cut'
            )
            await writer.drain()
            writer.close()
    except (TimeoutError, OSError):
        pass
    tally.note("disconnect", kind)


async def _client(client, url, seed: int, deadline: float, refs, meta, tally: Tally) -> None:
    import httpx

    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        try:
            if kind == "valid":
                await _valid(client, url, rng, refs, tally)
            elif kind == "sampled":
                await _sampled(client, url, rng, tally)
            elif kind == "malformed":
                await _malformed(client, url, rng, tally)
            elif kind == "oversized":
                await _oversized(client, url, rng, meta, tally)
            else:
                await _disconnect(client, url, rng, tally)
        except (
            httpx.HTTPError
        ) as e:  # a valid or refused request must get an answer, not a dropped connection
            tally.note(kind, type(e).__name__)
            tally.fail(f"{kind}: {type(e).__name__}: {e}")


def _watch(url: str, pid: int | None, stop: threading.Event, tally: Tally) -> None:
    """Times /health and scrapes /metrics from a thread of its own, so that a busy client event
    loop is not counted as the server's latency."""
    import httpx

    next_metrics = 0.0
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = c.get(f"{url}/health")
                tally.health_s.append(time.perf_counter() - t)
                if r.status_code != 200:
                    tally.fail(f"/health answered {r.status_code}")
                if time.monotonic() >= next_metrics:
                    next_metrics = time.monotonic() + METRICS_EVERY_S
                    m = server_metrics(c.get(f"{url}/metrics").text)
                    tally.slots_seen = max(tally.slots_seen, int(m["minfer_kv_slots_used"]))
                    if m["minfer_kv_slots_used"] > m["minfer_kv_slots_capacity"]:
                        tally.fail(f"more slots used than exist: {m}")
            except httpx.HTTPError as e:
                tally.fail(f"/health or /metrics: {type(e).__name__}: {e}")
            tally.rss_peak_mb = max(tally.rss_peak_mb, _rss_mb(pid) or 0.0)
            stop.wait(HEALTH_EVERY_S)


async def run(
    url: str, *, clients: int = 64, minutes: float = 10.0, pid: int | None = None, seed: int = 0
) -> dict:
    """The soak; returns its figures and failures (see the module docstring)."""
    import httpx

    url = url.rstrip("/")
    _check(url, clients, minutes)
    tally = Tally()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        r = await client.get(f"{url}/v1/models")
        if r.status_code != 200:
            raise SoakError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:200]}")
        meta = r.json()["data"][0]["meta"]
        refs = await _references(client, url)
        rss_before = _rss_mb(pid)
        # from idle: a request still running then would count as finished but not accepted
        before = await wait_idle(client, url, IDLE_TIMEOUT_S, "the references", SoakError)
        stop = threading.Event()
        watcher = asyncio.create_task(asyncio.to_thread(_watch, url, pid, stop, tally))
        t0 = time.monotonic()
        deadline = t0 + minutes * 60
        await asyncio.gather(
            *(
                _client(client, url, seed * 1000 + i, deadline, refs, meta, tally)
                for i in range(clients)
            )
        )
        wall = time.monotonic() - t0
        idle = await wait_idle(client, url, IDLE_TIMEOUT_S, "the soak", SoakError)
        stop.set()
        await watcher
        again = await _references(client, url)
        for i, (a, b) in enumerate(zip(refs, again)):
            if a != b:
                tally.fail(f"reference #{i} alone after the soak gave {b!r}, before {a!r}")
        await asyncio.sleep(2.0)  # let the allocator settle before the last RSS reading
        rss_after = _rss_mb(pid)
    finished = sum(
        v - before.get(k, 0) for k, v in idle.items() if k.startswith("minfer_requests_finished")
    )
    accepted = idle["minfer_requests_total"] - before["minfer_requests_total"]
    if finished != accepted:
        tally.fail(f"{accepted:.0f} requests accepted but {finished:.0f} finished (a leak?)")
    health = sorted(tally.health_s)
    return {
        "url": url,
        "clients": clients,
        "minutes": minutes,
        "wall_s": round(wall, 1),
        "requests": {k: dict(v) for k, v in sorted(tally.counts.items())},
        "requests_total": sum(sum(v.values()) for v in tally.counts.values()),
        "accepted": int(accepted),
        "finished": int(finished),
        "tokens_generated": int(
            idle["minfer_tokens_generated_total"] - before["minfer_tokens_generated_total"]
        ),
        "most_slots_used": tally.slots_seen,
        "slots_used_after": int(idle["minfer_kv_slots_used"]),
        "health_checks": len(health),
        "health_max_s": round(health[-1], 3) if health else None,
        "health_p99_s": round(health[int(0.99 * (len(health) - 1))], 3) if health else None,
        "rss_mb_before": rss_before,
        "rss_mb_peak": tally.rss_peak_mb or None,
        "rss_mb_after": rss_after,
        "failures": tally.failures,
    }


def build_parser() -> argparse.ArgumentParser:
    p = StrictParser(
        prog="python -m minfer_bench.soak",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8080", help="the server (loopback only; no --api-key)"
    )
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the mix runs (default 10)")
    p.add_argument("--pid", type=int, default=None, help="the server's process id, for its RSS")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' mixes")
    p.add_argument(
        "--json", metavar="FILE", default=None, help="write the figures as JSON ('-': stdout)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    try:
        summary = asyncio.run(
            run(args.url, clients=args.clients, minutes=args.minutes, pid=args.pid, seed=args.seed)
        )
    except (SoakError, OSError, httpx.HTTPError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    if args.json == "-":
        print(text)
    else:
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    for failure in summary["failures"][:10]:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
