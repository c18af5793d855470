"""Agent load test of a running local server: many clients mixing streamed and whole chat and
completions with and without speculation, JSON-schema output, tool calls, Anthropic's Messages
API, logprobs, n > 1, stop strings, cancelled streams and hostile fields; every reply checked
against its contract, failures reported per kind.

    python -m minfer_bench.agent_load --url http://127.0.0.1:8080 --clients 16 --requests 300 \\
        [--kinds chat,schema,tools,anthropic,...] [--reference-url URL] [--log server.log] \\
        [--json out.json]

Start the server with speculation on (`--spec-type ngram-simple`) and `--max-queued` >= clients.
First every greedy request of the mix runs alone, unstreamed, with `speculative.n_max: 0` (or on
--reference-url, a server without --spec-type): its text and calls are kept. Then `--clients`
clients send `--requests` seeded random cases (agent_cases.py) and each reply is checked:
  contract   status as expected (never 5xx), stream well formed (one finish per choice, usage
             chunk, [DONE]; Anthropic's event order), schema / tool arguments valid, stop strings
             absent, logprobs one per token, n choices
  greedy     text and calls equal the reference's (speculation on vs off, batched vs alone),
             reported as KIND/greedy (on a GPU bit for bit only with the server's --deterministic)
  hang       no reply within --request-timeout
Then the server must go idle with no slot held; /metrics: requests accepted == finished, drafted
>= accepted >= the replies' own `timings`; with --log, no traceback in the server's log. Exit
status 0 when every check passed, 1 when one failed, 2 when the server could not be tested.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from minfer_jax.engine.flags import StrictParser

from minfer_bench import agent_cases as cases
from minfer_bench import agent_wire as wire
from minfer_bench.agent_hostile import hostile_case
from minfer_bench.load_bench import free_port, stop_server, wait_healthy, wait_settled
from minfer_bench.load_test import LOOPBACK, LoadTestError, wait_idle

MAX_CLIENTS, MAX_REQUESTS = 256, 100_000
KINDS = {
    "chat": cases.chat_case,
    "completion": cases.completion_case,
    "n>1": cases.sampled_n_case,
    "logprobs": cases.logprobs_case,
    "schema": cases.schema_case,
    "tools": cases.tools_case,
    "anthropic": cases.anthropic_case,
    "cancel": cases.cancel_case,
    "hostile": hostile_case,
}
# relative shares of the mix: the agent kinds most
WEIGHTS = {"chat": 3, "completion": 2, "n>1": 1, "logprobs": 1, "schema": 3, "tools": 3,
           "anthropic": 3, "cancel": 1.5, "hostile": 1.5}  # fmt: skip
IDLE_TIMEOUT_S = 180.0
READY_TIMEOUT_S = 1800.0  # --serve: the model loads and its first executables compile


class Report:
    """Per kind: statuses seen and failures (the first few of each kind kept whole)."""

    def __init__(self):
        self.statuses: dict = collections.defaultdict(collections.Counter)
        self.failures: dict = collections.defaultdict(list)
        self.failed: collections.Counter = collections.Counter()
        self.cut: collections.Counter = collections.Counter()  # replies cut at max_tokens
        self.drafts = {"draft_n": 0, "draft_n_accepted": 0}

    def note(self, kind: str, status) -> None:
        self.statuses[kind][str(status)] += 1

    def fail(self, kind: str, what: str) -> None:
        self.failed[kind] += 1
        if len(self.failures[kind]) < 8:
            self.failures[kind].append(what[:600])


def _reference_body(case: cases.Case) -> dict:
    body = {k: v for k, v in case.body.items() if k not in ("stream", "stream_options")}
    if case.endpoint != "messages":
        body[cases.SPEC] = 0
    return body


async def _references(client, url: str, todo: list[cases.Case], report: Report) -> dict:
    """Each greedy key's reply alone (one request at a time), speculation off."""
    refs: dict = {}
    for case in todo:
        if case.greedy_key is None or case.greedy_key in refs:
            continue
        ref = cases.Case(case.kind, case.endpoint, _reference_body(case))
        out = await wire.send(client, url, ref)
        if out.status != 200 or out.problems:
            report.fail(case.kind, f"reference {case.greedy_key}: {out.status} {out.problems} "
                        f"{out.body[:200]}")  # fmt: skip
            continue
        refs[case.greedy_key] = out.signature()
    return refs


def _judge(case: cases.Case, out: cases.Outcome, refs: dict, report: Report) -> None:
    report.note(case.kind, out.status)
    head = f"{case.endpoint} {json.dumps(case.body)[:300]}"
    if out.status not in case.expect:
        report.fail(case.kind, f"{out.status} (expected {sorted(case.expect)}): {head} -> "
                    f"{out.body[:300]}")  # fmt: skip
        return
    if any(c.finish in ("length", "max_tokens") for c in out.choices):
        report.cut[case.kind] += 1  # cut at max_tokens: a schema or call may be unfinished
    problems = list(out.problems)
    if out.status == 200 and case.cancel_after is None and case.check is not None:
        problems += case.check(case, out)
    problems += _count_problems(case, out)
    want = refs.get(case.greedy_key)
    if out.status == 200 and want is not None and out.signature() != want:
        # its own bucket: on a GPU outside --deterministic, batching may part near ties
        report.fail(f"{case.kind}/greedy", f"{out.signature()!r} differs from alone {want!r} "
                    f"[{head}]")  # fmt: skip
    if out.timings:
        for k in report.drafts:
            report.drafts[k] += int(out.timings.get(k, 0))
    for p in problems:
        report.fail(case.kind, f"{p} [{head}]")


def _count_problems(case: cases.Case, out: cases.Outcome) -> list[str]:
    """A reply never holds more tokens than max_tokens (speculation accepts several a step), and
    says it was cut exactly when it was."""
    limit, usage = case.body.get("max_tokens"), out.usage or {}
    made = usage.get("output_tokens", usage.get("completion_tokens"))
    if out.status != 200 or case.cancel_after is not None or limit is None or made is None:
        return []
    n = case.body.get("n", 1)
    if made > n * limit:
        return [f"{made} tokens for max_tokens {limit} x {n}"]
    cut = [c.finish in ("length", "max_tokens") for c in out.choices]
    if n == 1 and cut and cut[0] and made != limit:
        return [f"finish {out.choices[0].finish!r} with {made} of max_tokens {limit} tokens"]
    return []


async def _worker(client, url, queue: collections.deque, refs, report, timeout: float):
    while queue:
        case = queue.popleft()
        try:
            out = await asyncio.wait_for(wire.send(client, url, case), timeout)
        except TimeoutError:
            report.note(case.kind, "hang")
            report.fail(case.kind, f"no reply in {timeout:g} s: {case.endpoint} "
                        f"{json.dumps(case.body)[:300]}")  # fmt: skip
            continue
        _judge(case, out, refs, report)


def _metric_checks(before: dict, after: dict, report: Report) -> dict:
    delta = {k: after[k] - before.get(k, 0) for k in after}
    finished = sum(v for k, v in delta.items() if k.startswith("minfer_requests_finished"))
    accepted = delta["minfer_requests_total"]
    drafted = delta["minfer_draft_tokens_total"]
    taken = delta["minfer_draft_tokens_accepted_total"]
    if finished != accepted:
        report.fail("metrics", f"{accepted:.0f} requests accepted, {finished:.0f} finished")
    if not drafted >= taken >= 0:
        report.fail("metrics", f"{taken:.0f} draft tokens accepted of {drafted:.0f} drafted")
    if report.drafts["draft_n"] > drafted or report.drafts["draft_n_accepted"] > taken:
        report.fail("metrics", f"replies' timings {report.drafts} exceed /metrics' {drafted:.0f}"
                    f" / {taken:.0f}")  # fmt: skip
    if after["minfer_kv_slots_used"] != 0:
        report.fail("metrics", f"{after['minfer_kv_slots_used']:.0f} slots held when idle")
    return {"accepted": accepted, "finished": finished, "drafted": drafted,
            "draft_accepted": taken,
            "tokens": delta["minfer_tokens_generated_total"]}  # fmt: skip


def _log_tracebacks(path: str | None, start: int, report: Report) -> None:
    if path is None:
        return
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    for i, line in enumerate(lines := text.splitlines()):
        if line.startswith("Traceback") or " 500 " in line:
            report.fail("server log", "\n".join(lines[i : i + 30]))


def plan(kinds: list[str], requests: int, seed: int) -> list[cases.Case]:
    """The seeded mix: `requests` cases of the given kinds by their weights."""
    rng = random.Random(seed)
    weights = [WEIGHTS[k] for k in kinds]
    return [KINDS[rng.choices(kinds, weights)[0]](rng) for _ in range(requests)]


async def run(
    url: str,
    *,
    clients: int = 16,
    requests: int = 300,
    kinds: list[str] | None = None,
    seed: int = 0,
    reference_url: str | None = None,
    references: str | None = None,
    log: str | None = None,
    request_timeout: float = 600.0,
) -> dict:
    """The agent load test; returns its figures and failures per kind (module docstring)."""
    import httpx

    url = url.rstrip("/")
    kinds = kinds or list(KINDS)
    _check(url, clients, requests, kinds)
    report = Report()
    todo = plan(kinds, requests, seed)
    log_start = 0 if log is None else _size(log)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout)) as client:
        t0 = time.monotonic()
        refs = _load_references(references)
        more = [c for c in todo if c.greedy_key not in refs]
        refs |= await _references(client, (reference_url or url).rstrip("/"), more, report)
        _save_references(references, refs)
        ref_s = time.monotonic() - t0
        # from idle: a request still running then (an earlier run's abandoned one, still being
        # prepared when that run's last look found the server idle) would count as finished only
        before = await wait_idle(client, url, IDLE_TIMEOUT_S, "the references")
        queue = collections.deque(todo)
        t0 = time.monotonic()
        await asyncio.gather(
            *(_worker(client, url, queue, refs, report, request_timeout) for _ in range(clients))
        )
        wall = time.monotonic() - t0
        after = await wait_idle(client, url, IDLE_TIMEOUT_S, "the run")
        counts = _metric_checks(before, after, report)
    _log_tracebacks(log, log_start, report)
    return {
        "url": url, "clients": clients, "requests": requests, "seed": seed,
        "references": len(refs), "references_s": round(ref_s, 1), "wall_s": round(wall, 1),
        "metrics": counts, "reply_timings": report.drafts,
        "per_kind": {k: {"statuses": dict(report.statuses[k]), "cut": report.cut[k],
                         "failed": report.failed[k]}
                     for k in sorted(set(report.statuses) | set(report.failed))},
        "failures": dict(report.failures),
    }  # fmt: skip


def _load_references(path: str | None) -> dict:
    """Greedy references kept by an earlier run on the same server and model (--references)."""
    try:
        with open(path or "") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _save_references(path: str | None, refs: dict) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(refs, f)


def _size(path: str) -> int:
    with open(path, "rb") as f:
        return f.seek(0, 2)


def _check(url: str, clients: int, requests: int, kinds: list[str]) -> None:
    from urllib.parse import urlparse

    if urlparse(url).hostname not in LOOPBACK:
        raise LoadTestError(f"--url must point at this machine ({', '.join(sorted(LOOPBACK))})")
    if not 1 <= clients <= MAX_CLIENTS or not 1 <= requests <= MAX_REQUESTS:
        raise LoadTestError(f"--clients 1..{MAX_CLIENTS}, --requests 1..{MAX_REQUESTS}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise LoadTestError(f"--kinds: unknown {unknown}; known: {', '.join(KINDS)}")


@contextlib.contextmanager
def served(server_args: str, log_path: str, ready_timeout: float):
    """`python -m minfer_bench.serve SERVER_ARGS` on a free loopback port, its output in
    log_path; yields its URL once /health says ok, stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "minfer_bench.serve", "--port", str(port), "--log-level", "info",
           *shlex.split(server_args)]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, ready_timeout)
        yield url
    finally:
        stop_server(proc)


def build_parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="python -m minfer_bench.agent_load",
                     description=__doc__.split("\n")[0], allow_abbrev=False)  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (loopback only)")
    p.add_argument("--serve", metavar="ARGS", default=None,
                   help="start the server itself (python -m minfer_bench.serve ARGS, on a free "
                   "port, its log in --log or agent_load_server.log) and stop it after; --url "
                   "is then ignored")  # fmt: skip
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--requests", type=int, default=300, help="requests in all (default 300)")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"kinds of the mix, comma-separated (default: {','.join(KINDS)})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the mix")
    p.add_argument("--reference-url", default=None,
                   help="server for the references alone (default: --url with "
                   "speculative.n_max 0)")  # fmt: skip
    p.add_argument("--references", metavar="FILE", default=None,
                   help="keep the references alone in FILE and reuse them in later runs (same "
                   "server flags and model only)")  # fmt: skip
    p.add_argument("--log", default=None, help="the server's log: tracebacks in it fail the run")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which a request counts as hung (default 600)")  # fmt: skip
    p.add_argument("--settle-timeout", type=float, default=1800.0,
                   help="first wait up to this many seconds for the server's background compiles "
                   "(its verification steps among them: until then nothing drafts); 0: do not "
                   "wait")  # fmt: skip
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    try:
        with contextlib.ExitStack() as stack:
            if args.serve is not None:
                args.log = args.log or "agent_load_server.log"
                args.url = stack.enter_context(served(args.serve, args.log, READY_TIMEOUT_S))
            summary = _run_settled(args)
    except (LoadTestError, OSError, httpx.HTTPError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return _report(summary, args.json)


def _run_settled(args) -> dict:
    if args.settle_timeout > 0:
        wait_settled(args.url.rstrip("/"), args.settle_timeout)
    return asyncio.run(
        run(
            args.url,
            clients=args.clients,
            requests=args.requests,
            kinds=[k for k in args.kinds.split(",") if k],
            seed=args.seed,
            reference_url=args.reference_url,
            references=args.references,
            log=args.log,
            request_timeout=args.request_timeout,
        )  # fmt: skip
    )


def _report(summary: dict, json_path: str | None) -> int:
    """Print the report (JSON, then one line per kind on stderr); the exit status."""
    text = json.dumps(summary, indent=2)
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    for kind, v in sorted(summary["per_kind"].items()):
        sent = sum(v["statuses"].values())
        print(f"{kind:>12}: {sent} sent, {v['cut']} cut at max_tokens, {v['failed']} failed",
              file=sys.stderr)  # fmt: skip
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
