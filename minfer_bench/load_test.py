"""Load test of a running server: N concurrent streaming clients, latency and throughput figures.

    python -m minfer_bench.load_test --url http://127.0.0.1:8080 --clients 8 --requests 32 \\
        --max-tokens 128 --prompt-tokens 512 [--json out.json] [--out out.md]

Each client sends streamed /v1/completions requests one after another until `--requests` have
been sent in all. A prompt is `--prompt-tokens` random token ids (seeded, different per request,
below n_vocab - 512: the top of Qwen's vocabulary holds its control tokens), so no two requests
share a prefix. Greedy by default. First `--warmup` requests of the same shape run and are not
counted (they compile the executables the measured run needs).

Figures (client side, on loopback):
  aggregate tokens/s  completion tokens of all measured requests / wall time of the measured run
  TTFT                request sent -> first non-empty text event
  ITL                 gap between consecutive text events (the server streams once per decode
                      chunk, so one event may carry several tokens: vLLM's benchmark counts the
                      same)
  TPOT                per request, (last event - first event) / (completion tokens - 1)
Bounded: at most MAX_CLIENTS clients and MAX_REQUESTS requests, `--timeout` seconds in all, and
loopback URLs only (this is a benchmark of the local server, not a traffic generator).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import numpy as np

from minfer_jax.engine.flags import StrictParser
from minfer_jax.errors import MinferError

MAX_CLIENTS = 256
MAX_REQUESTS = 10_000
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
RESERVED_TOP_IDS = 512  # random prompt ids stay below n_vocab - this


class LoadTestError(MinferError, ValueError):
    """A load-test setting outside its bounds, or a server that cannot be tested."""


@dataclasses.dataclass
class Timing:
    sent: float
    events: list[float] = dataclasses.field(
        default_factory=list
    )  # arrival of each non-empty text event
    completion_tokens: int = 0
    error: str | None = None
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.sent if self.events else None


def _check(url: str, clients: int, requests: int, max_tokens: int, prompt_tokens: int) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise LoadTestError(
            f"--url must point at this machine ({', '.join(sorted(LOOPBACK))}), got host {host!r}"
        )
    for name, v, hi in (
        ("clients", clients, MAX_CLIENTS),
        ("requests", requests, MAX_REQUESTS),
        ("max-tokens", max_tokens, 1 << 16),
        ("prompt-tokens", prompt_tokens, 1 << 20),
    ):
        if not 1 <= v <= hi:
            raise LoadTestError(f"--{name} must be in 1..{hi}, got {v}")


async def _vocab(client, url: str) -> int:
    r = await client.get(f"{url}/v1/models")
    if r.status_code != 200:
        raise LoadTestError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:200]}")
    meta = r.json()["data"][0].get("meta") or {}
    return int(meta.get("n_vocab", 32000))


async def _one(client, url: str, body: dict) -> Timing:
    t = Timing(sent=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                t.error = (
                    f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                )
                return t
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    t.error = str(chunk["error"].get("message"))
                elif chunk.get("usage"):
                    t.completion_tokens = int(chunk["usage"]["completion_tokens"])
                elif chunk["choices"] and chunk["choices"][0].get("text"):
                    t.events.append(time.perf_counter())
    except Exception as e:  # a dropped connection counts as a failed request, not a crash
        t.error = f"{type(e).__name__}: {e}"
    finally:
        t.end = time.perf_counter()
    return t


async def _run_all(client, url: str, bodies: list[dict], clients: int) -> list[Timing]:
    todo = iter(bodies)
    out: list[Timing] = []

    async def worker():
        for body in todo:  # the iterator is shared: each body goes to exactly one client
            out.append(await _one(client, url, body))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return out


def _bodies(
    n: int,
    first: int,
    prompt_tokens: int,
    max_tokens: int,
    vocab: int,
    temperature: float,
    seed: int,
    ignore_eos: bool = False,
) -> list[dict]:
    hi = max(vocab - RESERVED_TOP_IDS, 1)
    out = []
    for i in range(first, first + n):
        ids = np.random.default_rng([seed, i]).integers(0, hi, prompt_tokens).tolist()
        out.append(
            {
                "prompt": ids,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": i,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        if (
            ignore_eos
        ):  # llama-server's field: every requested token is generated, as with random weights
            out[-1]["ignore_eos"] = True
    return out


def server_metrics(text: str) -> dict[str, float]:
    """The server's /metrics text as {series (with its labels): value}."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def wait_idle(
    client, url: str, timeout: float, after: str, error: type[LoadTestError] = LoadTestError
) -> dict[str, float]:
    """The server's metrics once no slot, running or queued request is left; error (naming what
    it is `after`) if it is still busy after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = server_metrics((await client.get(f"{url}/metrics")).text)
        busy = m["minfer_kv_slots_used"] + m["minfer_requests_running"]
        waiting = m["minfer_requests_queued"] + m.get("minfer_requests_preparing", 0)
        if busy + waiting == 0:
            return m
        if time.monotonic() > deadline:
            raise error(f"the server is still busy {timeout:g} s after {after}: {m}")
        await asyncio.sleep(0.5)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(timings: list[Timing], wall: float, settings: dict) -> dict:
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    itl = [b - a for t in ok for a, b in zip(t.events, t.events[1:])]
    tpot = [
        (t.events[-1] - t.events[0]) / (t.completion_tokens - 1)
        for t in ok
        if len(t.events) >= 2 and t.completion_tokens > 1
    ]
    tokens = sum(t.completion_tokens for t in ok)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {
        **settings,
        "ok": len(ok),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_ms_p50": ms(_pct(ttft, 50)),
        "ttft_ms_p99": ms(_pct(ttft, 99)),
        "itl_ms_p50": ms(_pct(itl, 50)),
        "itl_ms_p99": ms(_pct(itl, 99)),
        "itl_ms_max": ms(max(itl, default=None)),
        "tokens_per_event": tokens / max(sum(len(t.events) for t in ok), 1),
        "tpot_ms_p50": ms(_pct(tpot, 50)),
        "tpot_ms_p99": ms(_pct(tpot, 99)),
        "e2e_s_p50": _pct([t.end - t.sent for t in ok], 50),
    }


COLUMNS = [
    ("clients", "clients", "d"),
    ("requests", "requests", "d"),
    ("ok", "ok", "d"),
    ("prompt_tokens", "PP", "d"),
    ("max_tokens", "TG", "d"),
    ("wall_s", "wall s", ".2f"),
    ("completion_tokens", "tokens", "d"),
    ("tokens_per_s", "tok/s", ".1f"),
    ("ttft_ms_p50", "TTFT p50 ms", ".1f"),
    ("ttft_ms_p99", "TTFT p99 ms", ".1f"),
    ("itl_ms_p50", "ITL p50 ms", ".1f"),
    ("itl_ms_p99", "ITL p99 ms", ".1f"),
    ("itl_ms_max", "ITL max ms", ".1f"),
    ("tokens_per_event", "tokens/event", ".2f"),
    ("tpot_ms_p50", "TPOT p50 ms", ".2f"),
    ("tpot_ms_p99", "TPOT p99 ms", ".2f"),
]


def markdown(summary: dict) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    rule = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    cells = ["-" if summary.get(k) is None else format(summary[k], f) for k, _, f in COLUMNS]
    return "\n".join([head, rule, "| " + " | ".join(cells) + " |"])


async def run(
    url: str,
    *,
    clients: int = 8,
    requests: int = 32,
    max_tokens: int = 128,
    prompt_tokens: int = 512,
    warmup: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    timeout: float = 600.0,
    api_key: str | None = None,
    ignore_eos: bool = False,
) -> dict:
    """The load test; returns summarize()'s dict (see the module docstring)."""
    import httpx

    url = url.rstrip("/")
    _check(url, clients, requests, max_tokens, prompt_tokens)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=httpx.Timeout(timeout)
    ) as client:
        vocab = await _vocab(client, url)
        n_warm = clients if warmup is None else warmup
        warm = _bodies(
            n_warm, requests, prompt_tokens, max_tokens, vocab, temperature, seed, ignore_eos
        )
        await asyncio.wait_for(_run_all(client, url, warm, clients), timeout)
        bodies = _bodies(
            requests, 0, prompt_tokens, max_tokens, vocab, temperature, seed, ignore_eos
        )
        t0 = time.perf_counter()
        timings = await asyncio.wait_for(_run_all(client, url, bodies, clients), timeout)
        wall = time.perf_counter() - t0
    settings = dict(
        url=url,
        clients=clients,
        requests=requests,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        warmup=n_warm,
        temperature=temperature,
    )
    return summarize(timings, wall, settings)


def build_parser() -> argparse.ArgumentParser:
    p = StrictParser(
        prog="python -m minfer_bench.load_test",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (loopback only)")
    p.add_argument(
        "--clients", type=int, default=8, help="concurrent streaming clients (default 8)"
    )
    p.add_argument("--requests", type=int, default=32, help="measured requests in all (default 32)")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="unmeasured requests first (default: --clients)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds for each of warm-up and run (default 600)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help='add "ignore_eos": true to each request (llama-server: generate every requested '
        "token)",
    )
    p.add_argument(
        "--json", metavar="FILE", default=None, help="write the figures as JSON ('-': stdout)"
    )
    p.add_argument(
        "--out", metavar="FILE", default=None, help="also write the markdown table to FILE"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    try:
        summary = asyncio.run(
            run(
                args.url,
                clients=args.clients,
                requests=args.requests,
                max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens,
                warmup=args.warmup,
                temperature=args.temperature,
                seed=args.seed,
                timeout=args.timeout,
                api_key=args.api_key,
                ignore_eos=args.ignore_eos,
            )
        )
    except (LoadTestError, OSError, TimeoutError, httpx.HTTPError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    table = markdown(summary)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    else:
        print(table)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if summary["errors"]:
        print(f"{summary['failed']} requests failed, e.g.: {summary['errors'][0]}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
